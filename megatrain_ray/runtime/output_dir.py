"""An output directory holds one run: a new run never writes into another run's files unasked.

A directory "holds a run" when it has a metrics.jsonl with rows or a complete checkpoint under the
run's checkpoint directory. A new run there is refused (OutputDirError, exit 2) unless it is a
resume (`--resume`: the run goes on, its files are kept) or `--overwrite` (the old run's files,
and only those, are deleted first). Checked on the driver before Ray starts, together with
whether the directories can be written at all (FileSystemError) and have room for one checkpoint
(a warning), so a mistake costs seconds.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from megatrain_ray.config import Config
from megatrain_ray.files import checkpoint as ckpt
from megatrain_ray.host.disk import DiskTierError
from megatrain_ray.models.arch import ModelArch
from megatrain_ray.runtime.run_log import LOG_NAME

METRICS = "metrics.jsonl"
TRACKER_DIRS = ("tensorboard",)  # runtime/trackers.py writes these under the output dir


class OutputDirError(ValueError):
    """A directory that already holds a run; the message names --resume and --overwrite."""


class FileSystemError(Exception):
    """A directory or file the run cannot write: one paragraph with the path and the real cause."""


def describe_os_error(e: OSError, doing: str = "") -> str:
    """`[Errno 28] No space left on device: 'x'` as one sentence that names the path and the cause,
    and what usually fixes it. The disk tier's error (host/disk.py) already says which file and what
    to change: its own words."""
    if isinstance(e, DiskTierError):
        return f"{doing + ': ' if doing else ''}{e.strerror or e}"
    path = e.filename or "?"
    name = errno.errorcode.get(e.errno or 0, "")
    cause = e.strerror or str(e)
    fix = {
        errno.ENOSPC: "free space there, lower checkpoint.keep, or choose another train.output_dir / checkpoint.dir",
        errno.EDQUOT: "free space within your quota, or choose another train.output_dir / checkpoint.dir",
        errno.EACCES: "choose a directory you may write (train.output_dir, checkpoint.dir) or change its permissions",
        errno.EPERM: "choose a directory you may write (train.output_dir, checkpoint.dir) or change its permissions",
        errno.EROFS: "the file system is read-only: choose another train.output_dir / checkpoint.dir",
        errno.ENOTDIR: "a file stands where a directory is needed: choose another path",
        errno.EEXIST: "a file stands where a directory is needed: choose another path",
    }.get(e.errno or 0, "check the path and the file system")
    where = "" if doing and path in doing else f" at {path}"
    return f"{doing + ': ' if doing else ''}{cause} ({name}){where}; {fix}"


def holds_run(out: Path, checkpoints: Path) -> list[str]:
    """What of an earlier run is there (empty: nothing)."""
    found = []
    metrics = out / METRICS
    if metrics.is_file() and metrics.stat().st_size:
        found.append(f"{metrics}")
    done = ckpt.list_checkpoints(checkpoints)
    if done:
        found.append(f"{len(done)} checkpoint(s) under {checkpoints} (the last {done[-1].name})")
    return found


def claim(config: Config, resume: str | None, overwrite: bool, arch: ModelArch) -> Path:
    """The run's output directory, made and checked; refuses one that holds another run (see the
    module docstring); `arch`: the model, for the room one checkpoint needs. Returns it."""
    out = Path(config.train.output_dir)
    root = ckpt.checkpoint_root(config)
    if resume and overwrite:
        raise OutputDirError("--resume continues the run in the output directory and --overwrite deletes it: "
                             "pass one of them")
    found = holds_run(out, root) if not resume else []
    if found and not overwrite:
        raise OutputDirError(
            f"train.output_dir {out} already holds a run ({'; '.join(found)}). Pass --resume to continue it "
            f"from its latest checkpoint, --overwrite to delete it and start again, or choose another "
            f"directory (--set train.output_dir=...)"
        )
    for directory in (out, root):
        check_writable(directory)
    if found:
        clear(out, root)
        print(f"--overwrite: deleted the earlier run in {out} ({'; '.join(found)})", flush=True)
    check_room(root, config, arch)
    return out


def check_writable(directory: Path) -> None:
    """Make the directory and write a file in it, so that a mistake shows before Ray starts."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".write-check-"):
            pass
    except OSError as e:
        if not e.filename:
            e.filename = str(directory)
        raise FileSystemError(describe_os_error(e, f"cannot write in {directory}")) from None


def check_room(root: Path, config: Config, arch: ModelArch) -> None:
    """Warn, before Ray starts, of a checkpoint directory without room for one checkpoint
    (files/checkpoint.py, checkpoint_bytes): the first checkpoint would fail (a file-system error,
    exit 2) and cost the steps before it. A warning, not a refusal: space may be freed while the run
    starts, and a model that cannot fit in host memory either is better told so."""
    free, need = shutil.disk_usage(root).free, ckpt.checkpoint_bytes(config, arch)
    if free < need:
        print(f"warning: {root} has {free / 1e9:.2f} GB free but one checkpoint of this model needs "
              f"{need / 1e9:.2f} GB (its master weights and two AdamW moments as optim.master={config.optim.master} "
              f"and optim.moments={config.optim.moments} hold them): the first checkpoint will fail unless space is "
              f"freed there; or choose another checkpoint.dir / train.output_dir", file=sys.stderr, flush=True)


def clear(out: Path, root: Path) -> None:
    """Delete what a run writes (metrics.jsonl, its log, its checkpoints, its TensorBoard events); other
    files stay."""
    (out / METRICS).unlink(missing_ok=True)
    (out / LOG_NAME).unlink(missing_ok=True)
    for checkpoint in ckpt.list_checkpoints(root):
        shutil.rmtree(checkpoint)
    for stale in root.glob(".step-*.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    for name in TRACKER_DIRS:
        shutil.rmtree(out / name, ignore_errors=True)


def step_of(line: str) -> float:
    """A metrics row's step; a row torn by a crash mid-write counts as after every step (dropped)."""
    try:
        return json.loads(line).get("step", 0)
    except ValueError:
        return float("inf")


def trim_metrics(path: Path, last_step: int) -> None:
    """A resumed run rewrites the steps after its checkpoint: their earlier rows (a run stopped
    between checkpoints) are dropped, so each step has one row; so is a row torn by a crash.
    Rewritten atomically."""
    if not path.is_file():
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if line.endswith("\n") and step_of(line) <= last_step]
    if len(kept) == len(lines):
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)
