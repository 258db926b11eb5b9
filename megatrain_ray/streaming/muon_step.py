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

The matrices flow through three stages on three streams of this source's own: matrix k+2's gradient
and momentum upload while matrix k+1 iterates (on a stream of its own, not the compute stream the
executor's layers run on, and at its priority: train_step's end waits for the compute stream, where
the embedding's step on the device runs, streaming/device_step.py, which a higher one would hold back) and matrix k's results come
back (the copies of a Qwen2.5-7B matrix take about as long over PCIe as its iterations, so fewer than
three in flight leave the GPU waiting on a copy every other matrix). They pass through IN_FLIGHT
staging buffers on the device (`Staging`, each the size of the largest matrix), used in turn across
the blocks: the upload into one waits, on the copy-in stream, for the last copy out of it. So the
phase takes at most those buffers and one matrix's iterations of device memory, below what the
backward freed (its activations, kept graphs and gradient accumulator), and the host waits for none
of it: `update` queues a block's trip and returns, and train_step returns once the last block is
queued, so the next step's forward starts while the last blocks still iterate.

A block's message to its store leaves from a thread of this source's own (`_send`) once the block's
results have landed, so the store applies block i while the device iterates block i+1; the next read
of the block's weights (`weights`: the next step's forward, a validation) waits for that message to
have left, and then, as any read, for the store to have applied it. Everything that reads the
stores (`drain`, `updates_in_flight`) waits for every message first. Nothing else waits: the clip
factor is a number the step already has, and the host's buffers are page-locked
(host/remote_sources.py), so every copy is asynchronous. The store's marker of the layer (host/store.py, held_marker) reads IN_FLUX
from before the momentum is written until the store has applied that step: a checkpoint written from
the stores alone after a worker died in between refuses that state (runtime/session.py).

The step plan names the blocks (planning/step_plan.py, `StepPlan.muon_on_device`): on a GPU, the
Muon blocks whose store is on the worker's node (their momentum in shared memory); a worker wraps
those it owns. On the CPU, or for a block on another node, the store does it all itself.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
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
class Staging:
    """A device buffer pair a matrix's gradient and momentum go up into, and its update and new
    momentum come back from (the results over the inputs, in the host's dtypes)."""

    grad: torch.Tensor
    momentum: torch.Tensor
    free: object = None  # event: the last copy out of them has finished


