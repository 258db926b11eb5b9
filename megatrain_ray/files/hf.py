"""Hugging Face model directories in and out of the per-layer flat buffers.

Import reads safetensors one tensor at a time straight into each layer's flat fp32 buffer, after
checking every file's header against the layout, so a wrong checkpoint fails before any buffer is
touched and host memory never holds more than one extra tensor. Export writes shards layer by
layer into a temporary directory that is renamed into place only once complete.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import torch
from safetensors import safe_open

from megatrain_ray.files.durable import publish_dir, write_json
from megatrain_ray.models.arch import ModelArch
from megatrain_ray.models.layout import ParamSlot
from megatrain_ray.models.registry import (arch_from_hf_config, arch_to_hf_config, family, hf_names,
                                           implementation_of, model_layouts)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
# what a carried tensor may be stored as besides (files/carried.py)
STORED_DTYPES = {**SAFETENSORS_DTYPES, torch.float64: "F64", torch.float8_e4m3fn: "F8_E4M3",
                 torch.float8_e5m2: "F8_E5M2", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
                 torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
ITEM_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4, "I16": 2,
              "I8": 1, "U8": 1, "BOOL": 1}
CONFIG_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
COMPARE_CHUNK_BYTES = 16 * 1024**2


class CheckpointMismatch(ValueError):
    """A Hugging Face checkpoint that does not fit the model; the message names the first bad tensor and file."""


# ---------------------------------------------------------------------------------------------- import


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a model directory, in the order transformers would pick them."""
    single, index = model_dir / SINGLE_FILE, model_dir / INDEX_FILE
    if single.exists():
        return [single]
    if not index.exists():
        raise FileNotFoundError(
            f"no {SINGLE_FILE} or {INDEX_FILE} in {model_dir} (only safetensors checkpoints are supported)"
        )
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise CheckpointMismatch(f"cannot read the weight_map of {index}: {err}") from err
    files = [model_dir / name for name in sorted(set(weight_map.values()))]
    for file in files:
        if not file.exists():
            first = min(name for name, f in weight_map.items() if model_dir / f == file)
            raise CheckpointMismatch(f"{first}: {index} places it in {file.name}, which does not exist")
    return files


def check_config(model_dir: Path, arch: ModelArch) -> None:
    """The directory's config.json must describe the model we are about to fill."""
    path = model_dir / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"no config.json in {model_dir}")
    found = arch_from_hf_config(json.loads(path.read_text()), implementation_of(arch))
    diffs = [
        f"{name}: expected {getattr(arch, name)!r}, found {getattr(found, name)!r}"
        for name in arch.model_fields()
        if getattr(arch, name) != getattr(found, name)
    ]
    if diffs:
        raise CheckpointMismatch(f"{path} describes a different model: " + "; ".join(diffs))


def read_header(file: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, dtype) from a file's header, without reading tensor data."""
    try:
        with safe_open(str(file), framework="pt") as f:
            header = {}
            for name in f.keys():
                piece = f.get_slice(name)
                header[name] = (tuple(piece.get_shape()), piece.get_dtype())
            return header
    except Exception as err:  # safetensors raises its own error type for truncated or corrupt files
        raise CheckpointMismatch(f"cannot read {file}: {err} (truncated or corrupt safetensors file?)") from err


def is_ignored(name: str) -> bool:
    """Buffers some old checkpoints carry that are recomputed, not learned."""
    return name.endswith("rotary_emb.inv_freq")


