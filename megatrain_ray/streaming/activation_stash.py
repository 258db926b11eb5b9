"""Boundary activations: each layer's input per micro-batch, on the device or parked in host memory."""

from __future__ import annotations

import torch

from megatrain_ray.streaming.streams import Streams


class ActivationStash:
    """Each layer's input for every micro-batch, kept for its recompute in backward.

    With `offload`, inputs leave for pinned host memory on the d2h stream as soon as the layer
    has read them, and come back one layer ahead of their backward on the h2d stream, so the
    device holds about two layers' boundary activations instead of all of them.
    """

    def __init__(self, streams: Streams, offload: bool):
        self.streams = streams
        self.offload = offload and streams.cuda
        self.items: list[tuple[str, list[torch.Tensor], object]] = []
        self.back: dict[int, tuple[list[torch.Tensor], object]] = {}

    def push(self, xs: list[torch.Tensor]) -> None:
        if not self.offload or not isinstance(xs[0], torch.Tensor) or not xs[0].is_floating_point():
            self.items.append(("device", xs, None))
            return
        s = self.streams
        computed = s.record(s.compute)
        with s.on(s.d2h):
            s.wait(s.d2h, computed)
            hosts = [torch.empty(x.shape, dtype=x.dtype, pin_memory=True).copy_(x, non_blocking=True) for x in xs]
            parked = s.record(s.d2h)
        for x in xs:
            x.record_stream(s.d2h)
        self.items.append(("host", hosts, parked))

    def prefetch(self, index: int) -> None:
        if index < 0 or index in self.back or self.items[index][0] == "device":
            return
        _, hosts, parked = self.items[index]
        s = self.streams
        with s.on(s.h2d):
            s.wait(s.h2d, parked)
            devs = [h.to(s.device, non_blocking=True) for h in hosts]
            ready = s.record(s.h2d)
        for d in devs:
            d.record_stream(s.compute)
        self.back[index] = (devs, ready)

    def pop(self) -> list[torch.Tensor]:
        index = len(self.items) - 1
        kind, xs, _ = self.items[index]
        if kind == "host":
            self.prefetch(index)
            xs, ready = self.back.pop(index)
            self.streams.wait(self.streams.compute, ready)
        self.items.pop()
        self.prefetch(index - 1)  # the next layer's input travels while this one computes
        return xs
