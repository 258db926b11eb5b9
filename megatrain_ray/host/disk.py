"""The disk tier (runtime.disk_dir): the part of a layer's state that only its update reads lives in
a file, and comes into a bounded window of RAM buffers ahead of the update, in the order updates
come, and goes back behind it.

What goes to disk, per layer the plan names (planning/placement.py, `StorePlan.disk_layers`): the
two AdamW moments (and their int8 block scales), and with an fp32 master the master too: the
optimizer alone reads them. The compute copy, which the GPU streams in the forward and the backward
and the gradient lands in, stays in RAM (so does a bf16 master, which is that copy), except in the
layers of `StorePlan.disk_compute_layers`, where RAM is still short: those are fully on disk.

Fully on disk (`compute_parts`, `HeldWindow`): a second file per layer holds the compute copy (a bf16
master: the master itself) and, with a bf16 master, its gradient buffer; with an fp32 master the
gradient lands over the copy, which the update rewrites from the master. The GPU worker reaches such
a layer as it reaches a RAM node's, through its window of pinned slots (host/window.py, which asks
for each layer ahead of its forward and again ahead of its backward unless it kept it) over the
store's link (host/transport.py), even from a store on its own node: the store's server reads the
file into a buffer of a second window (WINDOW buffers of the largest such file) when the request
comes, and sends the copy from there; the gradient lands in a buffer holding the layer and goes to
the file (a step's updates all come after its last gradient: the gradients' norm decides them, so
RAM could not hold them in a bounded window); the update reads the file and writes the new copy. So
RAM holds nothing of the layer but these buffers; a step reads its copy alone (SEND_PARTS) for the
forward's send and the backward's, and its whole file for the gradient's landing and the update (a
buffer tells which parts it holds: a later holder reads only those it lacks, and every read is spared
where a buffer still holds what it wants: the next forward's send, asked for before the update
ends, reads nothing; a landing never reads the part its gradient overwrites whole, so after the
backward's send it reads nothing either), and writes the file twice (after the gradient and after the
update): `StorePlan.disk_step_bytes` counts it so where the disk binds the step: the copy read once
and the file written once beside the update's. The server serves a
version only once its update is applied.

One file per layer, named as the store's shared-memory segments are (host/memory.py, key "disk"),
so that the next store on the machine removes a killed run's files as it removes its segments. Its
parts lie at offsets aligned to ALIGN bytes, so that they are read and written with O_DIRECT (no
page cache: the tier's bytes would otherwise be held twice, and the kernel's writeback would decide
when the disk is busy) from page-aligned buffers, in pieces of IO_PIECE on a pool of threads
(os.preadv/os.pwritev release the GIL: the pool keeps several requests in flight, which an NVMe
disk needs to reach its speed). A file system that refuses O_DIRECT (tmpfs) is used buffered.
Each file is allocated in full when the store starts (posix_fallocate): a disk too small for the
tier is refused then, with the figure, and a write into allocated blocks does not run out of room
mid-run on a file system that overwrites in place (ext4, xfs).

The files are the run's scratch, and a checkpoint on the same file system reuses them (`link`): once
the layer's writes are done and on disk (fsync), its file is hard-linked into the checkpoint, and from
then on the tier never writes that file in place: a file with a second link (`st_nlink`) gets a fresh
file under the tier's name before its next write (`_unshare`: created, allocated, renamed over the old
name), and the checkpoint's link keeps the old bytes. So a run killed at any point, during the
checkpoint or during the steps after it, leaves the checkpoint's bytes as they were when it was
written; a checkpoint elsewhere (another file system) copies the state out (files/shard.py). A write
that fails (the disk's error) keeps its buffer, which then holds the only copy of that layer's state:
the store keeps it resident, a checkpoint still reads it there (and the other layers into a spare
buffer if every buffer holds such a write), and `link` refuses that layer. A write that fails after a
read was queued behind it into its buffer leaves its layer `lost`: even a checkpoint refuses it.

The window: WINDOW (3) buffers each the size of the store's largest layer on disk. `acquire` waits for
the layer's read (issued ahead when a buffer was free), then issues the reads of the layers that
follow it in the store's order, into buffers whose layers were released; `release` issues the
write. A read into a buffer waits for that buffer's write first (the pool takes jobs in order, so
the write's pieces have all started by then). Every call comes from the store's one thread.

A layer whose file was never written (a new run's, before its first update or its first weights)
is not read: its buffer is cleared, which is what the read would bring (posix_fallocate's blocks
read as zeros). So a step moves each layer on disk once each way, the bytes `megatrain-ray plan`
counts (planning/placement.py, `StorePlan.disk_bytes`): its update reads it (ahead, into the window)
and writes it behind; the counters (`bytes_read`, `bytes_written`, and `mark_step` at each step's
first update, where the next step's sends begin) say what a whole step moved.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from megatrain_ray.host import precision
from megatrain_ray.host.memory import remove_dead_segments, segment_name
from megatrain_ray.host.precision import StateFormat
from megatrain_ray.models.layout import LayerLayout

FRESH = ".new"  # a layer's fresh file (`DiskTier._unshare`) until it takes the layer's name
ALIGN = 4096  # O_DIRECT's alignment of offsets, sizes and buffers (a page; also every NVMe's logical block)
IO_PIECE = 8 * 2**20  # bytes one read or write call moves: a layer spreads over the pool's threads
WINDOW = 3  # buffers per store: the layer updating, the one before it writing, the next read ahead
IO_THREADS = 8  # requests in flight per store


class DiskTierError(OSError):
    """The disk tier's disk failed (full, or an I/O error); the message says which file and what to do."""


