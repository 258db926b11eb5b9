"""A layer's weight gradient summed in pinned host memory instead of on the device.

The step plan names the layers (`StepPlan.host_gradients`: the embedding and an untied LM head
where their vocabulary-sized fp32 accumulator does not fit the GPU; planning/decisions.py). Each
micro-batch's (the embedding's) or loss chunk's (the head's) gradient, as autograd makes it in the
compute dtype, is copied out into a pinned staging buffer and the device copy let go; a thread
adds it into the layer's fp32 sum while the device computes the next. The sum is the device
path's: the same compute-dtype addends, added in the same order in fp32 (one rounding each, on
either side), so the gradient the store receives is bit for bit the device path's; only the
squared norm's summation order differs (`norm_sq`).
"""

from __future__ import annotations

import concurrent.futures
import time

import torch

from megatrain_ray.models.layout import LayerLayout
from megatrain_ray.streaming.streams import Streams, TransferStats

STAGING = 2  # pinned staging buffers: one filling from the device while the thread adds the other
# elements of a staged share widened to fp32 at a time before their add: the widened piece (4 MiB)
# stays in the caches, so the add moves the share's bytes and the sum's through memory once, where
# torch's add of a compute-dtype tensor into an fp32 one converts element by element at a third of
# the speed (one core: 0.33 G elements/s mixed, 0.99 in pieces, measured on the CPU)
ADD_PIECE = 1 << 20
NORM_PIECE = 1 << 24  # elements a partial sum of squares covers, summed in fp64


class HostGradients:
    """The fp32 sums of the layers the plan names, one layer at a time (the embedding's and an
    untied head's backward never overlap), in buffers made at the first use and kept."""

    def __init__(self, streams: Streams, dtype: torch.dtype, stats: TransferStats):
        self.streams = streams
        self.dtype = dtype
        self.stats = stats
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="host-gradients")
        self.sum: torch.Tensor | None = None  # fp32, the largest layer's size
        self.staging: list[torch.Tensor] = []
        self.adding: list[concurrent.futures.Future | None] = [None] * STAGING
        self.turn = 0
        self.layer: int | None = None  # whose sum is being made

    def _buffers(self, numel: int) -> None:
        if self.sum is not None and self.sum.numel() >= numel:
            return
        pinned = self.streams.cuda
        self.sum = torch.empty(numel, dtype=torch.float32, pin_memory=pinned)
        self.staging = [torch.empty(numel, dtype=self.dtype, pin_memory=pinned) for _ in range(STAGING)]

    def add(self, layout: LayerLayout, grads: dict[str, torch.Tensor]) -> None:
        """One micro-batch's or chunk's gradients of the layer (a subset of its parameters at most)
        into its sum: copied out now, added on the thread."""
        fresh = self.layer != layout.index
        if fresh:
            self.wait()
            self._buffers(layout.numel)
            self.layer = layout.index
            if len(grads) < len(layout.params):
                self.sum[:layout.numel].zero_()
        k = self.turn
        self.turn = (self.turn + 1) % STAGING
        if self.adding[k] is not None:
            self._wait_for(self.adding[k])  # the thread has added what this buffer held
        staging = layout.views(self.staging[k][:layout.numel])
        s = self.streams
        computed = s.record(s.compute)
        t0 = time.perf_counter()
        with s.on(s.d2h):
            s.wait(s.d2h, computed)
            start = s.record(s.d2h, timing=True)
            for name, g in grads.items():
                staging[name].copy_(g, non_blocking=True)
            done = s.record(s.d2h, timing=True)
        done.synchronize()  # the device's copy can go: one chunk's gradient on the device at a time
        if s.cuda:
            self.stats.d2h_events.append((start, done))
        else:
            self.stats.d2h_seconds += time.perf_counter() - t0
        self.stats.d2h_bytes += sum(g.numel() for g in grads.values()) * staging_bytes(self.dtype)
        sums = layout.views(self.sum[:layout.numel])
        whole = fresh and len(grads) == len(layout.params)
        self.adding[k] = self.pool.submit(_accumulate, sums, staging, list(grads), whole)

    def wait(self) -> None:
        for k, future in enumerate(self.adding):
            if future is not None:
                self._wait_for(future)
                self.adding[k] = None

    def _wait_for(self, future: concurrent.futures.Future) -> None:
        """An add's end, the time blocked counted (the step's `host_add_wait_s`)."""
        t0 = time.perf_counter()
        future.result()
        self.stats.host_add_wait_s += time.perf_counter() - t0

    def finish(self, layout: LayerLayout) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's complete fp32 sum (host memory, valid until the next layer's first add) and
        its squared norm (fp32, summed in fp64 pieces)."""
        assert self.layer == layout.index, f"layer {layout.index}'s gradient was not summed in host memory"
        self.wait()
        self.layer = None
        total = self.sum[:layout.numel]
        norm_sq = sum(float(torch.dot(p, p)) for p in total.split(NORM_PIECE))
        return total, torch.tensor(norm_sq, dtype=torch.float32)


def staging_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _accumulate(sums: dict[str, torch.Tensor], staging: dict[str, torch.Tensor], names: list[str], whole: bool) -> None:
    """On the thread: the staged gradients into the layer's fp32 sums (the first of a whole layer
    copied, as the device path's first is)."""
    for name in names:
        sums[name].copy_(staging[name]) if whole else add_widened(sums[name].view(-1), staging[name].view(-1))


def add_widened(total: torch.Tensor, part: torch.Tensor) -> None:
    """`total` (fp32) += `part` (the compute dtype) exactly as torch's mixed add rounds it (the part
    widened exactly, one fp32 rounding), a piece of ADD_PIECE elements at a time (see ADD_PIECE)."""
    if part.dtype == total.dtype:
        total.add_(part)
        return
    wide = torch.empty(min(ADD_PIECE, part.numel()), dtype=total.dtype)
    for lo in range(0, part.numel(), ADD_PIECE):
        hi = min(part.numel(), lo + ADD_PIECE)
        piece = wide[: hi - lo]
        piece.copy_(part[lo:hi])
        total[lo:hi].add_(piece)
