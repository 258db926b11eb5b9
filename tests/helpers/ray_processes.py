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
    """Our processes whose command line names `directory`, or that hold a file open under it (their
    logs): Ray's daemons and agents of a cluster started with that temp dir. Some name it nowhere
    on their command line (the dashboard agent retitles itself `ray::DashboardAgent`, the client
    server is given addresses only): left running, the agent spins on a core until it gives up on
    the ended cluster, over a minute later."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if entry.stat().st_uid == os.getuid() and (str(directory).encode() in (entry / "cmdline").read_bytes()
                                                       or holds_a_file_under(entry, directory)):
                found.append(int(entry.name))
        except OSError:
            pass
    return found


def holds_a_file_under(process: Path, directory: Path) -> bool:
    prefix = f"{directory}{os.sep}"
    for fd in (process / "fd").iterdir():
        try:
            if os.readlink(fd).startswith(prefix):
                return True
        except OSError:  # closed meanwhile
            pass
    return False


def end_processes_under(directory: Path, grace: float = 3.0) -> None:
    """SIGTERM, then SIGKILL what is left after `grace` seconds; returns once all are gone (at most
    15 s after the SIGKILL). The grace is short on purpose: Ray's GCS and monitor do not exit on a
    SIGTERM that reaches them with the rest of the cluster (measured: still there after 15 s), and
    a test's cluster holds nothing to save."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 15.0)):
        for pid in pids_under(directory):
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + wait
        while pids_under(directory) and time.monotonic() < deadline:
            time.sleep(0.1)


def listening_addresses(pids: list[int]) -> dict[str, list[int]]:
    """The TCP addresses (`host:port` as `ss` prints them: `127.0.0.1:6379`, `[::ffff:127.0.0.1]:6379`,
    `*:6379`, `0.0.0.0:6379`) that the processes `pids` listen on, each with its listeners' pids."""
    import re
    import subprocess

    table = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    found: dict[str, list[int]] = {}
    for line in table.splitlines():
        fields = line.split()
        owners = [int(pid) for pid in re.findall(r"pid=(\d+),", line) if int(pid) in pids]
        if len(fields) >= 4 and owners:
            found.setdefault(fields[3], []).extend(owners)
    return found


def on_loopback(address: str) -> bool:
    """`ss`'s local address (see listening_addresses) is on the loopback only."""
    import ipaddress

    host = address.rsplit(":", 1)[0].strip("[]")
    if host in ("*", ""):
        return False
    ip = ipaddress.ip_address(host.split("%")[0])
    return (getattr(ip, "ipv4_mapped", None) or ip).is_loopback