class LayerLost(DiskTierError):
    """A layer's state is gone (`DiskTier.lost`): its write failed after its buffer was taken for another
    layer, so neither its file nor a buffer holds it whole; no checkpoint can hold it any more."""


MORE_ROOM = ("give runtime.disk_dir a disk with more room or free space on it (megatrain-ray plan prints what the "
             "tier needs), or more host memory (runtime.store_memory_gib) so that less of the state goes to disk")


@dataclass(frozen=True)
class Part:
    """One tensor of a layer's state in its file."""

    name: str  # as LayerState names it: master, exp_avg, exp_avg_sq, exp_avg_scale, exp_avg_sq_scale
    dtype: torch.dtype
    numel: int
    offset: int  # bytes, a multiple of ALIGN

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def cold_keys(fmt: StateFormat) -> tuple[str, ...]:
    """The state a layer keeps on disk: what its update alone reads (a bf16 master is the compute copy)."""
    keys = ("exp_avg", "exp_avg_sq") + (precision.SCALE_KEYS if fmt.quantized else ())
    return (("master",) if fmt.master == "fp32" else ()) + keys


def layer_parts(layout: LayerLayout, fmt: StateFormat) -> tuple[Part, ...]:
    """The layer's file: its cold tensors (cold_keys) one after the other, each at an aligned offset."""
    m_dtype, v_dtype = fmt.moment_dtypes()
    k = layout.trained_numel
    sizes = {"master": (fmt.master_dtype(), layout.numel), "exp_avg": (m_dtype, k), "exp_avg_sq": (v_dtype, k)}
    for key in precision.SCALE_KEYS:
        sizes[key] = (torch.float32, precision.num_blocks(k))
    parts, offset = [], 0
    for key in cold_keys(fmt):
        dtype, numel = sizes[key]
        parts.append(Part(key, dtype, numel, offset))
        offset += aligned(numel * dtype.itemsize)
    return tuple(parts)


def compute_parts(layout: LayerLayout, fmt: StateFormat, compute_dtype: torch.dtype) -> tuple[Part, ...]:
    """The file of a layer whose compute copy is on disk too (`StorePlan.disk_compute_layers`): the
    copy, and a bf16 master's gradient buffer after it. With an fp32 master the gradient lands over
    the copy, which its update rewrites from the master. The gradient is in the file from its landing
    to its update: a step's updates come after its last gradient (the gradients' norm decides them)."""
    n = layout.numel
    parts = (Part("compute", compute_dtype, n, 0),)
    if fmt.master == "bf16":
        parts += (Part("grad", torch.bfloat16, n, aligned(n * compute_dtype.itemsize)),)
    return parts


def file_bytes(parts: tuple[Part, ...]) -> int:
    return aligned(parts[-1].offset + parts[-1].nbytes) if parts else 0


def disk_bytes(layout: LayerLayout, fmt: StateFormat) -> int:
    """Bytes a layer's state takes on disk (its file), and no longer in RAM."""
    return file_bytes(layer_parts(layout, fmt))


def window_bytes(layouts: list[LayerLayout], fmt: StateFormat, window: int = WINDOW) -> int:
    """RAM the tier's buffers take for these layers on disk."""
    return window * max((disk_bytes(layout, fmt) for layout in layouts), default=0) if layouts else 0


