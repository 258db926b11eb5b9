"""Before a model trains through transformers' modules: structures the family does not run are
refused by name, and a small random instance of the same config class (one layer of each
structure, small widths) runs through both paths, the family's streamed templates and
transformers' own full forward and backward, which must agree.

Both paths run the same modules, so what the check catches is what the family takes apart around
them: an argument the decoder passes its layers that the recording missed, a scaling in the
decoder's forward, a head that is not the final norm and LM head, names that do not line up.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import torch
import torch.nn.functional as F

from megatrain_ray.models import image_text
from megatrain_ray.models.layout import with_shared
from megatrain_ray.models.transformers import modules as hm

RTOL = 1e-4  # fp32, the same modules on the same weights: only summation order differs


def refusal(config: dict[str, Any]) -> str | None:
    """Why the transformers family cannot run this config.json, in one paragraph; None if it can."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = config.get("model_type")
    if not hm.of_image_text_model(config) and model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return (f"the installed transformers has no causal language model for model_type {model_type!r} "
                "(AutoModelForCausalLM does not know it); a newer transformers may")
    try:
        config = {**hm.config_object(config).to_dict(), **config}  # the config class's defaults filled in
    except Exception as e:  # transformers refusing its own config: say what it said
        return f"transformers cannot read this config: {type(e).__name__}: {e}"
    if config.get("is_encoder_decoder"):
        return "it is an encoder-decoder model; megatrain-ray trains decoder-only causal language models"
    if isinstance(config.get("layerdrop"), (int, float)) and config["layerdrop"] > 0:
        return (f"its decoder skips each layer at random in training (layerdrop: {config['layerdrop']}), which a "
                "streamed step, running every layer, does not do; set layerdrop to 0 in config.json to train it")
    try:
        hm.decoder_parts(hm.build_empty(config))
    except hm.Unsupported as e:
        return f"{e}; megatrain-ray runs decoder-only models whose decoder is an embedding, a list of layers, " \
               "a final norm and an LM head"
    except Exception as e:  # transformers refusing its own config: say what it said
        return f"transformers cannot build it from this config: {type(e).__name__}: {e}"
    if hm.is_image_text(config):
        return image_text.refusal(config)
    if config.get("output_router_logits") and not records_router_logits(config):
        return ("its router's load-balancing loss is on (output_router_logits: true), but transformers' model "
                "records no router logits for it; set model.router_aux_loss_coef to 0 (or output_router_logits "
                "to false in config.json) to train without it")
    return None


def records_router_logits(config: dict[str, Any]) -> bool:
    from megatrain_ray.models.transformers.router import router_recorder

    try:
        return router_recorder(hm.build_empty(config)) is not None
    except Exception:
        return False


# ---------------------------------------------------------------------------------------------
# Both paths on the small instance
# ---------------------------------------------------------------------------------------------


def random_model(config: dict[str, Any], seed: int = 0):
    """transformers' model of `config` in fp32 with random weights: matrices as the model draws
    them, vectors (norms, biases) off their usual 1 or 0, so that a misplaced one shows."""
    torch.manual_seed(seed)
    model = hm.build_small(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def sample_batch(vocab: int, seed: int = 1) -> dict[str, torch.Tensor]:
    """Two rows of 12 tokens; the second packs two documents (positions restart)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (2, 12), generator=gen)
    positions = torch.stack([torch.arange(12), torch.cat([torch.arange(5), torch.arange(7)])])
    labels = torch.randint(0, vocab, (2, 12), generator=gen)
    return {"input_ids": ids, "position_ids": positions, "labels": labels}


def transformers_path(model, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Logits and the gradients of the summed token loss (plus the router's loss, where on, weighted
    by the tokens as a mean loss would weigh it)."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
    logits = out.logits
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1), reduction="sum")
    if getattr(out, "aux_loss", None) is not None:
        loss = loss + model.router_aux_loss_coef * out.aux_loss * batch["labels"].numel()
    loss.backward()
    grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}
    return logits.detach(), grads


def streamed_path(arch, model, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The family's templates, layer after layer, on the model's weights."""
    from megatrain_ray.models.transformers.family import TRANSFORMERS

    fam = TRANSFORMERS
    state = model.state_dict()
    layouts = fam.layouts(arch)
    bound = [{p.name: state[layout.hf_name(p.name)].detach().clone().requires_grad_(True) for p in layout.params}
             for layout in layouts]
    x = fam.embed(arch, bound[0], fam.embed_inputs(arch, batch))
    ctx = fam.context(arch, batch["position_ids"], x.dtype)
    aux, stats = fam.aux_loss_on(arch), []
    for layout in layouts[1:-1]:
        call = fam.layer_context(arch, ctx, layout.index)
        w = with_shared(bound[layout.index], [bound[held] for held in layout.shares])
        if aux:
            x, s = fam.block(arch, w, x, call, aux=True)
            stats += [] if s is None else [s]
        else:
            x = fam.block(arch, w, x, call)
    logits = fam.logits(arch, bound[-1], bound[0], x)
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1), reduction="sum")
    if stats:
        totals = sum(s.detach() for s in stats)
        loss = loss + sum(fam.aux_loss_term(arch, s, totals) for s in stats) * batch["labels"].numel()
    loss.backward()
    grads = {}
    for layout, w in zip(layouts, bound):
        for name, t in w.items():
            g = t.grad if t.grad is not None else torch.zeros_like(t)
            grads[layout.hf_name(name)] = grads[layout.hf_name(name)] + g if layout.hf_name(name) in grads else g
    return logits.detach(), grads


