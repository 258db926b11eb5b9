"""The executor's only contact with the stores (LayerSource), and the in-process source.

A source hands the executor host tensors (`weights`, `grad_buffer`) and turns a finished gradient
into that layer's optimizer step (`update`); the layer order of a step (`begin_step`) and the events
of its copies let a remote source fetch ahead and send gradients off early. In one process (tests, LocalTrainer) the stores are
plain objects stepped on a background thread; host/remote_sources.py reaches stores in Ray actors.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import torch

from megatrain_ray.host.adamw import AdamWStep


@dataclass
class HostLayerState:
    """A store's buffers of one layer, reachable from this process (shared memory or in process): what
    a source hands a worker that steps the layer itself (streaming/device_step.py)."""

    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    compute: torch.Tensor
    segments: list[tuple[int, int, bool]]  # (start, end, decays) per parameter, as the store steps them
    updates: int  # AdamW updates applied: the bias correction's count
    held: torch.Tensor  # the store's marker of the update count these buffers hold (ShardStore.held_marker)


class LayerSource(Protocol):
    """The three hints (`begin_step`, `weights_copied`, `gradient_ready`) let a source that
    fetches from afar work ahead of the executor; sources in reach of the stores' memory inherit
    them as no-ops."""

    def begin_step(self, order: list[int]) -> None:
        """The layers this step will ask `weights` for, in order of use: forward, the head, backward.
        The executor serves some uses from its device slots and skips them; the order holds."""

    def weights(self, layer: int) -> torch.Tensor:
        """The layer's current compute weights, a host tensor (or a device tensor, where the layer's
        step ran on the device: streaming/device_step.py); waits for a pending update."""

    def weights_copied(self, layer: int, copied) -> None:
        """The device copy out of `weights(layer)` is queued; the tensor may be reused once the event
        `copied` has completed."""

    def grad_buffer(self, layer: int) -> torch.Tensor:
        """Host tensor the layer's gradient is copied into."""

    def gradient_ready(self, layer: int, landed) -> None:
        """The layer's gradient is on its way into `grad_buffer(layer)`; complete once the event
        `landed` has. It will not change this step: a source may send it on from here."""

    def steps_on_device(self, layer: int) -> bool:
        """Whether the layer's optimizer step runs on the executor's device (streaming/device_step.py): its
        gradient then stays there (`take_gradient`) instead of being copied into `grad_buffer`."""
        return False

    def serves_from_device(self, layer: int) -> bool:
        """Whether `weights(layer)` hands the device's own copy (a step on the device left it there,
        streaming/device_step.py): no host bytes move, on the CPU path either."""
        return False

    def take_gradient(self, layer: int, grad: torch.Tensor) -> None:
        """The layer's finished fp32 gradient, on the device, for a step that runs there."""
        raise NotImplementedError("this source steps every layer on the host")

    def update(self, layer: int, hp: AdamWStep | None, gradient_landed) -> None:
        """Start the layer's optimizer step once `gradient_landed` (an event) has completed;
        hp None skips the update and only restores the weights (a non-finite step)."""

    def shared_state(self, layer: int, segments: list[tuple[int, int, bool]]) -> HostLayerState:
        """The layer's master and moments as this process reaches them, for its step on the worker's
        device (where the store's memory is in reach: in process, or shared memory on this node)."""
        raise NotImplementedError("this source does not reach the stores' memory")

    def momentum(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A Muon block's momentum buffer as this process reaches it, and the layer's marker
        (host/store.py, held_marker), for its momentum update and orthogonalization on the worker's
        device (streaming/muon_step.py)."""
        raise NotImplementedError("this source does not reach the stores' memory")

    def report_updates(self, layer: int, count: int) -> None:
        """Tell the layer's store how many updates a step on the device applied (its checkpoint saves them)."""
        raise NotImplementedError("this source does not reach the stores' memory")

    def drain(self) -> None:
        """Wait until every update issued has landed."""

    def close(self) -> None: ...


class LocalSource(LayerSource):
    """Stores in this process; their optimizer steps run on one background thread, in order."""

    def __init__(self, stores: list):
        self.owner = {layer: store for store in stores for layer in store.layers}
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="optimizer")
        self.pending: dict[int, Future] = {}

    def weights(self, layer: int) -> torch.Tensor:
        future = self.pending.pop(layer, None)
        if future is not None:
            future.result()
        return self.owner[layer].layers[layer].compute

    def grad_buffer(self, layer: int) -> torch.Tensor:
        return self.owner[layer].layers[layer].grad  # see host/store.py: the compute buffer, or its own

    def shared_state(self, layer: int, segments: list[tuple[int, int, bool]]) -> HostLayerState:
        store = self.owner[layer]
        state, held = store.layers[layer], store.held_marker(layer)
        return HostLayerState(state.master, state.exp_avg, state.exp_avg_sq, state.compute, segments, state.updates,
                              held)

    def momentum(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        store = self.owner[layer]
        return store.layers[layer].exp_avg, store.held_marker(layer)

    def report_updates(self, layer: int, count: int) -> None:
        self.owner[layer].set_update_count(layer, count)

    def update(self, layer: int, hp: AdamWStep | None, gradient_landed) -> None:
        self.pending[layer] = self.pool.submit(self._step, layer, hp, gradient_landed)

    def _step(self, layer: int, hp: AdamWStep | None, gradient_landed) -> None:
        gradient_landed.synchronize()
        self.owner[layer].step_layer(layer, hp)

    def drain(self) -> None:
        for layer in list(self.pending):
            self.pending.pop(layer).result()

    def close(self) -> None:
        self.drain()
        self.pool.shutdown()


class FrozenSource(LayerSource):
    """Fixed weights in this process's memory, one flat compute-dtype buffer per layer: a reference
    policy's (rl/README.md), streamed through the executor's slots for a forward only. Nothing is
    ever written or updated."""

    def __init__(self, buffers: list[torch.Tensor]):
        self.buffers = buffers

    def weights(self, layer: int) -> torch.Tensor:
        return self.buffers[layer]

    def grad_buffer(self, layer: int) -> torch.Tensor:
        raise RuntimeError("a frozen source takes no gradient")

    def update(self, layer: int, hp: AdamWStep | None, gradient_landed) -> None:
        raise RuntimeError("a frozen source is never updated")
