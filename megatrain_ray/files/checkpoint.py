"""Checkpoints that are never half-valid: shards and metadata into a temporary directory,
fsynced, renamed into place, and a manifest (with each file's hash) written last.

Each store writes its own layers (master weights and AdamW moments, in the dtypes the run holds them:
fp32, or bf16 and int8 with block scales in the lean modes) as safetensors; a store with a disk tier
on the checkpoint's file system hard-links the tier's files beside its shard instead of copying the
state in them (files/shard.py, host/disk.py: the tier never writes a linked file in place again), and
its shard's metadata says which tensors lie where in them (`LINKED`); a store on a
RAM node writes straight to the checkpoint path when that path is shared storage
(`checkpoint.transport: shared`), or sends its tensors to the driver, which writes them
(`checkpoint.transport: driver`). Loading picks each layer from whichever shard holds it, so a
run may resume on a different split of layers across nodes.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import os
import random
import re
import shutil
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megatrain_ray.config import Config
from megatrain_ray.host.disk import DiskTierError
from megatrain_ray.host.muon import second_moment_numel
from megatrain_ray.host.precision import SCALE_KEYS, StateFormat, format_of
from megatrain_ray.files.durable import fsync_path, publish_dir, write_json
from megatrain_ray.models.arch import ModelArch
from megatrain_ray.models.registry import model_layouts

MANIFEST = "MANIFEST.json"
META = "meta.json"
FORMAT_VERSION = 1
LINKED_FORMAT = 2  # a checkpoint with files linked beside its shards: an older reader must refuse it
LINKED = "linked"  # a shard's metadata: {layer: [{"file": name, "parts": [[key, dtype, numel, offset], ...]}]}
STATE_KEYS = ("master", "exp_avg", "exp_avg_sq")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message says which and why."""


def tensor_name(layer: int, key: str) -> str:
    return f"layers.{layer}.{key}"


HASH_THREADS = 8  # files hashed at once (the disk tier's files linked into a checkpoint)


def file_digest(path: Path, uncached: bool = False) -> str:
    """The file's sha256; `uncached`: its pages leave the page cache after (the disk tier's files linked
    into a checkpoint, which would otherwise take the RAM the tier spares)."""
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
        if uncached:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        return digest


def write_shard(directory: Path, name: str, tensors: dict[str, torch.Tensor], steps: dict[int, int]) -> dict:
    """One store's layers into `directory/name`, fsynced; returns its manifest entry."""
    path = directory / name
    try:
        save_file(tensors, str(path), metadata={"layer_steps": json.dumps(steps)})
    except Exception as e:  # safetensors reports the OS's I/O errors (a full disk) as its own exception
        raise os_error(e, path) from None
    fsync_path(path)
    return {"file": name, "sha256": file_digest(path), "bytes": path.stat().st_size, "layers": sorted(steps)}


SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int8: "I8",
                      torch.uint8: "U8", torch.int64: "I64"}


def write_shard_streamed(directory: Path, name: str, entries: list[tuple[str, torch.dtype, int]],
                         parts: Iterable[Callable[[], dict[str, torch.Tensor]]], steps: dict[int, int],
                         linked: dict[int, list[dict]] | None = None) -> dict:
    """write_shard for a store whose state is not all in memory at once (a disk tier, host/disk.py):
    the safetensors header from `entries` (each tensor's name, dtype and length, in file order), then
    the tensors `parts` give, one group (a layer) at a time, in that order; fsynced. The same format
    safetensors writes and reads (an 8-byte header length, the JSON header padded to 8 bytes, the data).
    `linked`: the files linked beside it that hold the rest of its layers' state (`LINKED`), hashed
    into the entry."""
    path = directory / name
    header, offset = {"__metadata__": {"layer_steps": json.dumps(steps)}}, 0
    if linked:
        header["__metadata__"][LINKED] = json.dumps(linked)
    for key, dtype, numel in entries:
        end = offset + numel * dtype.itemsize
        header[key] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": [numel], "data_offsets": [offset, end]}
        offset = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    order = [key for key, _, _ in entries]
    try:
        with open(path, "wb") as f:
            f.write(len(text).to_bytes(8, "little") + text)
            written = 0
            for get in parts:
                for key, t in get().items():
                    if key != order[written]:
                        raise ValueError(f"the shard's tensors came out of order: {key} where {order[written]} belongs")
                    f.write(t.contiguous().view(torch.uint8).numpy().data)
                    written += 1
            if written != len(order):
                raise ValueError(f"the shard got {written} of its {len(order)} tensors")
    except DiskTierError:  # a layer's state that could not be read from the disk tier: it names its own file
        raise
    except OSError as e:  # a full disk: the error names the file
        raise OSError(e.errno, e.strerror, str(path)) from None
    fsync_path(path)
    entry = {"file": name, "sha256": file_digest(path), "bytes": path.stat().st_size, "layers": sorted(steps)}
    if linked:
        paths = [directory / f["file"] for files in linked.values() for f in files]
        with ThreadPoolExecutor(HASH_THREADS) as pool:  # hashlib lets go of the GIL: the disk's speed, not a core's
            digests = list(pool.map(lambda path: file_digest(path, uncached=True), paths))
        entry[LINKED] = [{"file": path.name, "sha256": digest, "bytes": path.stat().st_size}
                         for path, digest in zip(paths, digests)]
    return entry


