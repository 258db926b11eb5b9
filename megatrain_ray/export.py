"""`megatrain-ray export CHECKPOINT OUT_DIR`: master weights of a checkpoint as a Hugging Face model."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from megatrain_ray import checkpoint as ckpt
from megatrain_ray.models.arch import ModelArch, RopeScaling


def arch_from_meta(meta: dict) -> ModelArch:
    fields = dict(meta["arch"])
    if fields.get("rope_scaling"):
        fields["rope_scaling"] = RopeScaling(**fields["rope_scaling"])
    return ModelArch(**fields)


def checkpoint_layers(path: Path, manifest: dict):
    """(layer index, fp32 master) one layer at a time: memory bounded by the largest layer."""
    for layer, file in sorted(ckpt.shard_files_by_layer(path, manifest).items()):
        state, _ = ckpt.read_layer_state(file, layer)
        yield layer, state["master"]


def export_checkpoint(path: Path, out_dir: Path, dtype: str = "float32") -> Path:
    from megatrain_ray.hf import export_hf

    manifest, meta = ckpt.read_manifest(path)
    arch = arch_from_meta(meta)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    export_hf(out_dir, arch, checkpoint_layers(path, manifest), dtype=torch_dtype)
    return out_dir