def compute_window_bytes(layouts: list[LayerLayout], fmt: StateFormat, compute_dtype: torch.dtype,
                         window: int = WINDOW) -> int:
    """RAM the buffers of the compute copies on disk take (HeldWindow's): as many as the store has
    such layers, `window` at most, each the size of the largest's."""
    largest = max((file_bytes(compute_parts(layout, fmt, compute_dtype)) for layout in layouts), default=0)
    return min(window, len(layouts)) * largest


SEND_PARTS = ("compute",)  # what a send of a layer fully on disk reads of its file: the copy (a bf16 master is it)


def part_bytes(parts: tuple[Part, ...], names: frozenset[str] | tuple[str, ...]) -> int:
    """Bytes the named parts take in the file, as they are read and written (each to an aligned end)."""
    return sum(aligned(p.nbytes) for p in parts if p.name in names)


def send_bytes(layout: LayerLayout, fmt: StateFormat, compute_dtype: torch.dtype) -> int:
    """Bytes a send of a layer fully on disk reads of its file (SEND_PARTS): what a step reads of it
    beside its update, where the disk binds (`StorePlan.disk_step_bytes`)."""
    return part_bytes(compute_parts(layout, fmt, compute_dtype), SEND_PARTS)


def compute_bytes(layout: LayerLayout, fmt: StateFormat, compute_dtype: torch.dtype) -> int:
    """RAM a layer's compute copy (and a bf16 master's gradient buffer) takes, which its compute
    copy on disk saves; its file's bytes are `file_bytes(compute_parts(...))`."""
    return sum(p.nbytes for p in compute_parts(layout, fmt, compute_dtype))


def open_file(path: Path) -> tuple[int, bool]:
    """A new file for reading and writing, with O_DIRECT where the file system takes it; whether it did."""
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL
    try:
        return os.open(path, flags | os.O_DIRECT, 0o600), True
    except OSError:
        Path(path).unlink(missing_ok=True)
        return os.open(path, flags, 0o600), False


@dataclass
class Slot:
    """One buffer of the window, and the layer it holds (None: none)."""

    memory: mmap.mmap
    buffer: torch.Tensor  # uint8 over `memory`
    layer: int | None = None
    reads: list[Future] = field(default_factory=list)
    writes: list[Future] = field(default_factory=list)
    in_use: bool = False  # acquired and not yet released
    ahead: bool = False  # read ahead, not yet acquired
    failed: bool = False  # its write failed: it holds the only copy of its layer's state
    parts: frozenset[str] = frozenset()  # the layer's parts the buffer holds (a send reads the copy only)
    released_at: int = 0  # when its layer was last released (the least recent is reused first)
    spare: bool = False  # taken for one read only (a checkpoint's) when the window had none free


def write_failed(slot: Slot) -> bool:
    """Whether the buffer's write failed, seen or not yet: it holds the only copy of its layer's state."""
    return slot.failed or any(f.done() and f.exception() is not None for f in slot.writes)


