"""Muon's momentum update and Newton-Schulz iteration on the worker's device, in the update phase.

The orthogonalization of a Muon block's matrices (host/muon.py) is a few matrix products per matrix:
about 1.9e13 FLOP a step for one Qwen2.5-7B block, minutes on a host's cores and tens of
milliseconds on a GPU. It needs the step's clip factor, known once the whole backward has ended, so
it runs where the layers' updates are sent (StreamingExecutor.train_step), one block after another:

1. the block's gradient (in the store's buffer, as the host would read it) and its momentum go to
   the device;
2. there, torch.optim.Muon's arithmetic (host/muon.py, `orthogonalize`, the host's own function):
   the clip factor, the momentum's lerp, Nesterov, Newton-Schulz in bf16, per matrix;
3. the new momentum goes back into the store's buffer and the orthogonalized update over the
   gradient, and the store is sent the step with `MuonStep.orthogonalized`: it only applies the
   update to its master (and steps the block's other tensors, its norms and biases, by AdamW).

The matrices flow through three stages on three streams: matrix k+2's gradient and momentum upload
while matrix k+1 iterates and matrix k's results come back (the copies of a Qwen2.5-7B matrix take
about as long over PCIe as its iterations, so fewer than three in flight leave the GPU waiting on a
copy every other matrix). Three matrices on the device at once, counted across the blocks (the host
waits for matrix k to land before it uploads matrix k+3), bound the memory the phase takes below what
the backward freed (its activations, kept graphs and gradient accumulator). A block's message to its
store leaves once its own results have landed, so the store applies block i while the device iterates
block i+1. Nothing else waits: the clip factor is a number the step already has, and the host's
buffers are page-locked (host/remote_sources.py), so every copy is asynchronous. The store's marker of the layer (host/store.py, held_marker) reads IN_FLUX
from before the momentum is written until the store has applied that step: a checkpoint written from
the stores alone after a worker died in between refuses that state (runtime/session.py).

The step plan names the blocks (planning/step_plan.py, `StepPlan.muon_on_device`): on a GPU, the
Muon blocks whose store is on the worker's node (their momentum in shared memory); a worker wraps
those it owns. On the CPU, or for a block on another node, the store does it all itself.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from megatrain_ray.host.adamw import AdamWStep
from megatrain_ray.host.muon import host_orthogonalized, muon_slots, orthogonalize
from megatrain_ray.host.sources import LayerSource
from megatrain_ray.host.store import IN_FLUX
from megatrain_ray.models.layout import LayerLayout
from megatrain_ray.streaming.streams import Streams

IN_FLIGHT = 3  # matrices on the device at once: one uploading, one iterating, one coming back


@dataclass
class Sent:
    """A block whose results are on their way back: its store's message waits for `landed`."""

    layer: int
    hp: AdamWStep
    landed: object  # event


class MuonStepSource:
    """`inner` for everything but the update of the blocks in `momenta` (layer: its momentum and
    marker as this process reaches them), whose momentum update and orthogonalization run on `device`."""

    def __init__(self, inner: LayerSource, momenta: dict[int, tuple[torch.Tensor, torch.Tensor]],
                 layouts: tuple[LayerLayout, ...], device: torch.device):
        self.inner = inner
        self.momenta = momenta
        self.layouts = layouts
        self.streams = Streams(device)
        self.sent: Sent | None = None
        self.in_flight: deque = deque()  # the events at which the matrices on the device land, oldest first
        self.orthogonalized = 0  # blocks done here (what a test checks ran)

    def __getattr__(self, name: str):
        """Every other call of the source protocol (host/sources.py) goes to `inner` unchanged."""
        return getattr(self.inner, name)

    def weights(self, layer: int) -> torch.Tensor:
        self._send()
        return self.inner.weights(layer)

    def update(self, layer: int, hp: AdamWStep | None, gradient_landed) -> None:
        """The block's momentum update and orthogonalization here, its application on the host; any
        other update (or a skipped step's) straight to `inner`, after the block in flight's message."""
        if layer not in self.momenta or hp is None or hp.muon is None:
            self._send()
            self.inner.update(layer, hp, gradient_landed)
            return
        landed = self._orthogonalize(layer, hp, gradient_landed)
        self._send()
        self.sent = Sent(layer, host_orthogonalized(hp), landed)
        if layer == max(self.momenta):  # its message cannot wait for another update or read
            self._send()
            self.in_flight.clear()  # all landed

    def drain(self) -> None:
        self._send()
        self.inner.drain()

    def close(self) -> None:
        self._send()
        self.inner.close()

    def _send(self) -> None:
        """The store's message of the block in flight, once its momentum and update have landed."""
        if self.sent is not None:
            sent, self.sent = self.sent, None
            self.inner.update(sent.layer, sent.hp, sent.landed)
            self.orthogonalized += 1

    def _orthogonalize(self, layer: int, hp: AdamWStep, gradient_landed):
        """Queue the block's trip a matrix at a time (a stacked tensor of experts: the tensor): in on
        the copy-in stream, the arithmetic on the compute stream, out on the copy-out stream, with at
        most IN_FLIGHT of them on the device, this block's and the one's before (the host waits for
        the oldest to land before the next starts: a Qwen2.5-7B MLP matrix takes about 1.4 GB there
        while it iterates, a block whole would take 4.7); returns the event at which the block's
        results have all landed."""
        s = self.streams
        momentum, held = self.momenta[layer]
        grad = self.inner.grad_buffer(layer)
        held.fill_(IN_FLUX)  # the store's last update of it has landed: the executor read its weights since
        in_flight = self.in_flight
        for slot in muon_slots(self.layouts[layer], "muon"):
            if len(in_flight) == IN_FLIGHT:
                in_flight.popleft().synchronize()
            part = slice(slot.offset, slot.offset + slot.numel)
            with s.on(s.h2d):
                s.wait(s.h2d, gradient_landed)
                g = grad[part].to(s.device, non_blocking=True, copy=True)
                m = momentum[part].to(s.device, non_blocking=True, copy=True)
                uploaded = s.record(s.h2d)
            with s.on(s.compute):
                s.wait(s.compute, uploaded)
                buf, update = orthogonalize(g, m, slot.shape, hp.grad_scale, hp.muon)
                buf, update = buf.to(momentum.dtype), update.to(grad.dtype)
                computed = s.record(s.compute)
            with s.on(s.d2h):
                s.wait(s.d2h, computed)
                momentum[part].copy_(buf, non_blocking=True)
                grad[part].copy_(update, non_blocking=True)
                in_flight.append(s.record(s.d2h))
            if s.cuda:  # made on one stream, read on another: reused once that one has read them
                g.record_stream(s.compute)
                m.record_stream(s.compute)
                buf.record_stream(s.d2h)
                update.record_stream(s.d2h)
        return in_flight[-1]  # the copy-out stream runs in order: the last copy's event is the block's
