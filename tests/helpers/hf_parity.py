"""What the three suites against transformers' own models share (test_transformers_parity: the
Llama family; test_families_parity: Gemma 3 and Phi; test_moe_parity: mixtures of experts): tiny
models whose every tensor matters, their files read through the project's import, and the checks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from megatrain_ray.config import config_from_dict
from megatrain_ray.data import build_dataset
from megatrain_ray.files import shard
from megatrain_ray.files.hf import export_hf, load_hf_weights
from megatrain_ray.runtime.local import LocalTrainer
from helpers.reference_model import ReferenceModel
from megatrain_ray.models.layout import module_key
from megatrain_ray.models.transformers.check import relative_difference as rel  # noqa: F401 (the tests' name for it)
from megatrain_ray.models.transformers.check import worst_relative_difference
from megatrain_ray.models.registry import model_layouts
from megatrain_ray.models.transformers import modules as hm
from helpers.reference_training import adamw_loop

RTOL = 1e-5


def randomize(model, matrix_std: float | None = None):
    """Norms start at exactly 1 (Gemma's at 0), biases and sinks at 0: random values, so that a
    misplaced one shows; with `matrix_std`, the matrices are redrawn too."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.normal_(1.0 if p.abs().sum() > 0 else 0.0, 0.3)
            elif matrix_std is not None:
                p.normal_(0.0, matrix_std)
    return model


def small_config_of(model_type: str, overrides: dict | None = None, sizes: dict = hm.SMALL) -> dict:
    """transformers' defaults for `model_type`, with `overrides`, made small in `sizes`
    (modules.small_config)."""
    from transformers import AutoConfig

    full = {**AutoConfig.for_model(model_type).to_dict(), **(overrides or {})}
    full = {k: v for k, v in full.items() if k not in ("transformers_version", "architectures")}
    return hm.small_config(full, hm.decoder_parts(hm.build_empty(full)).kinds, sizes)


def small_random_model(config: dict, seed: int = 0):
    """transformers' model of a small config, its tensors drawn from `seed` and `randomize`d."""
    torch.manual_seed(seed)
    return randomize(hm.build_small(config))


def saved(model, directory: Path) -> Path:
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def hf_flats(model_dir: Path, arch) -> list[torch.Tensor]:
    """The project's flat layer buffers, read from a Hugging Face directory (NaN where nothing landed)."""
    flats = [torch.full((layout.numel,), float("nan")) for layout in model_layouts(arch)]
    load_hf_weights(model_dir, arch, flats.__getitem__)
    return flats


def flat_weights(model, arch) -> list[tuple[int, torch.Tensor]]:
    """(layer, flat weights) of a transformers model, as the stores hold them."""
    state = model.state_dict()
    return [(layout.index, torch.cat([state[layout.hf_name(p.name)].reshape(-1) for p in layout.params]))
            for layout in model_layouts(arch)]


def grads_by_hf_name(ref: ReferenceModel) -> dict[str, torch.Tensor]:
    """The reference model's gradients under transformers' in-memory names (the layouts' names)."""
    return {layout.hf_name(p.name): getattr(module, module_key(p.name)).grad
            for layout, module in zip(ref.layouts, ref.layers, strict=True) for p in layout.params}


def assert_gradients_match(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    """Relative per tensor, except where the true gradient is (nearly) zero (a bias softmax ignores,
    the pad token's embedding row): there against the whole gradient's norm."""
    assert set(ours) == set(theirs), "every transformers parameter has exactly one counterpart"
    worst, name = worst_relative_difference(ours, theirs)
    assert worst <= RTOL, (name, worst)


def local_steps(config, arch, model_dir: Path, steps_data) -> list:
    """The streaming executor in one process, its stores loaded from `model_dir`: each step's result."""
    trainer = LocalTrainer(config, arch)
    try:
        for store in trainer.stores:
            shard.load_hf(store, str(model_dir))
        return [trainer.train_step(step) for step in steps_data]
    finally:
        trainer.close()


def steps_and_export(config, arch, model_dir: Path, steps_data, export_dir: Path) -> tuple[list[float], Path]:
    """The streaming trainer in one process from `model_dir`'s weights: each step's loss, and its
    Hugging Face export after the last."""
    trainer = LocalTrainer(config, arch)
    try:
        for store in trainer.stores:
            shard.load_hf(store, str(model_dir))
        losses = [trainer.train_step(step).loss for step in steps_data]
        return losses, export_hf(export_dir, arch, enumerate(trainer.layer_weights()))
    finally:
        trainer.close()


def save(trainer: LocalTrainer, directory: Path) -> dict[int, str]:
    """The in-process trainer's stores as checkpoint shards in `directory`: each layer's file."""
    trainer.source.drain()
    files = {}
    for k, store in enumerate(trainer.stores):
        shard.save_shard(store, str(directory), f"shard{k}.safetensors")
        files.update({i: str(directory / f"shard{k}.safetensors") for i in store.layers})
    return files


def bf16_cuda_config(model_dir: Path, steps: int, grad_accum: int, **sections):
    """The bf16 GPU checks' run: the executor compiles the block (its default), 2-row micro-batches."""
    return config_from_dict({
        "model": {"path": str(model_dir), "compute_dtype": "bfloat16"},
        "optim": {"lr": 3e-3, "warmup_steps": 2, "grad_clip": 1.0},
        "train": {"steps": steps, "grad_accum": grad_accum, "micro_batch_size": 2},
        "executor": {"device": "cuda", "loss_chunk_tokens": 256},
        **sections,
    })


def assert_bf16_tracks(name: str, ours: list[float], theirs: list[float]) -> None:
    """bf16 runs cannot match to the bit: the losses track each other within 2% and go down."""
    print(f"{name} ours", ours, "\ntransformers", theirs)
    assert ours[-1] < ours[0], "the loss must go down"
    for a, b in zip(ours, theirs, strict=True):
        assert a == pytest.approx(b, rel=0.02)


def on_cuda(steps_data):
    return [[{k: v.cuda() for k, v in mb.items()} for mb in step] for step in steps_data]


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                           ignore_index=-100, reduction="sum")


def matrices(name: str, p: torch.Tensor) -> bool:
    """Weight decay on every matrix (transformers' parameters of two or more dimensions)."""
    return p.dim() >= 2


def muon_matrices(name: str, p: torch.Tensor) -> bool:
    """What torch.optim.Muon steps with optim.name muon: the decoder layers' matrices (stacked experts
    too), no bias."""
    return ".layers." in name and p.dim() >= 2 and not name.endswith("bias")


def train_transformers(model, config, steps_data, autocast_dtype=None, loss_sum=None, decays=matrices) -> list[float]:
    """The transformers model in the plain loop (reference_training.adamw_loop), decay where
    `decays(name, parameter)` says (default: on matrices only). Packed rows go in as they are, with
    their position_ids (transformers masks each document). `autocast_dtype` runs the forward (only:
    never the optimizer) under autocast; `loss_sum(mb)`: a micro-batch's summed loss (default: the
    summed token loss)."""
    named = list(model.named_parameters())  # tied weights appear once

    def token_loss(mb):
        with torch.autocast(mb["input_ids"].device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            logits = model(input_ids=mb["input_ids"], position_ids=mb["position_ids"], use_cache=False).logits
        return token_loss_sum(logits, mb["labels"])

    model.train()
    muon = [p for n, p in named if config.optim.name == "muon" and muon_matrices(n, p)]
    adam = [(n, p) for n, p in named if not any(p is q for q in muon)]
    groups = ([p for n, p in adam if decays(n, p)], [p for n, p in adam if not decays(n, p)])
    return adamw_loop(config, groups, [p for _, p in named], steps_data, loss_sum or token_loss, muon=muon)


def tiny_hf_model(families: dict, tiny: dict, name: str, seed: int = 0, dtype=torch.float32):
    """A small transformers model of `families[name]` ((config class, extra config, attention
    implementation)) on the `tiny` shape, its weights drawn from `seed`."""
    from transformers import AutoModelForCausalLM

    config_class, extra, attn = families[name]
    torch.manual_seed(seed)
    return randomize(AutoModelForCausalLM.from_config(config_class(**tiny, **extra), dtype=dtype,
                                                      attn_implementation=attn))


def hf_batch(seed: int = 1, vocab: int = 256, batch: int = 2, seq: int = 12):
    """Token ids and transformers-style (unshifted) labels with a few ignored positions."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=gen)
    labels = ids.clone()
    labels[torch.rand(labels.shape, generator=gen) < 0.15] = -100
    return ids, labels


def shifted(ids: torch.Tensor, hf_labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """The project's micro-batch: labels[t] is the target of position t; the last position has none."""
    labels = torch.full_like(hf_labels, -100)
    labels[:, :-1] = hf_labels[:, 1:]
    positions = torch.arange(ids.shape[1]).expand_as(ids).contiguous()
    return {"input_ids": ids, "labels": labels, "position_ids": positions}


# eps 1e-6 as in helpers/runs.py's make_config: the k_proj bias has an exactly-zero true gradient,
# and a tiny eps turns both sides' rounding noise there into unequal full steps. lr 3e-3: weights
# move by about 0.5% in 5 steps; at 1e-2 these random-token runs diverge (the loss rises) and Adam
# amplifies fp32 rounding to ~1e-5 in a few embedding rows. grad_clip 0.5: clipping on every step.
PARITY_OPTIM = {"lr": 3e-3, "warmup_steps": 2, "grad_clip": 0.5, "weight_decay": 0.1, "min_lr_ratio": 0.1, "eps": 1e-6}


def parity_config(model_dir: Path, steps: int = 5, grad_accum: int = 2, batch: int = 2, **optim):
    return config_from_dict({
        "model": {"path": str(model_dir), "compute_dtype": "float32"},
        "optim": {**PARITY_OPTIM, **optim},
        "train": {"steps": steps, "grad_accum": grad_accum, "micro_batch_size": batch, "seed": 0},
        "executor": {"device": "cpu", "loss_chunk_tokens": 7, "compile": False},
    })


def run_config(model_dir: Path, data: Path, out: Path, *, pack: bool, seq: int, steps: int = 5, grad_accum: int = 2,
               batch: int = 2) -> dict:
    """A run of `megatrain-ray train` (as a config dict) on token documents, exporting fp32 weights."""
    return {
        "model": {"path": str(model_dir), "compute_dtype": "float32"},
        "data": {"source": str(data), "format": "tokens", "seq_len": seq, "pack": pack},
        "optim": dict(PARITY_OPTIM),
        "train": {"steps": steps, "grad_accum": grad_accum, "micro_batch_size": batch, "seed": 0,
                  "output_dir": str(out)},
        "checkpoint": {"export_hf": True, "export_dtype": "float32"},
        "executor": {"device": "cpu", "loss_chunk_tokens": 7, "compile": False},
    }


def the_runs_batches(config, vocab_size: int) -> list[list[dict[str, torch.Tensor]]]:
    """The micro-batches a run draws: its dataset is a pure function of (config, seed)."""
    batches = build_dataset(config.data, vocab_size, config.train.seed).batches(
        config.train.micro_batch_size, config.train.grad_accum)
    steps = []
    for _ in range(config.train.steps):
        step, _position = next(batches)
        steps.append([{k: torch.as_tensor(np.asarray(v)) for k, v in mb.items()} for mb in step])
    return steps
