"""Weight slots on the device and the prefetcher that keeps the next layers copying into them."""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass

import torch

from megatrain_ray.host.sources import LayerSource
from megatrain_ray.streaming.hooks import NO_HOOKS, StepHooks
from megatrain_ray.streaming.layer_traffic import LayerTraffic
from megatrain_ray.streaming.streams import Streams


@dataclass
class Slot:
    id: int
    buffer: torch.Tensor
    layer: int | None = None
    ready: object = None  # event: the copy into the buffer finished
    free: object = None  # event: the last compute that read the buffer finished


class Prefetcher(LayerTraffic):
    """Keeps the next layers of the step's order copying into free slots while the current computes.

    A slot is chosen Belady-style: the one whose resident layer is needed furthest in the future
    (or never again this step); a layer already resident is reused without a copy, so the last
    blocks of forward are not fetched again at the turn into backward.
    """

    def __init__(self, layouts, source: LayerSource, streams: Streams, dtype, num_slots: int, stats,
                 hooks: StepHooks = NO_HOOKS):
        super().__init__(layouts, source, streams, dtype, stats, hooks)
        self.pools: dict[int, list[Slot]] = {}
        counts: dict[int, int] = {}
        for layout in layouts:
            counts[layout.numel] = counts.get(layout.numel, 0) + 1
        ids = itertools.count()
        for numel, count in counts.items():
            self.pools[numel] = [
                Slot(next(ids), torch.empty(numel, dtype=dtype, device=streams.device))
                for _ in range(min(num_slots, count))
            ]
        self.order: list[int] = []  # the layers a step reads, in the order it reads them
        self.issued_upto = 0
        self.now = 0  # the order's position after the compute most recently acquired
        self.resident: dict[int, Slot] = {}

    def begin_step(self, order: list[int]) -> None:
        """A new step: weights changed on the host, so nothing resident is current."""
        self.order = order
        self.source.begin_step(order)
        self.issued_upto = 0
        self.now = 0
        self.resident.clear()
        for pool in self.pools.values():
            for slot in pool:
                slot.layer = None

    def _next_use(self, layer: int, after: int) -> float:
        for pos in range(after, len(self.order)):
            if self.order[pos] == layer:
                return pos
        return math.inf

    def _victim(self, layer: int, pos: int, now: int) -> Slot | None:
        """A slot that may receive `layer` (needed at `pos`) without evicting anything needed sooner."""
        best, best_use = None, -1.0
        for slot in self.pools[self.layouts[layer].numel]:
            use = math.inf if slot.layer is None else self._next_use(slot.layer, now)
            if use > pos and use > best_use:
                best, best_use = slot, use
        return best

    def _issue(self, now: int, upto: int | None = None) -> None:
        """Copy in the layers of the order's positions from `issued_upto` on, as far as slots allow
        (or only up to `upto`); each copy first waits for that layer's optimizer update."""
        last = len(self.order) - 1 if upto is None else min(upto, len(self.order) - 1)
        while self.issued_upto <= last:
            pos = self.issued_upto
            layer = self.order[pos]
            if layer not in self.resident:
                slot = self._victim(layer, pos, now)
                if slot is None:
                    return  # every slot of this size is needed before `pos`: stop looking ahead
                self._copy_in(slot, layer)
            self.issued_upto += 1

    def _copy_in(self, slot: Slot, layer: int) -> None:
        if slot.layer is not None:
            del self.resident[slot.layer]
        t0 = time.perf_counter()
        from_host = not self.source.serves_from_device(layer)
        host = self.source.weights(layer)
        t1 = time.perf_counter()
        self.stats.prefetch_wait_s += t1 - t0
        s = self.streams
        with s.on(s.h2d):
            waited = None
            if slot.free is not None:
                s.wait(s.h2d, slot.free)  # never overwrite weights a pending compute still reads
                waited = slot.free
            start = s.record(s.h2d, timing=True)
            slot.buffer.copy_(host, non_blocking=True)
            slot.ready = s.record(s.h2d, timing=True)
        self.source.weights_copied(layer, slot.ready)
        if from_host:  # not weights a device step left on the device (streaming/device_step.py)
            if s.cuda:
                self.stats.h2d_events.append((start, slot.ready))
            else:
                self.stats.h2d_seconds += time.perf_counter() - t1
            self.stats.h2d_bytes += host.numel() * host.element_size()
        self.stats.copies += 1
        self.hooks.copy(slot.id, layer, waited)
        slot.layer = layer
        self.resident[layer] = slot

    def acquire(self, pos: int) -> Slot:
        """The slot holding order[pos], ready for the compute stream.

        Only order[pos] itself is copied in here if it is missing; the copies further ahead
        are issued in `release`, after this compute is queued, so the device never idles while
        the host waits for a later layer's optimizer update.
        """
        self._issue(pos, upto=pos)
        self.now = pos + 1
        layer = self.order[pos]
        if layer not in self.resident:
            raise RuntimeError(f"layer {layer} was not prefetched: too few slots for the step's order")
        slot = self.resident[layer]
        self.streams.wait(self.streams.compute, slot.ready)
        self.hooks.compute(slot.id, layer)
        return slot

    def release(self, slot: Slot) -> None:
        """The compute that reads the slot is queued: mark when it ends, then look ahead."""
        slot.free = self.streams.record(self.streams.compute)
        self.hooks.free(slot.id, slot.layer, slot.free)
        self._issue(self.now)
