"""Tensors of a model's files that are neither streamed nor trained but carried unchanged into
every checkpoint and the export (a family's `carried`: multi-token-prediction layers, which the
model's forward does not run). A checkpoint holds them in one file beside its shards, written once
from the model directory and linked from one checkpoint to the next; the export adds them to its
shards as they were stored (same names, dtype and bytes)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from megatrain_ray.models.arch import ModelArch
from megatrain_ray.models.registry import family

CARRIED = "carried.safetensors"


def carried_tensors(source: str | Path | None, arch: ModelArch) -> list[tuple[str, Path]]:
    """(name, file) of each carried tensor: all of a checkpoint's carried file, or the tensors of a
    model directory's weight files that the family carries; none without a source."""
    from megatrain_ray.files.hf import read_header, weight_files

    if source is None:
        return []
    source = Path(source)
    if (source / CARRIED).exists():
        return [(name, source / CARRIED) for name in read_header(source / CARRIED)]
    fam = family(arch)
    if fam.carried_note(arch) is None or not (source / "config.json").exists():  # not a model directory
        return []
    return [(name, file) for file in weight_files(source) for name in read_header(file) if fam.carried(arch, name)]


def carry_into(directory: Path, source: str | Path | None, arch: ModelArch) -> None:
    """The carried tensors into a checkpoint's directory: a link to (else a copy of) the source
    checkpoint's file, or the model directory's tensors written one at a time."""
    if source is not None and (Path(source) / CARRIED).exists():
        try:
            os.link(Path(source) / CARRIED, directory / CARRIED)
        except OSError:  # another filesystem, or one without hard links
            shutil.copyfile(Path(source) / CARRIED, directory / CARRIED)
        return
    tensors = carried_tensors(source, arch)
    if tensors:
        write_unchanged(directory / CARRIED, tensors)


def write_unchanged(path: Path, tensors: list[tuple[str, Path]]) -> None:
    """A safetensors file of the named tensors, their stored dtypes and bytes as they are; one
    tensor in memory at a time."""
    from megatrain_ray.files.hf import read_header, read_tensor, write_tensors

    headers = {file: read_header(file) for file in {file for _, file in tensors}}
    specs = [(name, *headers[file][name]) for name, file in tensors]
    write_tensors(path, specs, (read_tensor(file, name) for name, file in tensors))
