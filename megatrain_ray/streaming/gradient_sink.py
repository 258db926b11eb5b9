"""Gradients accumulated on the device across a step's micro-batches, sent to the host once.

With several data-parallel workers (streaming/data_parallel.py) a finished gradient is first summed across
them on the devices, into the copy of the layer's owner; only the owner folds it into the norm and
copies it out. The sum runs while the next layer's backward computes: a layer's reduction is waited
for (and, on the other ranks, its buffer freed) only when the next layer's gradient is complete.
The layers the step plan names (`host_layers`: a vocabulary-sized embedding or head whose fp32
accumulator does not fit the GPU, one worker only) are summed in pinned host memory instead
(streaming/host_gradients.py).
"""

from __future__ import annotations

import time

import torch

from megatrain_ray.streaming.data_parallel import Group
from megatrain_ray.host.sources import LayerSource
from megatrain_ray.streaming.hooks import NO_HOOKS, StepHooks
from megatrain_ray.streaming.host_gradients import HostGradients
from megatrain_ray.streaming.layer_traffic import LayerTraffic
from megatrain_ray.streaming.streams import Streams


class GradientSink(LayerTraffic):
    def __init__(self, layouts, source: LayerSource, streams: Streams, dtype, stats, group: Group | None = None,
                 hooks: StepHooks = NO_HOOKS, host_layers: tuple[int, ...] = ()):
        super().__init__(layouts, source, streams, dtype, stats, hooks)
        self.group = group or Group.solo(len(layouts))
        self.acc: dict[int, torch.Tensor] = {}
        self.landed: dict[int, object] = {}
        self.reducing: tuple[int, torch.Tensor, object] | None = None  # (layer, buffer, handle) in flight
        self.norm_sq = torch.zeros((), dtype=torch.float32, device=streams.device)
        if host_layers and self.group.world > 1:
            raise ValueError("gradients summed in host memory are planned for one worker only")
        self.host_layers = frozenset(host_layers)
        self.host = HostGradients(streams, dtype, stats) if host_layers else None

    @property
    def stats(self):
        return self._stats

    @stats.setter
    def stats(self, stats) -> None:  # the executor hands each step a fresh record
        self._stats = stats
        if getattr(self, "host", None) is not None:
            self.host.stats = stats

    def begin_step(self) -> None:
        self.acc.clear()
        self.landed.clear()
        self.reducing = None
        self.norm_sq = torch.zeros((), dtype=torch.float32, device=self.streams.device)

    def add(self, layer: int, grads: dict[str, torch.Tensor]) -> None:
        """Accumulate one micro-batch's per-parameter gradients into the layer's flat fp32 buffer
        (the first gradient of a layer may cover part of it: a shared block's, from a later layer
        that runs it, the rest then starts from zero). A layer the plan sums in host memory leaves
        the device now (streaming/host_gradients.py)."""
        if layer in self.host_layers:
            self.host.add(self.layouts[layer], grads)
            return
        fresh = layer not in self.acc
        if fresh:
            whole = len(grads) == len(self.layouts[layer].params)
            make = torch.empty if whole else torch.zeros
            self.acc[layer] = make(self.layouts[layer].numel, dtype=torch.float32, device=self.streams.device)
        views = self.layouts[layer].views(self.acc[layer])
        for name, g in grads.items():
            views[name].copy_(g) if fresh else views[name].add_(g)

    def send(self, layer: int) -> None:
        """This worker's share of the layer's gradient is complete: sum it across the workers (alone:
        nothing to sum) and, on the layer's owner, fold it into the norm and copy it out, once."""
        if layer in self.host_layers:
            self._copy_out_summed(layer)
            return
        acc = self.acc.pop(layer)
        handle = self.group.reduce(acc, layer)
        if handle is None:
            self._copy_out(layer, acc)
            return
        self.finish()  # the previous layer's sum has had this layer's backward to complete in
        self.reducing = (layer, acc, handle)

    def finish(self) -> None:
        """Wait (the compute stream waits) for the sum in flight; its owner copies it out."""
        if self.reducing is None:
            return
        layer, acc, handle = self.reducing
        self.reducing = None
        handle.wait()
        if self.group.owns(layer):
            self._copy_out(layer, acc)

    def _copy_out(self, layer: int, acc: torch.Tensor) -> None:
        self.norm_sq += acc.pow(2).sum()
        if self.source.steps_on_device(layer):  # its optimizer step runs here: nothing leaves
            self.source.take_gradient(layer, acc)
            self.landed[layer] = self.streams.record(self.streams.compute)
            return
        staged = acc.to(self.dtype)
        s = self.streams
        computed = s.record(s.compute)
        host = self.source.grad_buffer(layer)
        t0 = time.perf_counter()
        with s.on(s.d2h):
            s.wait(s.d2h, computed)
            start = s.record(s.d2h, timing=True)
            host.copy_(staged, non_blocking=True)
            done = s.record(s.d2h, timing=True)
        if s.cuda:
            staged.record_stream(s.d2h)
            self.stats.d2h_events.append((start, done))
        else:
            self.stats.d2h_seconds += time.perf_counter() - t0
        self.stats.d2h_bytes += host.numel() * host.element_size()
        self.landed[layer] = done
        self.source.gradient_ready(layer, done)
        self.hooks.gradient(layer)

    def _copy_out_summed(self, layer: int) -> None:
        """A layer summed in host memory: its norm folded in, rounded into the store's buffer by the
        CPU (as the device rounds its fp32 sum), ready at once."""
        total, norm_sq = self.host.finish(self.layouts[layer])
        self.norm_sq += norm_sq.to(self.norm_sq.device)
        self.source.grad_buffer(layer).copy_(total)
        done = self.streams.record(self.streams.d2h)
        self.landed[layer] = done
        self.source.gradient_ready(layer, done)
        self.hooks.gradient(layer)