def shard_files(shards: list[dict]) -> list[dict]:
    """The manifest's entries of every file: each shard's and those of the files linked beside it."""
    return [f for shard in shards for f in (shard, *shard.get(LINKED, ()))]


def os_error(e: Exception, path: Path) -> Exception:
    """safetensors' "I/O error: ... (os error N)" as the OSError it stands for, naming the file, so
    that it reads as one paragraph with its cause (a full disk: exit 2); any other error as it is."""
    found = re.search(r"I/O error: .*\(os error (\d+)\)", str(e))
    if found is None:
        return e
    code = int(found.group(1))
    return OSError(code, os.strerror(code), str(path))


def new_staging_dir(root: Path, step: int) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".step-{step:08d}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    return tmp


def commit(staging: Path, root: Path, step: int, shards: list[dict], meta: dict, keep: int) -> Path:
    """Metadata, then the manifest, then the rename: only a complete checkpoint gets a final name."""
    write_json(staging / META, meta)
    manifest = {"format": LINKED_FORMAT if any(LINKED in s for s in shards) else FORMAT_VERSION, "step": step,
                "shards": shards, "meta_sha256": file_digest(staging / META), "written_at": time.time()}
    write_json(staging / MANIFEST, manifest)
    fsync_path(staging)
    final = root / f"step-{step:08d}"
    publish_dir(staging, final)  # the same step again: the old one stays whole until the new one has its name
    prune(root, keep)
    return final


def capture_rng_state() -> dict:
    """The driver's Python, NumPy and torch generators, as JSON: nothing draws from them today, but a
    resumed run that someday does must continue the same streams."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": [version, list(internal), gauss],
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
    }


def restore_rng_state(state: dict | None) -> None:
    if not state:
        return
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["torch"])), dtype=torch.uint8))


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints (a manifest present), oldest first."""
    if not root.exists():
        return []
    return sorted(p for p in root.glob("step-*") if (p / MANIFEST).exists())


def prune(root: Path, keep: int) -> None:
    for old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(".step-*.tmp-*"):
        if time.time() - stale.stat().st_mtime > 3600:
            shutil.rmtree(stale, ignore_errors=True)


def resolve(path_or_latest: str, root: Path) -> Path:
    if path_or_latest == "latest":
        found = list_checkpoints(root)
        if not found:
            raise CheckpointError(f"--resume latest: no complete checkpoint under {root}")
        return found[-1]
    path = Path(path_or_latest)
    if not path.is_dir():
        raise CheckpointError(f"--resume {path}: no such checkpoint directory")
    if not (path / MANIFEST).exists():
        raise CheckpointError(f"{path} is not a complete checkpoint (no {MANIFEST}); it may be half-written")
    return path


def check_is_checkpoint(path: Path, command: Callable[[Path], str]) -> None:
    """A directory that is no checkpoint is refused with the checkpoints it (or its checkpoints/) holds:
    a run's directory given for one of its checkpoints names them, and `command` of the latest."""
    if (path / MANIFEST).exists():
        return
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    found = list_checkpoints(path / "checkpoints") or list_checkpoints(path)
    if not found:
        raise CheckpointError(f"{path} is not a checkpoint (no {MANIFEST}; a checkpoint is a run's "
                              f"checkpoints/step-NNNNNNNN directory) and holds none")
    raise CheckpointError(f"{path} is not a checkpoint but holds {len(found)}: "
                          f"{', '.join(p.name for p in found)} in {found[0].parent}; pass one, e.g. "
                          f"`{command(found[-1])}`")


