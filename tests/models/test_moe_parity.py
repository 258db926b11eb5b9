"""The mixture-of-experts families against transformers' own models: forward, loss with and
without the router's auxiliary loss, every gradient, and 5 steps of `megatrain-ray train`.

Tiny random MixtralForCausalLM, Qwen3MoeForCausalLM (one sparse and one dense layer, and all
sparse) and GptOssForCausalLM (sinks, a sliding window shorter than the sequence, YaRN, a SwiGLU
limit low enough to clamp), 2 layers, hidden 64, 4 experts, top 2, fp32 on the CPU, with
transformers' eager attention and eager experts; saved with save_pretrained (per-expert tensors
for Mixtral and Qwen3-MoE, as the released checkpoints) and read through the project's import.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM  # noqa: E402

from megatrain_ray.config import config_from_dict  # noqa: E402
from megatrain_ray.data import build_dataset  # noqa: E402
from megatrain_ray.models.family import IGNORE_INDEX  # noqa: E402
from helpers.reference_model import ReferenceModel  # noqa: E402
from megatrain_ray.models.registry import load_hf_arch  # noqa: E402
from megatrain_ray.runtime.training import run_training  # noqa: E402
from helpers.reference_training import random_micro_batches  # noqa: E402
from helpers.hf_parity import (RTOL, assert_bf16_tracks, assert_gradients_match, grads_by_hf_name, hf_flats,  # noqa: E402
                       bf16_cuda_config, hf_batch, local_steps, on_cuda, parity_config, randomize, rel, saved,
                               shifted, token_loss_sum, train_transformers)

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
            intermediate_size=128)
MOE = dict(num_experts_per_tok=2)
FAMILIES = {
    "mixtral": (transformers.MixtralConfig, dict(num_local_experts=4)),
    "qwen3_moe": (transformers.Qwen3MoeConfig, dict(num_experts=4, moe_intermediate_size=32, mlp_only_layers=[1],
                                                    norm_topk_prob=True)),
    "qwen3_moe-sparse": (transformers.Qwen3MoeConfig, dict(num_experts=4, moe_intermediate_size=32)),
    "gpt_oss": (transformers.GptOssConfig, dict(num_local_experts=4, head_dim=16, sliding_window=5, swiglu_limit=1.0)),
}
AUX_COEF = 0.3  # large, so that a wrong auxiliary gradient shows next to the token loss's
MiB = 1024**2


def tiny_moe(family: str, aux: bool = False, seed: int = 0):
    config_class, extra = FAMILIES[family]
    torch.manual_seed(seed)
    config = config_class(**TINY, **MOE, **extra, router_aux_loss_coef=AUX_COEF, output_router_logits=aux)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager",
                                             experts_implementation="eager")
    model = swiglu_from_config(model)
    return randomize(model, matrix_std=0.1)  # the routers' and experts' too, so every choice matters


def swiglu_from_config(model):
    """transformers 5.17 (the GPU image's) hard-codes GPT-OSS's SwiGLU alpha 1.702 and limit 7.0 in
    GptOssExperts (its GptOssConfig has no such fields, and keeps swiglu_limit=1.0 only as an extra
    key of config.json, which we import); 5.23 reads them. Set them from the config, so the reference
    computes what config.json says: a limit of 1.0 clamps, 7.0 hardly ever."""
    config = model.config
    for module in model.modules():
        if type(module).__name__ == "GptOssExperts":
            module.alpha = getattr(config, "swiglu_alpha", module.alpha)
            module.limit = getattr(config, "swiglu_limit", module.limit)
    return model


# ---------------------------------------------------------------------------------------------- a


@pytest.mark.parametrize("aux", [False, True], ids=["no-aux", "aux"])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_loss_and_gradients_match_transformers(tmp_path, family, aux):
    model = tiny_moe(family, aux)
    model_dir = saved(model, tmp_path / "hf")
    arch = load_hf_arch(model_dir)
    assert (arch.aux_loss_coef > 0) == aux, "the auxiliary loss is on exactly when config.json says so"
    ids, hf_labels = hf_batch()
    mb = shifted(ids, hf_labels)
    targets = int((mb["labels"] != IGNORE_INDEX).sum())

    model.train()
    out = model(input_ids=ids, labels=hf_labels)
    out.loss.backward()
    hf_grads = {name: p.grad for name, p in model.named_parameters()}
    if aux:
        assert float(out.aux_loss.detach()) > 0

    ref = ReferenceModel(arch, hf_flats(model_dir, arch))
    logits = ref(mb["input_ids"], mb["position_ids"])
    assert rel(logits.detach(), out.logits.detach()) < RTOL
    if aux:
        assert float(ref.aux_loss.detach()) == pytest.approx(AUX_COEF * float(out.aux_loss.detach()), rel=RTOL)
    ref_loss = ref.loss_sum(mb) / targets
    assert float(ref_loss.detach()) == pytest.approx(float(out.loss.detach()), rel=RTOL)
    ref_loss.backward()
    assert_gradients_match(grads_by_hf_name(ref), hf_grads)

    # the streaming executor on the same weights and batch: same loss, same gradient norm
    total = torch.sqrt(sum(g.double().pow(2).sum() for g in hf_grads.values()))
    result, = local_steps(parity_config(model_dir), arch, model_dir, [[mb]])
    assert result.loss == pytest.approx(float(out.loss.detach()), rel=RTOL)
    assert result.grad_norm == pytest.approx(float(total), rel=RTOL)


def test_the_gpt_oss_reference_clamps_at_the_configs_limit():
    """A reference that kept transformers 5.17's limit of 7.0 computed another model: 0.8% off our
    loss at the first step, 2.9% after six (the bf16 GPU check)."""
    model = tiny_moe("gpt_oss")
    ids, _ = hf_batch()
    with torch.no_grad():
        clamped = model(input_ids=ids).logits
        for layer in model.model.layers:
            assert layer.mlp.experts.limit == 1.0
            layer.mlp.experts.limit = 7.0
        assert rel(model(input_ids=ids).logits, clamped) > 1e-2, "the limit must matter to the parity tests"


def test_the_auxiliary_loss_spans_micro_batches_like_transformers_per_call(tmp_path):
    """Two micro-batches in one step: each adds its own load-balancing loss (as one transformers
    forward call computes it), weighted by its share of the step's target tokens."""
    model = tiny_moe("qwen3_moe", aux=True)
    model_dir = saved(model, tmp_path / "hf")
    arch = load_hf_arch(model_dir)
    mbs = [shifted(*hf_batch(seed)) for seed in (1, 2)]
    mbs[1]["labels"][:, :8] = IGNORE_INDEX  # unequal target counts, so that the weighting matters
    target = sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in mbs)
    expected, norm_sq = aux_weighted_step(model, mbs, target, AUX_COEF)

    result, = local_steps(parity_config(model_dir), arch, model_dir, [mbs])
    assert result.loss == pytest.approx(expected, rel=RTOL)
    assert result.grad_norm == pytest.approx(norm_sq**0.5, rel=RTOL)


