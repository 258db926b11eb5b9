"""Host memory as the streaming path needs it: dtypes by name, pinned and shared-memory tensors
(and the sweep of those a killed run left), page-locking memory we did not allocate, and what
/proc says about this node's memory."""

from __future__ import annotations

import mmap
import os
import re
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def dtype_of(name: str) -> torch.dtype:
    """A config's dtype name (model.compute_dtype, checkpoint.export_dtype) as a torch dtype."""
    return DTYPES[name]


def element_size(dtype: torch.dtype) -> int:
    return torch.tensor([], dtype=dtype).element_size()


def pinned_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(numel, dtype=dtype, pin_memory=torch.cuda.is_available())


def zeroed(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Zeros that cost nothing until used: private anonymous memory, whose pages the kernel hands out
    zeroed at their first touch (torch.zeros writes every byte at once: 57 GiB of AdamW moments at 7B
    before the first step)."""
    nbytes = numel * element_size(dtype)
    if nbytes == 0:
        return torch.zeros(numel, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype)


def shm_tensor(path: Path, numel: int, dtype: torch.dtype, create: bool) -> torch.Tensor:
    """A tensor backed by a shared-memory file: the store writes it, the GPU actor maps it.

    Created new (never over another file) and readable by its user only: it holds the weights."""
    if create:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, numel * element_size(dtype))
        finally:
            os.close(fd)
    return torch.from_file(str(path), shared=True, size=numel, dtype=dtype)


def cuda_host_register(t: torch.Tensor) -> None:
    """Page-lock memory we did not allocate (an mmap), so DMA runs at pinned speed."""
    nbytes = t.numel() * t.element_size()
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {int(err)}")


def cuda_host_unregister(t: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


# ---------------------------------------------------------------------------------------------
# Shared-memory segments outlive a killed store: each names its owner, the next store sweeps
# ---------------------------------------------------------------------------------------------

# megatrain-{run}-{pid}.{start}.{boot}-layer{i}, and -master, -exp_avg, -exp_avg_sq after it for
# state shared with a GPU worker, -grad for a bf16 master's gradient buffer, -disk and -diskcompute
# for a layer's files of the disk tier (host/disk.py; .new after them while a fresh file replaces
# one a checkpoint links): the owner's pid, its start time (clock ticks after boot, so a
# reused pid is told apart) and this boot's and PID namespace's id (so a directory another machine,
# boot or container sees is never taken for ours). Older names carry the pid alone. A run's id
# (new_run_id) names its driver the same way: {random}.{pid}.{start}.{boot}.
SEGMENT = re.compile(r"^megatrain-(?P<run>.+)-(?P<pid>\d+)(?:\.(?P<start>\d+)\.(?P<boot>[0-9a-f]+))?-layer\d+"
                     r"(?:-(?:master|exp_avg|exp_avg_sq|grad|held|disk|diskcompute)(?:\.new)?)?$")
DRIVER = re.compile(r"^[0-9a-f]{8}\.(?P<pid>\d+)\.(?P<start>\d+)\.(?P<boot>[0-9a-f]+)$")


def boot_id() -> str:
    """This boot's id and this PID namespace's: where a pid names the same process (containers on
    one machine share its boot, each with its own pids)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip().replace("-", "")[:8]
    except OSError:
        boot = "0"
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        namespace = 0
    return f"{boot}{namespace:x}"


def process_state(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks after boot) of a process; None when there is no
    such process. ("?", 0) when /proc cannot say."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    except OSError:
        return "?", 0
    fields = stat.rsplit(")", 1)[1].split()
    return fields[0], int(fields[19])


def process_start(pid: int) -> int | None:
    """Start time of a live process in clock ticks after boot; None when there is no such process."""
    state = process_state(pid)
    return None if state is None else state[1]


def process_age() -> float:
    """Seconds since this process started (its start in /proc against the uptime)."""
    start = process_start(os.getpid())
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    return uptime - (start or 0) / os.sysconf("SC_CLK_TCK")


def segment_name(run_id: str, layer: int, key: str | None = None) -> str:
    """A shared-memory segment of this process's, in the form SEGMENT reads back."""
    return f"megatrain-{run_id}-{owner_tag()}-layer{layer}" + (f"-{key}" if key else "")


def owner_tag(pid: int | None = None) -> str:
    pid = os.getpid() if pid is None else pid
    return f"{pid}.{process_start(pid) or 0}.{boot_id()}"


def new_run_id() -> str:
    """A run's id in its segments' names: random, and the driver's tag (a run whose driver is gone
    is over, even while its stores are still being stopped)."""
    return f"{os.urandom(4).hex()}.{owner_tag()}"


def exited(pid: int, start: int, boot: str | None) -> bool:
    """True only when this process is provably gone on this machine: no such pid, a zombie (it has
    exited and released its memory; only its parent has not yet reaped it), or the pid now
    belongs to another process. Not judged on another boot or machine."""
    if boot is not None and boot != boot_id():
        return False
    state = process_state(pid)
    if state is None or state[0] in "ZX":
        return True
    return start != 0 and state[1] != 0 and state[1] != start  # start 0: not known (an old name, no /proc)


def segment_owner_dead(name: str) -> bool:
    """True only when the store that made this segment has exited, or the driver of its run has:
    a store outlives its killed driver only until Ray stops it, which on a busy machine can take
    longer than the next run's start, so its segments are judged by its driver too."""
    match = SEGMENT.match(name)
    if match is None:
        return False
    if exited(int(match["pid"]), int(match["start"] or 0), match["boot"]):
        return True
    driver = DRIVER.match(match["run"])
    return driver is not None and exited(int(driver["pid"]), int(driver["start"]), driver["boot"])


def remove_dead_segments(directory: Path) -> tuple[int, int]:
    """Unlink this user's segments whose owning store died (SIGKILL, OOM killer) without closing;
    a live run's are left alone. Returns (files, bytes) removed."""
    files = nbytes = 0
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return 0, 0
    for entry in entries:
        if not entry.name.startswith("megatrain-") or not segment_owner_dead(entry.name):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
            if st.st_uid != os.getuid():
                continue
            os.unlink(entry.path)
        except OSError:
            continue
        files, nbytes = files + 1, nbytes + st.st_size
    return files, nbytes


# ---------------------------------------------------------------------------------------------
# What the node has
# ---------------------------------------------------------------------------------------------


def _proc_value(path: str, key: str, scale: int = 1) -> int:
    with open(path) as f:
        for line in f:
            if line.startswith(key):
                return int(line[len(key):].split()[0]) * scale
    raise RuntimeError(f"{key!r} not found in {path}")


def available_memory() -> int:
    return _proc_value("/proc/meminfo", "MemAvailable:", 1024)


def host_headroom() -> int:
    """What this node can still give a process before Ray's memory monitor starts killing
    workers: it acts when used memory passes RAY_memory_usage_threshold (0.95) of the total."""
    threshold = float(os.environ.get("RAY_memory_usage_threshold", "0.95"))
    total = _proc_value("/proc/meminfo", "MemTotal:", 1024)
    return max(0, available_memory() - int((1.0 - threshold) * total))


def resident_bytes() -> int:
    return _proc_value("/proc/self/status", "VmRSS:", 1024)


def major_faults() -> int:
    return _proc_value("/proc/vmstat", "pgmajfault ")
