"""Ray clusters the tests start with `ray start` in a temp dir of their own, ended by pid (never
`ray stop`, which would end every Ray on the machine)."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pids_under(directory: Path) -> list[int]:
    """Our processes whose command line names `directory`: Ray's daemons and agents of a cluster
    started with that temp dir."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if entry.stat().st_uid == os.getuid() and str(directory).encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            pass
    return found


def end_processes_under(directory: Path) -> None:
    """SIGTERM, then SIGKILL what is left after 15 s."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids_under(directory):
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + 15
        while pids_under(directory) and time.monotonic() < deadline:
            time.sleep(0.5)
