"""The embedding's optimizer step on the GPU: the step's largest layer taken off the host.

A step's last gradient is the embedding's (its lookup is differentiated last, and a tied head adds
to it first), and the next step's first read is the embedding again. Here the table's fp32 state
(master and both moments) crosses PCIe during the last blocks' backward, when the link is nearly
idle and the kept graphs are gone; the update runs on the GPU from the fp32 gradient rounded as
the host would see it; the new weights stay on the device for the next step, and the state goes
back to the store's buffers while the next forward runs. The arithmetic is host/adamw.py's adamw_update
(torch's fused AdamW), so the layer trains as on the host, up to a last bit of rounding.

It pays where the host optimizer is the wall: the embedding is the step's largest layer and its
update the last the next step waits for, so taking it off the host shortens that wait; where
compute bounds the step, the host's update was hidden already and nothing changes
(examples/benchmarks/ holds the measurements).

With several data-parallel workers the layer's owner (streaming/data_parallel.py), which alone
receives its summed gradient, steps it as one worker does and alone moves its state; at the step's
end it broadcasts the new weights in the compute dtype over the workers' process group (2 bytes a
parameter to each other worker, over the GPUs' link), and the others keep them on their devices
for the next step: no worker waits for the host's update of the embedding, and there is still one
copy of its state, the store's.

Beside that state the store keeps a marker (host/store.py, held_marker): the update count the
state in its memory holds, IN_FLUX while the copy back writes it. A worker that dies between
steps leaves the marker at the last finished step's count, and the checkpoint written from the
stores alone (runtime/session.py, save_from_stores) takes the embedding as the store holds it.

It wraps the source that reaches the stores; every other layer passes through untouched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from megatrain_ray.host.adamw import CHUNK_ELEMENTS, AdamWStep, adamw_update
from megatrain_ray.host.sources import HostLayerState, LayerSource
from megatrain_ray.host.store import IN_FLUX
from megatrain_ray.streaming.data_parallel import Group
from megatrain_ray.streaming.streams import Streams

# Start copying the state in when the backward has this many layers left: each is tens of
# milliseconds of compute at any useful size, and the copy (3.7 GB for Qwen2.5-3B's table) takes
# about 70 ms at the H100 machine's 54 GB/s.
UPLOAD_LAYERS_AHEAD = 4


def round_through(grad: torch.Tensor, dtype: torch.dtype) -> None:
    """Round the fp32 gradient to `dtype` and back, in place, a chunk at a time: the values the
    host's step reads from the compute-dtype copy, without a second buffer of the whole layer."""
    if dtype == torch.float32:
        return
    for chunk in grad.split(CHUNK_ELEMENTS):
        chunk.copy_(chunk.to(dtype))


@dataclass
class InFlight:
    """One layer's state on the device from its upload until its update."""

    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    uploaded: object  # event
    grad: torch.Tensor | None = None  # the finished fp32 gradient, on the device


class Received:
    """New weights on their way from the layer's owner (a broadcast); `synchronize` waits on the
    host once they have landed, as the owner waits for its own update's event."""

    def __init__(self, handle, streams: Streams):
        self.handle = handle
        self.streams = streams

    def synchronize(self) -> None:
        if self.handle is None:
            return
        s = self.streams
        with s.on(s.compute):
            self.handle.wait()  # on CUDA: the compute stream waits for the broadcast
        s.record(s.compute).synchronize()
        self.handle = None