def read_manifest(path: Path, verify: bool = True) -> tuple[dict, dict]:
    """(manifest, meta), after checking every file's hash against the manifest."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {path}: unreadable manifest ({e})") from None
    if manifest.get("format") not in (FORMAT_VERSION, LINKED_FORMAT):
        raise CheckpointError(f"checkpoint {path} has format {manifest.get('format')!r}; this version reads "
                              f"{FORMAT_VERSION} and {LINKED_FORMAT}")
    if verify:
        expected = [(s["file"], s["sha256"]) for s in shard_files(manifest["shards"])] + [(META, manifest["meta_sha256"])]
        for name, digest in expected:
            file = path / name
            if not file.exists():
                raise CheckpointError(f"checkpoint {path}: {name} is missing")
            if file_digest(file) != digest:
                raise CheckpointError(f"checkpoint {path}: {name} is corrupt (its hash does not match the manifest)")
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {path}: unreadable {META} ({e})") from None
    return manifest, meta


def shard_files_by_layer(path: Path, manifest: dict) -> dict[int, str]:
    return {layer: str(path / s["file"]) for s in manifest["shards"] for layer in s["layers"]}


def shard_update_counts(directory: Path, shards: list[dict]) -> dict[int, int]:
    """Each layer's update count, as the shards written into `directory` hold it."""
    counts = {}
    for shard in shards:
        with safe_open(str(directory / shard["file"]), framework="pt") as f:
            counts.update({int(layer): int(n) for layer, n in json.loads(f.metadata()["layer_steps"]).items()})
    return counts


def read_layer_state(file: str, layer: int) -> tuple[dict[str, torch.Tensor], int]:
    """A layer's master, moments and (int8 moments) their scales, as saved (in its shard, or in the
    files linked beside it: `LINKED`); and its update count."""
    with safe_open(file, framework="pt") as f:
        metadata = f.metadata()
        present = set(f.keys())
        state = {key: f.get_tensor(tensor_name(layer, key)) for key in (*STATE_KEYS, *SCALE_KEYS)
                 if tensor_name(layer, key) in present}
    for linked in json.loads(metadata.get(LINKED, "{}")).get(str(layer), ()):
        state.update(read_parts(Path(file).parent / linked["file"], linked["parts"]))
    missing = [key for key in STATE_KEYS if key not in state]
    if missing:
        raise CheckpointError(f"checkpoint shard {file} holds no {', '.join(missing)} of layer {layer}")
    return state, int(json.loads(metadata["layer_steps"])[str(layer)])


DTYPES_BY_NAME = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}


def read_parts(path: Path, parts: list[list]) -> dict[str, torch.Tensor]:
    """Tensors of a file linked beside a shard (a disk tier's: host/disk.py's parts), each [key, dtype
    name, numel, byte offset]."""
    out = {}
    with open(path, "rb") as f:
        for key, name, numel, offset in parts:
            dtype = DTYPES_BY_NAME[name]
            f.seek(offset)
            data = f.read(numel * dtype.itemsize)
            if len(data) != numel * dtype.itemsize:
                raise CheckpointError(f"{path} ends before layer state {key} does (at byte {offset + len(data)})")
            out[key] = torch.frombuffer(bytearray(data), dtype=dtype) if numel else torch.empty(0, dtype=dtype)
    return out


def saved_format(meta: dict) -> StateFormat:
    """The optimizer state format a checkpoint's run held (checkpoints from before the lean modes: fp32)."""
    return format_of_dict((meta.get("config") or {}).get("optim") or {})


def format_of_dict(optim: dict) -> StateFormat:
    return StateFormat(optim.get("master", "fp32"), optim.get("moments", "fp32"), optim.get("name", "adamw"))


def check_convertible(held: StateFormat, wanted: StateFormat, what: str) -> None:
    """State may be narrowed on resume (fp32 to bf16 or int8), never widened: the precision a lean run
    dropped is gone, and an fp32 run from it would not be the exact run it claims to be."""
    if wanted.narrower_or_same(held):
        return
    raise CheckpointError(
        f"{what} holds its optimizer state as optim.master={held.master}, optim.moments={held.moments}, but this "
        f"run asks for master={wanted.master}, moments={wanted.moments}: a resume can narrow the state, not widen "
        f"it (what the lean run rounded away is gone). Resume with optim.master={held.master} "
        f"optim.moments={held.moments}, or start a new run from its weights (megatrain-ray export, then model.path)"
    )


def check_state_format(meta: dict, config: Config, path: Path) -> None:
    """Refuse, before anything is allocated, a resume that would widen the saved optimizer state or
    change the optimizer (AdamW's moments are not Muon's momentum)."""
    held, wanted = saved_format(meta), format_of_dict(dataclasses.asdict(config.optim))
    if held.optimizer != wanted.optimizer:
        raise CheckpointError(
            f"checkpoint {path} holds the optimizer state of optim.name={held.optimizer}, but this run asks for "
            f"optim.name={wanted.optimizer}: their states differ (Muon keeps one momentum for the blocks' matrices, "
            f"AdamW two moments). Resume with optim.name={held.optimizer}, or start a new run from its weights "
            "(megatrain-ray export, then model.path)")
    check_convertible(held, wanted, f"checkpoint {path}")