def differences(arch, model, batch) -> list[str]:
    theirs_logits, theirs = transformers_path(model, batch)
    ours_logits, ours = streamed_path(arch, model, batch)
    out = []
    if relative_difference(ours_logits, theirs_logits) > RTOL:
        out.append(f"the logits differ (relative difference {relative_difference(ours_logits, theirs_logits):.1e})")
    named = dict(model.named_parameters())
    for name in named:
        if name not in ours:
            out.append(f"{name} has no place in the streamed layers")
            continue
        differs = relative_difference(ours[name], theirs[name])
        if differs > RTOL and float((ours[name] - theirs[name]).norm()) > 1e-6:
            out.append(f"the gradient of {name} differs (relative difference {differs:.1e})")
    return out


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a - b| / |b| in float64 (the tests compare with transformers by it too)."""
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def worst_relative_difference(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The largest |ours - theirs| of a tensor, relative to its norm or, where that is under 1e-3 of
    all of `theirs`, to that, in float64, and the tensor's name: a tensor whose true gradient is zero
    (a key projection's bias, which softmax ignores; the pad token's embedding row) holds only the
    rounding noise of its path, and AdamW steps on that noise, which no two orders of summation share.
    The tests' comparison of gradients and the model table's of trained weights."""
    total = float(torch.sqrt(sum(t.double().pow(2).sum() for t in theirs.values())))
    return max(((float((ours[k].double() - t.double()).norm()) / max(float(t.double().norm()), 1e-3 * total, 1e-30), k)
                for k, t in theirs.items()), default=(0.0, ""))


@functools.lru_cache(maxsize=16)
def check_config(config_json: str) -> str | None:
    """The reason the two paths differ on a small instance of this config, or None."""
    from megatrain_ray.models.transformers.arch import arch_from_config, random_settings

    config = json.loads(config_json)
    parts = hm.parts_of(config_json)
    small = hm.small_config(config, parts.kinds)
    # both paths without dropout: it compares their structure (streaming/rng.py replays the draws)
    small.update({k: type(v)(0) for k, v in random_settings(small).items()})
    # where the model will run when this machine has a GPU: transformers picks a kernel package's
    # GPU-only kernels (flash-linear-attention's Triton ones) wherever it is installed
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        arch = arch_from_config(small)
        model = random_model(arch.config).to(device)
        found = differences(arch, model, {k: v.to(device) for k, v in sample_batch(arch.vocab_size).items()})
    except Exception as e:
        return f"running a small instance of it failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    if found:
        return "on a small random instance, its streamed layers and transformers' own model disagree: " + "; ".join(found[:3])
    return None


def checked(arch):
    """`arch` once a small instance of its config ran alike through both paths; a ValueError that
    says how they differed otherwise. An image-text model is of a covered type (image_text.COVERED,
    each checked against transformers by the tests, images included): a small instance of it
    needs the sizes of its vision tower cut to match its processor's, which differ by type."""
    if hm.is_image_text(arch.config):
        return arch
    why = check_config(arch.hf_config)
    if why:
        raise ValueError(" ".join(f"model_type {arch.model_type!r} cannot be trained through transformers' modules: "
                                  f"{why}".split()))
    return arch