class DeviceStepSource(LayerSource):
    """`inner` for every layer but those stepped on the devices: those in `states` (this worker
    owns them) step here; those in `shared` (layer: numel) step on their owner's device, whose new
    weights this worker receives over `group` at each step's end.

    `report_updates(layer, count)` tells the store how many updates the layer has had (its
    checkpoint saves the count); it is called in `drain`, before anything reads the store."""

    def __init__(self, inner: LayerSource, states: dict[int, HostLayerState], device: torch.device,
                 dtype: torch.dtype, report_updates: Callable[[int, int], None], group: Group | None = None,
                 shared: dict[int, int] | None = None):
        self.inner = inner
        self.states = states
        self.shared = shared or {}
        self.group = group
        self.streams = Streams(device)
        self.dtype = dtype
        self.report_updates = report_updates
        self.in_flight: dict[int, InFlight] = {}
        self.fresh: dict[int, tuple[torch.Tensor, object]] = {}  # the new weights on the device, and when
        self.copies_back: list = []  # events: the state's copies back to the store
        self.sending: list = []  # handles: the broadcasts of new weights to the other workers
        self.reported = {layer: state.updates for layer, state in states.items()}

    # -- the protocol, passed through for the other layers ----------------------------------------
    def begin_step(self, order: list[int]) -> None:
        self.in_flight.clear()  # an upload a failed step left behind is fetched again
        self.inner.begin_step(order)

    def weights(self, layer: int) -> torch.Tensor:
        if layer in self.fresh:
            tensor, ready = self.fresh[layer]
            ready.synchronize()  # the update itself (milliseconds of GPU work queued at the turn), or its broadcast
            return tensor
        return self.inner.weights(layer)

    def serves_from_device(self, layer: int) -> bool:
        return layer in self.fresh

    def weights_copied(self, layer: int, copied) -> None:
        if layer not in self.fresh:
            self.inner.weights_copied(layer, copied)

    def grad_buffer(self, layer: int) -> torch.Tensor:
        return self.inner.grad_buffer(layer)

    def gradient_ready(self, layer: int, landed) -> None:
        self.inner.gradient_ready(layer, landed)
        if self.states and layer <= max(self.states) + UPLOAD_LAYERS_AHEAD:
            for own in self.states:
                self._upload(own)

    def steps_on_device(self, layer: int) -> bool:
        """Stepped on a device: here, or on its owner's (this worker then receives its weights in `update`)."""
        return layer in self.states or layer in self.shared

    def take_gradient(self, layer: int, grad: torch.Tensor) -> None:
        self._upload(layer)
        self.in_flight[layer].grad = grad

    def update(self, layer: int, hp: AdamWStep | None, gradient_landed) -> None:
        """The layer's step: on the host, here, or (`shared`) on its owner's device, this worker
        receiving the new weights; every worker calls it for a layer stepped on a device."""
        if layer in self.shared:
            self._receive(layer)
            return
        if layer not in self.states:
            self.inner.update(layer, hp, gradient_landed)
            return
        state, flight = self.states[layer], self.in_flight.pop(layer)
        s = self.streams
        s.wait(s.compute, flight.uploaded)
        if hp is None:  # a non-finite step: the weights as they were
            weights = flight.master.to(self.dtype)
        else:
            state.updates += 1
            weights = torch.empty_like(flight.master, dtype=self.dtype)
            round_through(flight.grad, self.dtype)
            adamw_update(flight.master, flight.grad, flight.exp_avg, flight.exp_avg_sq, state.segments, hp,
                         state.updates, compute_copy=weights)
        flight.grad = None
        updated = s.record(s.compute)
        self.fresh[layer] = (weights, updated)
        self._send(layer, weights)
        self._copy_back(state, flight, weights, updated, changed=hp is not None)

    def expect(self, refs: dict) -> None:
        self.inner.expect(refs)

    def updates_in_flight(self, layers) -> dict:
        return self.inner.updates_in_flight(layers)

    def drain(self) -> None:
        self._settle()
        self._sent()
        for _, ready in self.fresh.values():
            ready.synchronize()
        for layer, state in self.states.items():
            if self.reported[layer] != state.updates:
                self.report_updates(layer, state.updates)
                self.reported[layer] = state.updates
        self.inner.drain()

    def close(self) -> None:
        self.drain()
        self.fresh.clear()
        self.inner.close()

    # -- the state's trip ---------------------------------------------------------------------------
    def _upload(self, layer: int) -> None:
        """Copy the layer's fp32 state in, once per step, after its last trip back has landed."""
        if layer in self.in_flight:
            return
        self._settle()
        state, s = self.states[layer], self.streams
        with s.on(s.h2d):  # memory of the copy stream's own: the compute's may still be read by queued work
            on_device = [torch.empty_like(t, device=s.device) for t in (state.master, state.exp_avg, state.exp_avg_sq)]
            for dst, src in zip(on_device, (state.master, state.exp_avg, state.exp_avg_sq)):
                dst.copy_(src, non_blocking=True)
            uploaded = s.record(s.h2d)
        if s.cuda:
            for t in on_device:
                t.record_stream(s.compute)  # the update reads them there
        self.in_flight[layer] = InFlight(*on_device, uploaded)

    def _copy_back(self, state: HostLayerState, flight: InFlight, weights: torch.Tensor, updated, changed: bool):
        """The new weights into the store's compute buffer (what the host reads as this layer's
        weights), and the changed state into its master and moments, on the copy-out stream. The
        store's marker (`held`) says IN_FLUX from before the first byte of the state is written
        until the copies have landed, then the count they hold: its own copy, queued after them."""
        s = self.streams
        pairs = [(state.compute, weights)]
        if changed:
            state.held.fill_(IN_FLUX)  # the last copies back have landed (`_upload` settled them): nothing races it
            pairs += [(state.master, flight.master), (state.exp_avg, flight.exp_avg),
                      (state.exp_avg_sq, flight.exp_avg_sq)]
        with s.on(s.d2h):
            s.wait(s.d2h, updated)
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
                if s.cuda:
                    src.record_stream(s.d2h)  # freed now, reused only once the copy has read it
            if changed:  # made on this stream, in its order: written once the state has landed
                state.held.copy_(torch.full((1,), state.updates, dtype=torch.int64, device=s.device), non_blocking=True)
            landed = s.record(s.d2h)
        self.copies_back.append(landed)

    def _send(self, layer: int, weights: torch.Tensor) -> None:
        """The new weights to the other workers (none alone), queued after the update on the compute stream."""
        if self.group is None:
            return
        self._sent()  # the last step's: long landed
        handle = self.group.broadcast(weights, layer)
        if handle is not None:
            self.sending.append(handle)

    def _sent(self) -> None:
        for handle in self.sending:
            handle.wait()
        self.sending.clear()

    def _receive(self, layer: int) -> None:
        """The owner's new weights of the layer, into a buffer of this device's own (the last
        step's may still be read by the copies queued from it)."""
        s = self.streams
        tensor = torch.empty(self.shared[layer], dtype=self.dtype, device=s.device)
        with s.on(s.compute):
            handle = self.group.broadcast(tensor, layer)
        self.fresh[layer] = (tensor, Received(handle, s))

    def _settle(self) -> None:
        """Wait for the copies back: long landed when the next upload comes."""
        for landed in self.copies_back:
            landed.synchronize()
        self.copies_back.clear()