# ---------------------------------------------------------------------------------------------
# What a run records beside the tensors, and what it checks before using a checkpoint
# ---------------------------------------------------------------------------------------------


def checkpoint_bytes(config: Config, arch: ModelArch) -> int:
    """The bytes of one checkpoint's tensors: every layer's master and moments in the dtypes the run
    holds them (optim.master, optim.moments: StateFormat.held_bytes). Its files' headers, manifest
    and meta.json add kilobytes; the final checkpoint's Hugging Face export (hf/) is not counted."""
    fmt = format_of(config.optim)
    return sum(fmt.held_bytes(layout.numel, layout.trained_numel, second_moment_numel(layout, fmt.optimizer))
               for layout in model_layouts(arch, config.model.train_vision))


def checkpoint_root(config: Config) -> Path:
    return Path(config.checkpoint.dir or Path(config.train.output_dir) / "checkpoints")


def checkpoint_meta(config: Config, arch: ModelArch, step: int, updates_done: int, data_position: dict | None,
                    schedule_steps: int | None = None) -> dict:
    """Everything besides the tensors that a resume needs to continue exactly where this left off
    (`schedule_steps`: the LR schedule's length the run followed, as its step plan had it)."""
    return {
        "step": step,
        "schedule_steps": schedule_steps,
        "updates_done": updates_done,
        "data_position": data_position,
        "arch": arch.to_dict(),
        "config": config.to_dict(),
        "rng": capture_rng_state(),
    }


def schedule_on_resume(config: Config, meta: dict, steps: int | None = None) -> tuple[int | None, str | None]:
    """The LR schedule's length a resume from `meta` trains with (None: the one a new run would,
    `steps`, default train.steps), and a line saying which schedule it follows where they differ:
    the checkpoint's run's length (as its step plan had it, else its optim.schedule_steps, else its
    train.steps), unless optim.schedule_steps asks for another. Extending a run then goes on at the
    LR it ended with, instead of a cosine over the new length that jumps back up. The step plan
    carries the length (planning/step_plan.py); the config stays as written."""
    saved = meta.get("config") or {}
    trained = (meta.get("schedule_steps") or (saved.get("optim") or {}).get("schedule_steps")
               or (saved.get("train") or {}).get("steps"))
    asked, first = config.optim.schedule_steps, meta["step"] + 1
    steps = config.train.steps if steps is None else steps
    if trained is None:  # a checkpoint that did not record its config: nothing to keep
        return None, None
    if asked is not None:
        if asked == trained:
            return None, None
        return None, (f"LR schedule: a new horizon of {asked} steps (optim.schedule_steps) from step {first}; the "
                      f"checkpoint's run followed one of {trained} steps")
    if steps == trained:
        return trained, None
    after = (f"train.steps={steps} goes on past its end: from step {trained + 1} the LR stays at its floor, "
             f"optim.lr x optim.min_lr_ratio" if steps > trained else f"train.steps={steps} stops before its end")
    return trained, (f"LR schedule: kept from the checkpoint's run (warmup + cosine over {trained} steps); {after}. "
                     f"For a schedule over the new length: --set optim.schedule_steps={steps}")


def check_compatible(meta: dict, arch: ModelArch, path: Path, manifest: dict | None = None) -> None:
    """Refuse a checkpoint of another model before anything is allocated."""
    fields = arch.model_fields()  # the loss's settings (arch.loss_fields) may change on resume
    here = {k: v for k, v in json.loads(json.dumps(arch.to_dict())).items() if k in fields}
    there = {k: v for k, v in json.loads(json.dumps(meta.get("arch") or {})).items() if k in fields}
    if there != here:
        diff = {k: (there.get(k), v) for k, v in here.items() if there.get(k) != v}
        raise CheckpointError(
            f"checkpoint {path} is from another model: "
            + ", ".join(f"{k} is {a} there but {b} here" for k, (a, b) in diff.items())
            + "; resume with the model settings it was written with, or start without --resume"
        )
    if manifest is not None:
        held = {layer for s in manifest["shards"] for layer in s["layers"]}
        missing = sorted(set(range(len(model_layouts(arch)))) - held)
        if missing:
            raise CheckpointError(f"checkpoint {path} has no state for layers {missing}; it is incomplete")


def check_shards_visible(staging: Path, shards: list[dict]) -> None:
    """With transport=shared a RAM node writes on its own disk: make sure the driver sees the same files."""
    for shard in shard_files(shards):
        file = staging / shard["file"]
        if not file.exists() or file.stat().st_size != shard["bytes"]:
            raise CheckpointError(
                f"{file} was written by a store but the driver does not see it: checkpoint.transport=shared "
                f"needs a checkpoint dir on storage every node shares; set checkpoint.transport=driver otherwise"
            )