class DiskTier:
    """The files of a store's layers on disk and its window of buffers."""

    def __init__(self, directory: str | Path, run_id: str, layouts: dict[int, LayerLayout], fmt: StateFormat,
                 window: int | None = None, threads: int = IO_THREADS,
                 parts_of: Callable[[LayerLayout], tuple[Part, ...]] | None = None, key: str = "disk",
                 read_ahead: bool = True):
        """`parts_of`: a layer's parts (default its cold state, `layer_parts`); `key`: its files' (segment
        names); `read_ahead`: False where the caller reads ahead itself (the GPU worker's window
        asks for a layer's compute copy ahead of its use: `HeldWindow`)."""
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        files, nbytes = remove_dead_segments(self.directory)
        if files:
            print(f"removed {files} disk-tier file(s) ({nbytes / 2**30:.2f} GiB) of runs that died, from "
                  f"{self.directory}", flush=True)
        self.parts = {i: (parts_of or (lambda l: layer_parts(l, fmt)))(layout) for i, layout in layouts.items()}
        self.order = sorted(layouts)
        self.ahead = read_ahead
        self.paths: dict[int, Path] = {}
        self.fds: dict[int, int] = {}
        self.direct = True
        self.read_seconds = 0.0  # the store's thread waiting for reads: the tier's exposed time
        self.bytes_read = self.bytes_written = 0
        self.step_mark: tuple[int, int] | None = None  # (bytes_read, bytes_written) at the last step's first update
        self.last_step = (0, 0)  # (read, written) between the last two marks: a whole step's (`step_bytes`)
        self.written: set[int] = set()  # layers whose file holds state (the others read as zeros)
        self.lost: dict[int, BaseException] = {}  # layers whose write failed after their buffer was taken
        self._clock = 0
        try:
            for i in self.order:
                self._create(i, run_id, key)
        except BaseException:
            self.close()
            raise
        self.largest = largest = max((file_bytes(p) for p in self.parts.values()), default=0)
        self.slots = [self._slot(largest) for _ in range(min(window or WINDOW, len(self.order)) if largest else 0)]
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="disk-tier")

    def _create(self, index: int, run_id: str, key: str) -> None:
        path = self.directory / segment_name(run_id, index, key)
        fd, direct = open_file(path)
        self.paths[index], self.fds[index] = path, fd
        self.direct = self.direct and direct
        size = file_bytes(self.parts[index])
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            raise self._error(e, path, "allocating", size) from None

    @staticmethod
    def _slot(nbytes: int) -> Slot:
        memory = mmap.mmap(-1, nbytes)  # page-aligned, as O_DIRECT needs
        return Slot(memory, torch.frombuffer(memory, dtype=torch.uint8))

    def _error(self, e: OSError, path: Path, doing: str, nbytes: int) -> DiskTierError:
        free = os.statvfs(self.directory)
        room = free.f_bavail * free.f_frsize
        return DiskTierError(
            e.errno, f"{e.strerror} while {doing} {nbytes / 2**30:.2f} GiB of the disk tier's state in {path} "
            f"({room / 2**30:.2f} GiB free on that file system): {MORE_ROOM}")

    def _lost(self, index: int) -> LayerLost:
        """The error of a layer whose state is lost (`lost`): which layer, its file, the write's error."""
        e = self.lost[index]
        return LayerLost(getattr(e, "errno", None) or errno.EIO,
                         f"layer {index}'s state is lost: its write to {self.paths[index]} failed "
                         f"({getattr(e, 'strerror', None) or e}) after its buffer was taken for another layer, so "
                         f"neither that file nor any buffer holds it whole; {MORE_ROOM}")

    # ---- the window ------------------------------------------------------------------------------
    def acquire(self, index: int, to_change: bool = True, parts: tuple[str, ...] | None = None,
                fresh: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
        """The layer's state on disk, in a buffer of the window, by name; its reads are done. Issues
        the reads of the layers after it. `to_change`: raises first for a write that failed (the run
        stops); a read only (a checkpoint) goes on. `parts`: the names wanted (default all): only
        those the buffer lacks are read (a send reads the copy alone, SEND_PARTS); acquired again
        before its release (HeldWindow's holders), the layer's buffer gains the parts it lacks. A read
        only goes on in a spare buffer if none is free (their writes failed). A layer whose file is not
        whole and whose buffer is gone (`lost`) raises either way. `fresh`: parts of `parts` the holder
        overwrites whole (a gradient landing), never read: the buffer holds them from then on."""
        if index in self.lost:
            raise self._lost(index)
        if to_change:
            self._raise_failed_writes()
        names = self.names(index) if parts is None else frozenset(parts)
        unread = names - frozenset(fresh)
        slot = self._slot_of(index)
        if slot is None:
            slot = self._take_slot(index, wait_for_one=True) or self._spare(index, to_change)
            self._read(slot, index, unread)
        elif not unread <= slot.parts:
            self._read_more(slot, index, unread - slot.parts)
        slot.parts = slot.parts | names
        slot.in_use, slot.ahead = True, False
        t0 = time.perf_counter()
        try:
            self._wait(slot.reads, index, "reading")
        except BaseException:  # the buffer holds nothing whole: free again
            slot.in_use, slot.layer, slot.reads = False, None, []
            raise
        self.read_seconds += time.perf_counter() - t0
        if self.ahead:
            self._read_ahead(index)
        return self.views(slot, index, names)

    def release(self, index: int, dirty: bool = True) -> None:
        """The layer's buffer goes back to the window; `dirty`: its state changed, written behind (the
        parts the buffer holds: all, for every holder that changes a layer acquires it whole)."""
        slot = self._slot_of(index)
        slot.in_use = False
        if slot.spare and not dirty:
            self.slots.remove(slot)
            return
        self._clock += 1
        slot.released_at = self._clock
        if dirty:
            # every holder that changes a layer holds it whole (a send alone reads a part), so a write
            # is of the whole file: what `_unshare`'s fresh file needs, for it holds nothing before
            assert slot.parts == self.names(index), f"layer {index}: a change to a buffer holding {sorted(slot.parts)}"
            try:
                self._unshare(index)
            except DiskTierError as e:  # as a write that failed: the buffer keeps the state, the next update raises
                slot.writes, slot.failed = [failed(e)], True
            else:
                slot.writes = self._pieces(os.pwritev, slot, index, slot.parts)
            self.bytes_written += part_bytes(self.parts[index], slot.parts)
            self.written.add(index)

    def settle(self, index: int) -> None:
        """The layer's buffer's writes are done: the buffer may change again."""
        slot = self._slot_of(index)
        if slot is not None:
            self._wait(slot.writes, index, "writing")

    def pending_writes(self, index: int) -> list[Future]:
        """The writes issued for the layer's buffer (none where it holds no buffer)."""
        slot = self._slot_of(index)
        return list(slot.writes) if slot is not None else []

    def can_acquire(self, index: int, to_change: bool = True) -> bool:
        """Whether `acquire(index, to_change)` goes on now: a buffer for it (the layer's own, or one not in
        use whose write did not fail); else, to change, a failed write to raise, and to read, no buffer in
        use that could free (it reads into a spare one); a `lost` layer at once (acquire raises)."""
        if index in self.lost or any(s.layer == index or (not s.in_use and not write_failed(s)) for s in self.slots):
            return True
        return any(map(write_failed, self.slots)) if to_change else not any(s.in_use for s in self.slots)

    def mark_step(self) -> None:
        """A step's first update begins, and with it the next step's traffic (each layer's next
        forward send follows its update): the bytes since the mark before are a whole step's."""
        now = (self.bytes_read, self.bytes_written)
        if self.step_mark is not None:
            self.last_step = (now[0] - self.step_mark[0], now[1] - self.step_mark[1])
        self.step_mark = now

    def step_bytes(self) -> tuple[int, int]:
        """(read, written) bytes of the last whole step: between the last two marks (`mark_step`), one
        step's updates and the next step's forward, backward and gradients, each once, as
        `StorePlan.disk_step_bytes` counts them ((0, 0) before a second mark). Its reads include
        the next step's first layers read ahead, as the step before read its own."""
        return self.last_step

    def flush(self) -> None:
        """Every write issued is done (raises DiskTierError for one that failed)."""
        for slot in self.slots:
            if slot.layer is not None:
                self._wait(slot.writes, slot.layer, "writing")

    def views(self, slot: Slot, index: int, names: frozenset[str]) -> dict[str, torch.Tensor]:
        return {p.name: slot.buffer[p.offset : p.offset + p.nbytes].view(p.dtype) for p in self.parts[index]
                if p.name in names}

    def names(self, index: int) -> frozenset[str]:
        """Every part of the layer's file."""
        return frozenset(p.name for p in self.parts[index])

    def _slot_of(self, index: int) -> Slot | None:
        return next((s for s in self.slots if s.layer == index), None)

    def _take_slot(self, index: int, wait_for_one: bool) -> Slot | None:
        """A buffer for a new layer: a free one, else the least recently released (its write still
        running: the read waits for it), else (`wait_for_one`: a layer acquired out of the order) one
        read ahead and not yet acquired, whose read is dropped."""
        free = [s for s in self.slots if s.layer is None]
        if not free:
            free = sorted((s for s in self.slots if not s.in_use and not s.ahead and not write_failed(s)),
                          key=lambda s: s.released_at)
        if not free and wait_for_one:
            free = [s for s in self.slots if not s.in_use and not write_failed(s)]
            if free:
                wait(free[0].reads)
        return free[0] if free else None

    def _spare(self, index: int, to_change: bool) -> Slot:
        """A buffer beside the window for one read (a checkpoint's) while none of it is free; none to change."""
        if to_change:
            raise DiskTierError(0, f"the disk tier's window of {len(self.slots)} buffers has none free for layer "
                                   f"{index}: every buffer is in use or holds a layer whose write failed")
        slot = self._slot(self.largest)
        slot.spare = True
        self.slots.append(slot)
        return slot

    def _read(self, slot: Slot, index: int, names: frozenset[str]) -> None:
        """The layer's parts `names` into the buffer, once the buffer's last write (of the layer it held) is
        done; a failed one leaves that layer `lost` (the buffer held its only copy) and fails the read with
        its LayerLost."""
        before, evicted = slot.writes, slot.layer

        def evicted_written() -> None:  # on the pool, before the read: the buffer's last write, done
            for f in before:
                if f.exception() is not None:  # the buffer held the only copy of the layer it wrote
                    self.lost[evicted] = f.exception()
                    raise self._lost(evicted)

        slot.layer, slot.failed = index, False
        if index in self.written:
            # nothing to read (a landing overwrites the file whole): the evicted layer's write, waited for still
            slot.reads = self._pieces(os.preadv, slot, index, names, first=evicted_written) or [
                self.pool.submit(evicted_written)]
            slot.parts = names
            self.bytes_read += part_bytes(self.parts[index], names)
        else:  # never written: the file reads as zeros
            slot.reads = [self.pool.submit(_clear, slot.buffer[:file_bytes(self.parts[index])], evicted_written)]
            slot.parts = self.names(index)
        slot.writes = []

    def _read_more(self, slot: Slot, index: int, names: frozenset[str]) -> None:
        """Parts the layer's buffer lacks (it was read for a send), after what the buffer still has
        in flight: its reads (each after the write of the layer it held before) and its writes; `acquire`
        records what the buffer then holds."""
        in_flight = slot.reads + slot.writes
        slot.reads = slot.reads + self._pieces(os.preadv, slot, index, names, first=lambda: done(in_flight))
        self.bytes_read += part_bytes(self.parts[index], names)

    def _read_ahead(self, index: int) -> None:
        at = self.order.index(index)
        for step in range(1, len(self.slots)):
            nxt = self.order[(at + step) % len(self.order)]
            if nxt == index or self._slot_of(nxt) is not None:
                continue
            slot = self._take_slot(nxt, wait_for_one=False)
            if slot is None:
                return
            slot.ahead = True
            self._read(slot, nxt, self.names(nxt))

    def _pieces(self, call, slot: Slot, index: int, names: frozenset[str],
                first: Callable[[], None] = lambda: None) -> list[Future]:
        """The layer's parts `names` moved by `call` (os.preadv or os.pwritev) in pieces on the pool,
        each after `first()` has returned (the buffer's write, for a read into it); adjacent parts in one span."""
        fd = self.fds[index]
        view = memoryview(slot.memory)
        spans: list[tuple[int, int]] = []
        for p in self.parts[index]:
            if p.name in names:
                lo, hi = p.offset, p.offset + aligned(p.nbytes)
                if spans and spans[-1][1] == lo:
                    spans[-1] = (spans[-1][0], hi)
                else:
                    spans.append((lo, hi))

        def move(lo: int, hi: int) -> None:
            first()
            done = lo
            while done < hi:
                n = call(fd, [view[done:hi]], done)
                if n <= 0:
                    raise OSError(5, "short read or write")
                done += n

        return [self.pool.submit(move, at, min(hi, at + IO_PIECE)) for lo, hi in spans for at in range(lo, hi, IO_PIECE)]

    # ---- a checkpoint's links to the files ----------------------------------------------------------
    def link(self, index: int, target: Path, punch: tuple[int, int] | None = None) -> bool:
        """Hard-link the layer's file as `target`, its writes done and on disk, so that `target` holds the
        layer's state as it is now; the tier writes that file in place never again (`_unshare`). False,
        and no link, where the state is not all in the file (a buffer whose write failed; a `lost` layer,
        whose copy then raises) or `target` is on another file system (or one without hard links): the
        caller copies it then. The caller sees to
        it that no update changes the layer meanwhile (the store's thread, or HeldWindow's lock).
        `punch`: (offset, bytes) of the file that hold nothing the state needs (a gradient after its
        update), freed first where the file system can, so that the checkpoint does not hold them."""
        slot = self._slot_of(index)
        failed = slot is not None and (slot.failed or any(f.exception() is not None for f in slot.writes))
        if failed or index in self.lost:
            return False  # (Future.exception waits for the write)
        fd = self.fds[index]
        if punch is not None:
            punch_hole(fd, *punch)
        os.fsync(fd)
        try:
            os.link(self.paths[index], target)
        except OSError as e:
            if e.errno in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
                return False
            raise
        return True

    def _unshare(self, index: int) -> None:
        """Before a write of the layer: a file another link shares (a checkpoint's, `link`) is replaced,
        under the tier's name, by a fresh one, allocated in full, and the other link keeps the old bytes.
        The old file stays the layer's until the new one has its name: a failure on the way leaves it
        shared, so the next write tries again and none lands in it."""
        if os.fstat(self.fds[index]).st_nlink <= 1:
            return
        path = self.paths[index]
        fresh = path.with_name(path.name + FRESH)
        fresh.unlink(missing_ok=True)
        fd, direct = open_file(fresh)
        size = file_bytes(self.parts[index])
        try:
            os.posix_fallocate(fd, 0, size)
            os.rename(fresh, path)
        except OSError as e:
            os.close(fd)
            fresh.unlink(missing_ok=True)
            raise self._error(e, path, "allocating", size) from None
        os.close(self.fds[index])
        self.fds[index] = fd
        self.direct = self.direct and direct

    def _wait(self, futures: list[Future], index: int, doing: str) -> None:
        for f in futures:
            e = f.exception()
            if e is not None:
                if doing == "writing":
                    self._slot_of(index).failed = True
                raise (self._error(e, self.paths[index], doing, file_bytes(self.parts[index]))
                       if isinstance(e, OSError) and not isinstance(e, DiskTierError) else e) from None

    def _raise_failed_writes(self) -> None:
        for slot in self.slots:
            if slot.layer is not None and write_failed(slot):
                self._wait(slot.writes, slot.layer, "writing")

    def resident_bytes(self) -> int:
        """RAM the window takes."""
        return sum(len(s.memory) for s in self.slots)

    def file_bytes(self) -> int:
        return sum(file_bytes(p) for p in self.parts.values())

    def close(self) -> None:
        """Waits for the writes in flight, then removes the files (scratch: a checkpoint holds the state)."""
        pool = getattr(self, "pool", None)
        if pool is not None:
            pool.shutdown(wait=True)
        for fd in self.fds.values():
            os.close(fd)
        for path in self.paths.values():
            path.unlink(missing_ok=True)
        self.fds.clear()
        self.paths.clear()


class HeldWindow:
    """A DiskTier of compute copies (`compute_parts`) that several threads use at once: the store's
    link serving weights and landing gradients (host/transport.py, LayerServer), and its updates. A
    layer is held by any number of them, read into a buffer by the first (the GPU worker's window
    asks for it ahead of its use: that is the read ahead), and released when the last lets go,
    written back if one of them changed it. A thread that needs a buffer while all are held waits
    for one: every hold ends on its own (a send, a gradient's landing, an update: none waits for
    another layer; a send or a landing held across the link's connections ends with the last of
    them, each of which asks for the layer without waiting for another, or when one closes), so
    every wait ends."""

    def __init__(self, tier: DiskTier):
        self.tier = tier
        self.cond = threading.Condition()
        self.holders: Counter = Counter()
        self.changed: set[int] = set()  # held layers a holder changed: written back when the last lets go

    def numel(self, index: int) -> int:
        return self.tier.parts[index][0].numel

    def hold(self, index: int, to_change: bool = True, parts: tuple[str, ...] | None = None,
             fresh: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
        """The layer's buffer's tensors by name (compute, and a bf16 master's grad; `parts`: only
        those, as DiskTier.acquire's), held until `let_go`; a later holder that wants more reads what
        the buffer lacks. The first holder also waits for the buffer's last write: it may change the
        bytes. `to_change` as DiskTier.acquire's: False (a checkpoint's read) goes on past a failed write;
        True raises it, without waiting for a buffer that buffers holding failed writes may never free."""
        with self.cond:
            first = not self.holders[index]
            if first:
                self.cond.wait_for(lambda: self.tier.can_acquire(index, to_change))
            views = self.tier.acquire(index, to_change, parts, fresh)
            if first and to_change:
                try:
                    self.tier.settle(index)
                except BaseException:  # its last write failed: the buffer keeps the only copy
                    self.tier.release(index, dirty=False)
                    raise
            self.holders[index] += 1
            return views

    def let_go(self, index: int, dirty: bool = False) -> None:
        """One hold ends (`dirty`: it changed the layer); the last writes the layer back if any holder did."""
        with self.cond:
            if dirty:
                self.changed.add(index)
            self.holders[index] -= 1
            if self.holders[index] == 0:
                del self.holders[index]
                self.tier.release(index, index in self.changed)
                self.changed.discard(index)
                self.cond.notify_all()
                for f in self.tier.pending_writes(index):  # one that fails makes a waiting hold go on (and raise)
                    f.add_done_callback(self._wake)

    def _wake(self, _done: Future) -> None:
        with self.cond:
            self.cond.notify_all()

    @contextmanager
    def held(self, index: int, dirty: bool = False, parts: tuple[str, ...] | None = None,
             fresh: tuple[str, ...] = ()):
        views = self.hold(index, parts=parts, fresh=fresh)
        try:
            yield views
        finally:
            self.let_go(index, dirty)

    @contextmanager
    def sending(self, index: int):
        """The layer's compute copy while a send reads it: its file's SEND_PARTS alone are read."""
        with self.held(index, parts=SEND_PARTS) as views:
            yield views["compute"]

    def hold_for_send(self, index: int) -> dict[str, torch.Tensor]:
        """`hold` for a send: the parts it reads alone (SEND_PARTS)."""
        return self.hold(index, parts=SEND_PARTS)

    def landing_part(self, index: int) -> str:
        """The part of the layer's file its gradient lands in, whole: a bf16 master's grad, else the copy."""
        return "grad" if "grad" in self.tier.names(index) else "compute"

    def hold_for_gradient(self, index: int) -> dict[str, torch.Tensor]:
        """`hold` for a gradient's landing: the part it lands in is not read (`landing_part`)."""
        return self.hold(index, fresh=(self.landing_part(index),))

    @contextmanager
    def gradient(self, index: int):
        """Where the layer's gradient lands (`landing_part`, never read: the landing writes it whole),
        held while it lands and written to the file after."""
        part = self.landing_part(index)
        with self.held(index, dirty=True, fresh=(part,)) as views:
            yield views[part]

    def link(self, index: int, target: Path, punch: tuple[int, int] | None = None) -> bool:
        """DiskTier.link, while no holder has changed the layer without its write back."""
        with self.cond:
            return index not in self.changed and self.tier.link(index, target, punch)

    def resident_bytes(self) -> int:
        return self.tier.resident_bytes()

    def flush(self) -> None:
        """Every write issued is done (raises DiskTierError for one that failed)."""
        with self.cond:
            self.tier.flush()

    def mark_step(self) -> None:
        with self.cond:
            self.tier.mark_step()


def failed(e: BaseException) -> Future:
    f: Future = Future()
    f.set_exception(e)
    return f


FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 1, 2


def punch_hole(fd: int, offset: int, nbytes: int) -> bool:
    """Free the blocks of [offset, offset + nbytes) of the file (they read as zeros after), where the file
    system can (Linux's fallocate with FALLOC_FL_PUNCH_HOLE: ext4, xfs, btrfs, tmpfs); whether it did."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        call = libc.fallocate
    except (OSError, AttributeError):
        return False
    call.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    return call(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, nbytes) == 0


def done(futures: list[Future]) -> None:
    """Once every one of `futures` is done; raises the first one's error."""
    for f in futures:
        f.result()


def _clear(buffer: torch.Tensor, first: Callable[[], None]) -> None:
    """On the pool: the buffer zeroed once `first()` (its last write done) has returned."""
    first()
    buffer.zero_()


# ---------------------------------------------------------------------------------------------
# What the disk under runtime.disk_dir has: room and speed (the plan's, planning/placement.py)
# ---------------------------------------------------------------------------------------------

PROBE_BYTES = 256 * 2**20  # what the probe writes and reads back: enough for a pool of requests in flight


def free_bytes(directory: str | Path) -> int:
    """Bytes free to this user on the file system that holds `directory` (or its nearest existing parent)."""
    path = Path(directory).absolute()
    while not path.exists():
        path = path.parent
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def probe_bytes(free: int) -> int:
    """What the probe writes on a disk with `free` bytes: PROBE_BYTES, or a quarter of what is free
    (a page at least) on a disk with less, which the probe must not fill."""
    return max(ALIGN, min(PROBE_BYTES, free // 4 // ALIGN * ALIGN))


def probe_disk(directory: str | Path, nbytes: int = PROBE_BYTES, threads: int = IO_THREADS) -> tuple[float, float]:
    """(read, write) GB/s of the disk under `directory`, as the tier moves bytes: a file of `nbytes`
    written and read back in IO_PIECE pieces on `threads` threads, O_DIRECT where the file system
    takes it (buffered, a read back would come from the page cache: then dropped first with
    POSIX_FADV_DONTNEED). The file is removed."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"megatrain-probe-{os.getpid()}-{os.urandom(4).hex()}"
    fd, _ = open_file(path)
    memory = mmap.mmap(-1, nbytes)
    chunk = os.urandom(min(nbytes, IO_PIECE))
    for lo in range(0, nbytes, len(chunk)):
        memory[lo : lo + len(chunk)] = chunk[: nbytes - lo]
    view = memoryview(memory)
    pieces = [(lo, min(nbytes, lo + IO_PIECE)) for lo in range(0, nbytes, IO_PIECE)]
    try:
        with ThreadPoolExecutor(threads) as pool:
            def timed(call) -> float:
                t0 = time.perf_counter()
                list(pool.map(lambda p: call(fd, [view[p[0]:p[1]]], p[0]), pieces))
                if call is os.pwritev:
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, nbytes, os.POSIX_FADV_DONTNEED)
                return nbytes / (time.perf_counter() - t0) / 1e9

            write = timed(os.pwritev)
            read = timed(os.preadv)
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
        view.release()
        memory.close()
    return read, write