def plan_reads(files: list[Path], arch: ModelArch) -> tuple[list[tuple[str, Path, int, ParamSlot]], Path | None]:
    """Check every header against the layout; returns what to copy where, and the file of a tied lm_head."""
    expected = hf_names(arch)
    fam = family(arch)
    tied_head = fam.tied_head_name
    where: dict[str, Path] = {}
    reads, tied_head_file = [], None
    for file in files:
        for stored, (shape, dtype) in sorted(read_header(file).items()):
            name = fam.read_as(arch, stored)
            if is_ignored(name) or fam.carried(arch, name):  # carried: files/carried.py
                continue
            if name in where:
                raise CheckpointMismatch(f"{name}: present twice, in {where[name]} and in {file}")
            where[name] = file
            if name == tied_head and arch.tie_word_embeddings:
                tied_head_file = file
                check_shape(name, (arch.vocab_size, arch.hidden_size), shape, file)
                continue
            if name not in expected:
                raise CheckpointMismatch(f"{name}: unexpected tensor (expected none, found shape {shape}) in {file}")
            layer, slot = expected[name]
            check_shape(name, slot.shape, shape, file)
            if dtype not in FLOAT_DTYPES:
                raise CheckpointMismatch(f"{name}: dtype {dtype} is not a float type, in {file}")
            reads.append((stored, file, layer, slot))
    for name, (_, slot) in expected.items():
        if name not in where:
            files_text = ", ".join(str(f) for f in files)
            raise CheckpointMismatch(f"{name}: missing (expected shape {slot.shape}, found none) in {files_text}")
    return reads, tied_head_file


def check_shape(name: str, expected: tuple[int, ...], found: tuple[int, ...], file: Path) -> None:
    if tuple(expected) != tuple(found):
        raise CheckpointMismatch(f"{name}: expected shape {tuple(expected)}, found {tuple(found)} in {file}")


def read_tensor(file: Path, name: str) -> torch.Tensor:
    """One tensor; the file is opened per tensor because closing it unmaps it, so at most one
    tensor's pages stay resident instead of the whole shard's."""
    try:
        with safe_open(str(file), framework="pt") as f:
            return f.get_tensor(name)
    except Exception as err:
        raise CheckpointMismatch(f"{name}: cannot read it from {file}: {err}") from err


def read_rows(file: Path, name: str, start: int, stop: int) -> torch.Tensor:
    try:
        with safe_open(str(file), framework="pt") as f:
            return f.get_slice(name)[start:stop]
    except Exception as err:
        raise CheckpointMismatch(f"{name}: cannot read it from {file}: {err}") from err