class MuonStepSource:
    """`inner` for everything but the update of the blocks in `momenta` (layer: its momentum and
    marker as this process reaches them), whose momentum update and orthogonalization run on `device`."""

    def __init__(self, inner: LayerSource, momenta: dict[int, tuple[torch.Tensor, torch.Tensor]],
                 layouts: tuple[LayerLayout, ...], device: torch.device):
        self.inner = inner
        self.momenta = momenta
        self.layouts = layouts
        self.streams = Streams(device)
        self.iterating = self.streams.side()  # the iterations' stream, beside the executor's
        self.largest = max((slot.numel for layer in momenta for slot in muon_slots(layouts[layer], "muon")), default=0)
        self.staging: list[Staging] = []  # IN_FLIGHT of them during a step's update phase
        self.turn = 0  # the staging buffer the next matrix takes
        self.sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="muon-send")
        self.sending: dict[int, Future] = {}  # layer: its store's message, leaving once its results have landed
        self.orthogonalized = 0  # blocks queued here (what a test checks ran)

    def __getattr__(self, name: str):
        """Every other call of the source protocol (host/sources.py) goes to `inner` unchanged."""
        return getattr(self.inner, name)

    def weights(self, layer: int) -> torch.Tensor:
        self._sent(layer)
        return self.inner.weights(layer)

    def update(self, layer: int, hp: AdamWStep | None, gradient_landed) -> None:
        """The block's momentum update and orthogonalization queued here, its application on the host
        once they have landed; any other update (or a skipped step's) straight to `inner`."""
        if layer not in self.momenta or hp is None or hp.muon is None:
            self._sent(layer)
            self.inner.update(layer, hp, gradient_landed)
            return
        landed = self._orthogonalize(layer, hp, gradient_landed)
        self.sending[layer] = self.sender.submit(self._send, layer, host_orthogonalized(hp), landed)
        self.orthogonalized += 1
        if layer == max(self.momenta):  # the phase's last: its buffers go back once the copies have read them
            self._release_staging()

    def updates_in_flight(self, layers) -> dict:
        self._all_sent()
        return self.inner.updates_in_flight(layers)

    def drain(self) -> None:
        self._all_sent()
        self.inner.drain()

    def close(self) -> None:
        self._all_sent()
        self.sender.shutdown()
        self.inner.close()

    def _send(self, layer: int, hp: AdamWStep, landed) -> None:
        """On the sender's thread: the block's message to its store, once its momentum and update have landed."""
        landed.synchronize()
        self.inner.update(layer, hp, landed)

    def _sent(self, layer: int) -> None:
        """Until the layer's message (if one is on its way) has left: the read after it waits for it."""
        future = self.sending.pop(layer, None)
        if future is not None:
            future.result()

    def _all_sent(self) -> None:
        for layer in list(self.sending):
            self._sent(layer)

    def _staged(self, grad_dtype: torch.dtype, momentum_dtype: torch.dtype) -> Staging:
        """The next staging buffer in turn, made at the phase's first matrix (on the iterating stream,
        whose memory its own later work reuses in order)."""
        if not self.staging:
            s = self.streams
            with s.on(self.iterating):
                self.staging = [Staging(torch.empty(self.largest, dtype=grad_dtype, device=s.device),
                                        torch.empty(self.largest, dtype=momentum_dtype, device=s.device))
                                for _ in range(IN_FLIGHT)]
        staged = self.staging[self.turn % IN_FLIGHT]
        self.turn += 1
        return staged

    def _release_staging(self) -> None:
        """The staging buffers given back to the allocator, reused only after the copies queued on
        them (CUDA: `record_stream`, no wait on the host)."""
        if self.streams.cuda:
            for staged in self.staging:
                for t in (staged.grad, staged.momentum):
                    t.record_stream(self.streams.h2d)
                    t.record_stream(self.streams.d2h)
        self.staging = []

    def _orthogonalize(self, layer: int, hp: AdamWStep, gradient_landed):
        """Queue the block's trip a matrix at a time (a stacked tensor of experts: the tensor): in on
        the copy-in stream into the next staging buffer (once the last copy out of it is done), the
        arithmetic on the iterating stream, out on the copy-out stream; returns the event at which
        the block's results have all landed. The host waits for nothing here."""
        s, it = self.streams, self.iterating
        momentum, held = self.momenta[layer]
        grad = self.inner.grad_buffer(layer)
        held.fill_(IN_FLUX)  # the store's last update of it has landed: the executor read its weights since
        landed = None
        for slot in muon_slots(self.layouts[layer], "muon"):
            staged = self._staged(grad.dtype, momentum.dtype)
            part = slice(slot.offset, slot.offset + slot.numel)
            g, m = staged.grad[:slot.numel], staged.momentum[:slot.numel]
            with s.on(s.h2d):
                s.wait(s.h2d, gradient_landed)
                if staged.free is not None:
                    s.wait(s.h2d, staged.free)  # never overwrite results a queued copy out still reads
                g.copy_(grad[part], non_blocking=True)
                m.copy_(momentum[part], non_blocking=True)
                uploaded = s.record(s.h2d)
            with s.on(it):
                s.wait(it, uploaded)
                buf, update = orthogonalize(g, m, slot.shape, hp.grad_scale, hp.muon)
                m.copy_(buf)  # buf is m itself where the momentum is fp32 (a no-op then)
                g.copy_(update)
                computed = s.record(it)
            with s.on(s.d2h):
                s.wait(s.d2h, computed)
                momentum[part].copy_(m, non_blocking=True)
                grad[part].copy_(g, non_blocking=True)
                landed = staged.free = s.record(s.d2h)
        return landed  # the copy-out stream runs in order: the last copy's event is the block's