def aux_weighted_step(model, mbs, target: int, coef: float) -> tuple[float, float]:
    """One step of transformers, gradients only: per micro-batch (summed token loss + coef x aux_loss
    x its target tokens) / the step's target tokens; returns (loss, squared gradient norm)."""
    model.zero_grad(set_to_none=True)
    total = 0.0
    for mb in mbs:
        loss = transformers_loss_sum(model, mb, coef) / target
        loss.backward()
        total += float(loss.detach())
    return total, float(sum(p.grad.double().pow(2).sum() for p in model.parameters()))


def transformers_loss_sum(model, mb, coef: float, autocast_dtype=None) -> torch.Tensor:
    """One micro-batch's summed token loss plus coef x transformers' aux_loss x its target tokens.
    `autocast_dtype` runs the forward under autocast."""
    # use_cache=False: with a cache transformers does not read packed documents from the position ids
    with torch.autocast(mb["input_ids"].device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        out = model(input_ids=mb["input_ids"], position_ids=mb["position_ids"], output_router_logits=coef > 0,
                    use_cache=False)
    labels = mb["labels"]
    mine = int((labels != IGNORE_INDEX).sum())
    return token_loss_sum(out.logits, labels) + (coef * out.aux_loss * mine if coef > 0 else 0.0)


# ---------------------------------------------------------------------------------------------- b


STEPS, GRAD_ACCUM, BATCH, SEQ = 5, 2, 2, 16


def train_config(model_dir: Path, out: Path, coef: float, pack: bool):
    return config_from_dict({
        "model": {"path": str(model_dir), "compute_dtype": "float32", "router_aux_loss_coef": coef},
        # synthetic documents packed into rows: position ids restart, attention stays inside each
        # document (transformers sees the same from the position ids, except GPT-OSS's model, which
        # builds its masks without them: there one document a row)
        "data": {"source": "synthetic", "seq_len": SEQ, "synthetic_docs": 64, "pack": pack},
        # eps and lr as helpers/hf_parity.py's parity_config explains
        "optim": {"lr": 3e-3, "warmup_steps": 2, "grad_clip": 0.5, "weight_decay": 0.1, "min_lr_ratio": 0.1,
                  "eps": 1e-6},
        "train": {"steps": STEPS, "grad_accum": GRAD_ACCUM, "micro_batch_size": BATCH, "seed": 0,
                  "output_dir": str(out)},
        "checkpoint": {"export_hf": True},
        "executor": {"device": "cpu", "loss_chunk_tokens": 7, "compile": False},
        "runtime": {"num_cpus": 2, "object_store_memory": 150 * MiB},
    })


def train_with_aux(model, config, steps_data, coef: float, autocast_dtype=None) -> list[float]:
    """hf_parity.train_transformers with decay on matrices (not biases) and the loss of
    aux_weighted_step: what `megatrain-ray train` is meant to compute."""
    return train_transformers(model, config, steps_data, autocast_dtype,
                              loss_sum=lambda mb: transformers_loss_sum(model, mb, coef, autocast_dtype),
                              decays=lambda name, p: p.dim() >= 2 and not name.endswith("bias"))


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_five_steps_of_train_export_equal_transformers_adamw(local_ray, tmp_path, family):
    model = tiny_moe(family, aux=False)  # config.json says off; the run's config turns it on
    model_dir = saved(model, tmp_path / "hf")
    packed = family != "gpt_oss"
    config = train_config(model_dir, tmp_path / "run", AUX_COEF, pack=packed)
    initial = {k: v.clone() for k, v in model.state_dict().items()}

    summary = run_training(config)

    dataset = build_dataset(config.data, TINY["vocab_size"], config.train.seed)
    batches = dataset.batches(BATCH, GRAD_ACCUM)
    steps_data = [[{k: torch.as_tensor(v) for k, v in mb.items()} for mb in next(batches)[0]] for _ in range(STEPS)]
    assert any(int((mb["position_ids"][:, 1:] == 0).sum()) for step in steps_data for mb in step) == packed
    ref_losses = train_with_aux(model, config, steps_data, AUX_COEF)

    records = [json.loads(line) for line in Path(summary["metrics"]).read_text().splitlines()]
    assert all(r["grad_norm"] > config.optim.grad_clip for r in records), "clipping must be active"
    assert [r["loss"] for r in records] == pytest.approx(ref_losses, rel=RTOL)

    export = Path(summary["checkpoint"]) / "hf"
    exported_config = json.loads((export / "config.json").read_text())
    assert exported_config["output_router_logits"] and exported_config["router_aux_loss_coef"] == AUX_COEF
    exported = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    ours, theirs = exported.state_dict(), model.state_dict()
    assert set(ours) == set(theirs)
    for name, expected in theirs.items():
        assert rel(ours[name], expected) < RTOL, name
        assert not torch.equal(ours[name], initial[name]), f"{name} did not train"


# ---------------------------------------------------------------------------------------------- c


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_bf16_on_the_gpu_tracks_transformers_autocast(tmp_path, family):
    """The CUDA path: bf16, the compiled block, grouped_mm, the auxiliary loss on."""
    steps = 6
    model = tiny_moe(family, aux=True)
    model_dir = saved(model, tmp_path / "hf")
    arch = load_hf_arch(model_dir)
    config = bf16_cuda_config(model_dir, steps, GRAD_ACCUM)
    data = random_micro_batches(arch, steps, GRAD_ACCUM, batch=2, seq=128, seed=0, distinct=4)

    ours = [r.loss for r in local_steps(config, arch, model_dir, data)]
    theirs = train_with_aux(model.to("cuda"), config, on_cuda(data), AUX_COEF, autocast_dtype=torch.bfloat16)
    assert_bf16_tracks(family, ours, theirs)
