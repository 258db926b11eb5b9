"""`megatrain-ray export CHECKPOINT OUT_DIR`: master weights of a checkpoint as a Hugging Face model."""

from __future__ import annotations

import shlex
from pathlib import Path

from megatrain_ray.files import checkpoint as ckpt
from megatrain_ray.host.memory import dtype_of
from megatrain_ray.models.registry import arch_from_dict


def checkpoint_layers(path: Path, manifest: dict):
    """(layer index, fp32 master) one layer at a time: memory bounded by the largest layer."""
    for layer, file in sorted(ckpt.shard_files_by_layer(path, manifest).items()):
        state, _ = ckpt.read_layer_state(file, layer)
        yield layer, state["master"]


def export_checkpoint(path: Path, out_dir: Path, dtype: str = "float32") -> tuple[Path, list[str], str | None]:
    """The export, the tokenizer's files copied beside it from the run's data.tokenizer where that
    is still there, and a warning where AutoTokenizer reads them otherwise (files/hf.py, export_tokenizer)."""
    from megatrain_ray.files.carried import carried_tensors
    from megatrain_ray.files.hf import export_hf, export_tokenizer

    ckpt.check_is_checkpoint(path, lambda found: shlex.join(["megatrain-ray", "export", str(found), str(out_dir)]))
    manifest, meta = ckpt.read_manifest(path)
    arch = arch_from_dict(meta["arch"])
    export_hf(out_dir, arch, checkpoint_layers(path, manifest), dtype=dtype_of(dtype),
              carried=carried_tensors(path, arch))
    tokenizer = ((meta.get("config") or {}).get("data") or {}).get("tokenizer")
    if not tokenizer or not Path(tokenizer).expanduser().exists():
        return out_dir, [], None
    return (out_dir, *export_tokenizer(tokenizer, out_dir))