def check_tied_head(arch: ModelArch, head_file: Path, embed_file: Path) -> None:
    """A tied model may still store lm_head.weight; accept it only if it is the embedding, compared in
    row chunks so that memory stays bounded."""
    fam = family(arch)
    rows = max(1, COMPARE_CHUNK_BYTES // (4 * arch.hidden_size))
    for start in range(0, arch.vocab_size, rows):
        stop = min(start + rows, arch.vocab_size)
        head = read_rows(head_file, fam.tied_head_name, start, stop)
        embed = read_rows(embed_file, fam.embed_name, start, stop)
        if not torch.equal(head.float(), embed.float()):
            raise CheckpointMismatch(
                f"{fam.tied_head_name}: config ties it to {fam.embed_name} but the stored tensor differs "
                f"(rows {start}..{stop}), in {head_file}"
            )


def load_hf_weights(
    model_dir: str | Path,
    arch: ModelArch,
    layer_buffer: Callable[[int], torch.Tensor],
    layers: Iterable[int] | None = None,
    threads: int = 1,
    checked: bool = False,
) -> None:
    """Fill each layer's flat fp32 buffer from a Hugging Face safetensors model directory.

    The whole checkpoint is validated (config, names, shapes) before anything is copied. `layers`
    restricts the copy to the layers a caller owns (a store holding part of the model); every
    tensor is still checked. `threads`: how many read at once (copy_tensors). `checked`: the
    directory passed `check_hf_dir` already (a store loading it a layer at a time): its config and
    a stored tied head are not read again.
    """
    model_dir = Path(model_dir)
    reads = plan_reads(weight_files(model_dir), arch)[0] if checked else check_hf_dir(model_dir, arch)
    wanted = None if layers is None else set(layers)
    buffers: dict[int, torch.Tensor] = {}
    targets = []
    for name, file, layer, slot in reads:
        if wanted is not None and layer not in wanted:
            continue
        if layer not in buffers:
            buffers[layer] = checked_buffer(layer_buffer(layer), layer, arch)
        targets.append((name, file, buffers[layer][slot.offset : slot.offset + slot.numel]))
    copy_tensors(targets, threads)


# A piece of a tensor read by one thread: large enough that a read is a few syscalls, small enough
# that one layer (a 7B block: 0.47 GB in bf16, loaded alone when the first step reads it as it lands)
# spreads over a store's threads.
READ_PIECE_BYTES = 16 * 2**20


def copy_tensors(targets: list[tuple[str, Path, torch.Tensor]], threads: int = 1) -> None:
    """Each named tensor of a safetensors file into its flat target, in pieces over `threads`, read
    straight from the file at its offset: into the target itself where the dtypes match, else into a
    scratch buffer and widened from bf16 to fp32 by numpy (exact, as torch's cast): no per-tensor
    open, no copy in between, and the GIL released in the read and the widening. Other dtype pairs
    are copied by torch, one tensor at a time, in torch's own threads."""
    offsets = {file: tensor_offsets(file) for file in {file for _, file, _ in targets}}
    fast, slow = [], []
    for name, file, target in targets:
        dtype, begin, end = offsets[file][name]
        if end - begin != target.numel() * ITEM_BYTES.get(dtype, 0):
            raise CheckpointMismatch(f"{name}: {end - begin} bytes in {file} for {target.numel()} elements of {dtype}")
        if (dtype, target.dtype) in DIRECT_READS:
            step = READ_PIECE_BYTES // ITEM_BYTES[dtype]
            fast += [(file, dtype, begin, target, k, min(k + step, target.numel())) for k in range(0, target.numel(), step)]
        else:
            slow.append((name, file, target))
    fds = {file: os.open(file, os.O_RDONLY) for file in offsets}
    try:
        def read(piece) -> None:
            file, dtype, begin, target, lo, hi = piece
            read_piece(fds[file], dtype, begin + lo * ITEM_BYTES[dtype], target[lo:hi])

        if threads > 1 and len(fast) > 1:
            with ThreadPoolExecutor(threads, thread_name_prefix="load") as pool:
                for _ in pool.map(read, fast):
                    pass
        else:
            for piece in fast:
                read(piece)
    finally:
        for fd in fds.values():
            os.close(fd)
    for name, file, target in slow:
        target.copy_(read_tensor(file, name).reshape(-1))


DIRECT_READS = {("F32", torch.float32), ("BF16", torch.bfloat16), ("F16", torch.float16), ("BF16", torch.float32)}


def read_piece(fd: int, dtype: str, offset: int, target: torch.Tensor) -> None:
    """Elements of a stored `dtype` at byte `offset` into `target` (DIRECT_READS: the same dtype, or
    bf16 widened to fp32, whose bits are the bf16's followed by sixteen zeros)."""
    if ITEM_BYTES[dtype] == target.element_size():
        read_exact(fd, target.view(torch.uint8).numpy(), offset)
        return
    raw = np.empty(target.numel(), dtype=np.uint16)
    read_exact(fd, raw.view(np.uint8), offset)
    np.left_shift(raw, 16, out=target.view(torch.int32).numpy().view(np.uint32), dtype=np.uint32)


def read_exact(fd: int, out: np.ndarray, offset: int) -> None:
    view = memoryview(out).cast("B")
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n == 0:
            raise CheckpointMismatch(f"file ended {len(view) - got} bytes short of a tensor (truncated?)")
        got += n


def tensor_offsets(file: Path) -> dict[str, tuple[str, int, int]]:
    """name -> (dtype, first byte, end byte) in the file, from its header (the format's: an 8-byte
    little-endian length, then that much JSON whose offsets count from the header's end)."""
    with open(file, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    start = 8 + length
    return {name: (entry["dtype"], start + entry["data_offsets"][0], start + entry["data_offsets"][1])
            for name, entry in header.items() if name != "__metadata__"}


def check_hf_dir(model_dir: Path, arch: ModelArch) -> list[tuple[str, Path, int, ParamSlot]]:
    """The directory's config, every tensor's name and shape, and a stored tied head, checked
    against the model; returns what to copy where (plan_reads)."""
    check_config(model_dir, arch)
    reads, tied_head_file = plan_reads(weight_files(model_dir), arch)
    if tied_head_file is not None:
        embed_file = next(file for name, file, _, _ in reads if name == family(arch).embed_name)
        check_tied_head(arch, tied_head_file, embed_file)
    return reads


def checked_buffer(buf: torch.Tensor, layer: int, arch: ModelArch) -> torch.Tensor:
    numel = model_layouts(arch)[layer].numel
    if buf.dim() != 1 or buf.numel() != numel:
        raise ValueError(f"layer {layer} buffer has shape {tuple(buf.shape)}, expected ({numel},)")
    return buf


# ---------------------------------------------------------------------------------------------- export


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """The safetensors format written tensor by tensor from the given memory: no second copy of a
    shard, and views that share one flat buffer are fine (safetensors' own writer refuses them)."""
    specs = [(name, tuple(t.shape), STORED_DTYPES[t.dtype]) for name, t in tensors.items()]
    write_tensors(path, specs, iter(tensors.values()))


def write_tensors(path: Path, specs: list[tuple[str, tuple[int, ...], str]], tensors: Iterable[torch.Tensor]) -> None:
    """A safetensors file of (name, shape, safetensors dtype) in order, each tensor's bytes taken from
    `tensors` as it comes (one at a time, when it is a generator)."""
    header: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, dtype in specs:
        nbytes = ITEM_BYTES[dtype] * math.prod(shape)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for tensor in tensors:
            f.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data)
        f.flush()
        os.fsync(f.fileno())


class ShardWriter:
    """Collects tensors until the next one would overflow a shard, then writes the shard."""

    def __init__(self, directory: Path, max_shard_bytes: int):
        self.directory, self.max_shard_bytes = directory, max_shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + nbytes > self.max_shard_bytes:
            self.flush()
        self.pending[name] = tensor
        self.pending_bytes += nbytes
        self.total_bytes += nbytes

    def flush(self) -> None:
        if not self.pending:
            return
        path = self.directory / f"shard-{len(self.shards):05d}.tmp"
        write_safetensors(path, self.pending)
        self.shards.append((path, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0


def layer_tensors_in(dtype: torch.dtype, arch: ModelArch, layer: int, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """HF name -> tensor of one layer in the export dtype (views when no conversion is needed)."""
    layouts = model_layouts(arch)
    if not 0 <= layer < len(layouts):
        raise ValueError(f"layer index {layer} out of range 0..{len(layouts) - 1}")
    layout = layouts[layer]
    flat = flat.detach().reshape(-1).cpu()
    if flat.numel() != layout.numel:
        raise ValueError(f"layer {layer} has {flat.numel()} values, expected {layout.numel}")
    return {name: t.to(dtype) for name, t in layout.stored_views(flat).items()}


def name_shards(writer: ShardWriter) -> dict[str, str]:
    """Give the shards their final transformers names; returns the weight map."""
    count = len(writer.shards)
    weight_map = {}
    for i, (path, names) in enumerate(writer.shards):
        final = SINGLE_FILE if count == 1 else f"model-{i + 1:05d}-of-{count:05d}.safetensors"
        path.rename(path.parent / final)
        weight_map.update({name: final for name in names})
    return weight_map


def check_replaceable(out_dir: Path) -> None:
    """Only an empty directory or an earlier export (it has a config.json) may be replaced."""
    if out_dir.exists() and (not out_dir.is_dir() or (any(out_dir.iterdir()) and not (out_dir / "config.json").exists())):
        raise FileExistsError(f"{out_dir} exists and is not an earlier model export; refusing to replace it")


def export_hf(
    out_dir: str | Path,
    arch: ModelArch,
    layer_tensors: Iterable[tuple[int, torch.Tensor]],
    dtype: torch.dtype = torch.float32,
    max_shard_bytes: int = 2 * 1024**3,
    carried: Iterable[tuple[str, Path]] = (),
) -> Path:
    """Write a directory that transformers' from_pretrained loads: config.json and safetensors shards.

    `layer_tensors` yields (layer index, flat fp32 buffer) once per layer, in any order; host memory
    stays bounded by one shard plus one layer. Nothing appears at `out_dir` unless all succeeded.
    `carried`: (name, file) of tensors that join the shards unchanged (files/carried.py).
    """
    if dtype not in SAFETENSORS_DTYPES:
        raise ValueError(f"export dtype {dtype} is not supported; use one of {list(CONFIG_DTYPES.values())}")
    out_dir = Path(out_dir)
    check_replaceable(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = out_dir.parent / f".{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        writer = ShardWriter(staging, max_shard_bytes)
        seen: set[int] = set()
        for layer, flat in layer_tensors:
            if layer in seen:
                raise ValueError(f"layer {layer} given twice")
            seen.add(layer)
            for name, tensor in layer_tensors_in(dtype, arch, layer, flat).items():
                writer.add(name, tensor)
        missing = sorted(set(range(len(model_layouts(arch)))) - seen)
        if missing:
            raise ValueError(f"layers {missing} were never given")
        for name, file in carried:
            writer.add(name, read_tensor(file, name))
        writer.flush()
        weight_map = name_shards(writer)
        if len(writer.shards) > 1:
            index = {"metadata": {"total_size": writer.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
            write_json(staging / INDEX_FILE, index)
        write_json(staging / "config.json", arch_to_hf_config(arch, torch_dtype=CONFIG_DTYPES[dtype]))
        publish_dir(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model", "vocab.json", "merges.txt", "generation_config.json",
                   # an image-text model's processor
                   "preprocessor_config.json", "processor_config.json", "chat_template.json")


def copy_tokenizer_files(tokenizer: str | None, out_dir: Path) -> list[str]:
    """The tokenizer's files (chat template, an image-text model's processor) beside exported weights, so that the directory
    loads as any model; `tokenizer` is data.tokenizer (a tokenizer.json or its directory)."""
    if not tokenizer:
        return []
    source = Path(tokenizer).expanduser()
    source = source if source.is_dir() else source.parent
    copied = []
    for name in TOKENIZER_FILES:
        if (source / name).is_file() and not (out_dir / name).exists():
            shutil.copyfile(source / name, out_dir / name)
            copied.append(name)
    return copied


PROBE_TEXT = "The quick brown fox jumps over the lazy dog.\nIt said: \"Hello, world!\" 12345 times."


def auto_tokenizer_mismatch(out_dir: Path, tokenizer: str | None) -> str | None:
    """None where transformers' AutoTokenizer reads `out_dir` as the run read `tokenizer` (its
    tokenizer.json through the `tokenizers` library): the same ids for a probe of plain text and of
    the tokenizer's own vocabulary; else a line saying how it differs and how to load it right.
    transformers picks the class from config.json's model_type for some types (qwen2 among them)
    whatever tokenizer_config.json names, and that class rebuilds the tokenizer from its vocabulary:
    a tokenizer of another kind (word-level, say) then reads as something else."""
    from tokenizers import Tokenizer

    from megatrain_ray.data.tokenization import tokenizer_file

    if not tokenizer or not (out_dir / "tokenizer.json").is_file():
        return None
    run = Tokenizer.from_file(str(tokenizer_file(tokenizer)))
    own_words = run.decode(list(range(min(run.get_vocab_size(), 512))), skip_special_tokens=True)
    try:
        from transformers import AutoTokenizer

        auto = AutoTokenizer.from_pretrained(out_dir)
    except Exception as e:  # any reason it does not load is worth the same line
        return f"transformers' AutoTokenizer cannot load {out_dir}: {type(e).__name__}: {e}"
    for text in (PROBE_TEXT, own_words):
        want = run.encode(text, add_special_tokens=False).ids
        got = auto(text, add_special_tokens=False)["input_ids"]
        if got != want:
            return (f"transformers' AutoTokenizer loads {out_dir} as {type(auto).__name__}, which reads "
                    f"{text[:40]!r}... as {got[:8]}... where the run's tokenizer read {want[:8]}...; load it with "
                    f"PreTrainedTokenizerFast.from_pretrained({str(out_dir)!r}) (a tokenizer_config.json naming the "
                    f"tokenizer's real class fixes it only where transformers honours it for this model type)")
    return None


def export_tokenizer(tokenizer: str | None, out_dir: Path) -> tuple[list[str], str | None]:
    """The tokenizer's files copied beside an export (copy_tokenizer_files), and a warning where
    transformers' AutoTokenizer would read them otherwise than the run did (auto_tokenizer_mismatch)."""
    copied = copy_tokenizer_files(tokenizer, out_dir)
    return copied, (auto_tokenizer_mismatch(out_dir, tokenizer) if copied else None)
