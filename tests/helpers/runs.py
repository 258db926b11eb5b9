"""The small runs the tests start: the in-process trainer's config, the driver's YAML-equivalent
config, the weights a run's checkpoint holds, and a run's start as another run stood at a step."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import ray
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from megatrain_ray import cli
from megatrain_ray.config import Config, config_from_dict
from megatrain_ray.files import checkpoint as ckpt

STEPS, GRAD_ACCUM = 3, 2  # make_config's step count and micro-batches per step


def make_config(preset: str, steps: int = STEPS, model: dict | None = None, optim: dict | None = None,
                **executor) -> Config:
    """fp32 on the CPU with clipping, weight decay and a decaying LR all active: what the streaming
    trainer and plain PyTorch must agree on. `model`, `optim`: keys that replace these."""
    return config_from_dict({
        "model": {"preset": preset, "compute_dtype": "float32", "init_std": 0.2, **(model or {})},
        # A low clip threshold so that clipping is active on every step. eps 1e-6, not 1e-8: the
        # k_proj bias has an exactly-zero gradient (softmax ignores a per-query shift), and Adam
        # with a tiny eps turns both sides' rounding noise there into full-size, unequal steps.
        "optim": {"lr": 1e-2, "warmup_steps": 1, "grad_clip": 0.5, "weight_decay": 0.1, "min_lr_ratio": 0.1,
                  "eps": 1e-6, **(optim or {})},
        "train": {"steps": steps, "grad_accum": GRAD_ACCUM, "micro_batch_size": 2, "seed": 3},
        "executor": {"device": "cpu", "loss_chunk_tokens": 5, **executor},
    })


def command_here(argv: list[str], capsys) -> subprocess.CompletedProcess:
    """`megatrain-ray *argv` through the command's entry in this process (a Python started for it would
    import torch and the package again: seconds on 2 cores): its exit status and what it printed, read
    from pytest's `capsys`. This process leaves the Ray the command joined or started, if any."""
    try:
        code = cli.main(argv)
    finally:
        ray.shutdown()
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["megatrain-ray", *argv], code, out, err)


def tiny_raw(out: Path, steps: int = 10, **sections) -> dict:
    """A small YAML-equivalent config: fp32 on the CPU so that equal means bit-equal."""
    raw = {
        "model": {"preset": "tiny-llama", "compute_dtype": "float32", "init_std": 0.2},
        "data": {"source": "synthetic", "seq_len": 16, "synthetic_docs": 64},
        "optim": {"lr": 3e-3, "warmup_steps": 2},
        "train": {"steps": steps, "micro_batch_size": 2, "grad_accum": 2, "output_dir": str(out)},
        "checkpoint": {"every": 5, "keep": 5, "export_hf": False},
        "executor": {"device": "cpu", "compile": False},
    }
    for section, values in sections.items():
        raw[section] = {**raw.get(section, {}), **values}
    return raw


def kernel_cache() -> dict[str, str]:
    """The environment that keeps this process's build cache of the host AdamW kernel for a run
    given a fresh HOME: the build is once per machine (about 40 s on 2 cores), and a test's fresh
    HOME stands for a fresh user's, not for a machine that never built it."""
    from torch.utils.cpp_extension import get_default_build_root

    return {"TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()}


def tensors_of(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory's safetensors shards, by name, with those of the disk
    tier's files linked beside them (files/checkpoint.py, LINKED)."""
    out = {}
    for file in sorted(checkpoint.glob("*.safetensors")):
        out.update(load_file(str(file)))
        with safe_open(str(file), framework="pt") as f:
            linked = json.loads((f.metadata() or {}).get(ckpt.LINKED, "{}"))
        for layer, files in linked.items():
            for linked_file in files:
                out.update({ckpt.tensor_name(int(layer), key): t for key, t in
                            ckpt.read_parts(checkpoint / linked_file["file"], linked_file["parts"]).items()})
    return out


def assert_same_checkpoints(expected: Path, got: Path) -> None:
    """The two checkpoint directories hold the same tensors, bit for bit."""
    want, have = tensors_of(expected), tensors_of(got)
    assert want.keys() == have.keys()
    for name, tensor in want.items():
        assert torch.equal(have[name], tensor), name


def as_stood_at(whole: Path, split: Path, step: int) -> None:
    """The run in `whole` as it stood after `step` (its checkpoint of that step, its metrics rows to
    then) in the directory `split`: a resume from there is a run of its own, the second half of
    "N steps in one go equal the first k + resume" without a third run for the first k."""
    name = f"step-{step:08d}"
    (split / "checkpoints").mkdir(parents=True)
    shutil.copytree(whole / "checkpoints" / name, split / "checkpoints" / name)
    rows = (whole / "metrics.jsonl").read_text().splitlines()[:step]
    (split / "metrics.jsonl").write_text("".join(row + "\n" for row in rows))
