"""Files that are whole or absent: fsync, JSON written durably, a directory published by rename."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: Path, obj: Any) -> None:
    with open(path, "w") as f:
        f.write(json.dumps(obj, indent=2, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


def publish_dir(staging: Path, final: Path) -> None:
    """Rename a finished directory into place. One that already has the name is moved aside
    first and removed only once the new one has it, so a crash leaves one of the two whole."""
    aside = None
    if final.exists():
        aside = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(final, aside)
    os.rename(staging, final)
    fsync_path(final.parent)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
