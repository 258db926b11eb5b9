"""What the two ends of a step's layer traffic share: the prefetcher (weights in) and the gradient
sink (gradients out) each move every layer's tensor between a host source and the device, on the
scheduler's streams, in the compute dtype, counting into the step's transfer record and telling the
step's observer."""

from __future__ import annotations

from megatrain_ray.host.sources import LayerSource
from megatrain_ray.streaming.hooks import NO_HOOKS, StepHooks
from megatrain_ray.streaming.streams import Streams


class LayerTraffic:
    def __init__(self, layouts, source: LayerSource, streams: Streams, dtype, stats, hooks: StepHooks = NO_HOOKS):
        self.layouts = layouts  # every layer's LayerLayout, by index
        self.source = source  # the host side: weights from it, gradients to it
        self.streams = streams
        self.dtype = dtype  # the compute dtype of the tensors on the device
        self.stats = stats  # the step's TransferStats (the executor hands each step a fresh one)
        self.hooks = hooks
