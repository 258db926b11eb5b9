"""How the GPU actor reaches stores in other processes: shared memory on its node, TCP beyond.

Each is a LayerSource (host/sources.py) whose `update` is one small actor call. Same node: the store's
buffers are /dev/shm files mapped here and registered with CUDA once, so copies run at pinned
speed and no step republishes the model. Other nodes: one bounded window of pinned slots
(host/window.py) filled over each store's connections (host/transport.py) ahead of the step's layer order, and an
outbox the gradients leave from as soon as they land.

With several GPU workers only a layer's owner sends its update (`update`); the others learn of it
through `expect`: with the owner's reference to that update (shared memory: the next read waits for
it), or as one more version of the layer to ask its store for (the store serves a version only once
it has applied it). Each worker is told of each update once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import ray
import torch

from megatrain_ray.host.memory import cuda_host_register, cuda_host_unregister, pinned_empty, shm_tensor
from megatrain_ray.host.sources import HostLayerState, LayerSource
from megatrain_ray.host.transport import LayerLink, Transfer
from megatrain_ray.host.window import OUTBOX_SLOTS, WindowPolicy, pool_sizes


@dataclass(frozen=True)
class StoreReach:
    """How a worker reaches one store's layers, as the store tells it once its memory is taken:
    its layers, the shared-memory paths of their compute copies, of gradient buffers of their own
    (a bf16 master's) and of the state a worker steps on its device, and the address of its link
    (a store that serves a GPU worker on another node). The worker needs no call to the store to
    build itself, so it builds while the store fills its layers."""

    layers: tuple[int, ...]
    weights: dict[int, str]
    gradients: dict[int, str]
    states: dict[int, dict[str, str]]
    link: tuple[str, int] | None = None
    momenta: dict[int, dict[str, str]] = field(default_factory=dict)  # Muon momenta a worker updates (ShardStore.shared_momenta)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class SharedMemorySource(LayerSource):
    def __init__(self, store, paths: dict[int, str], numels: dict[int, int], dtype, register: bool,
                 grad_paths: dict[int, str] | None = None, states: dict[int, dict[str, str]] | None = None,
                 updates_done: int = 0, momenta: dict[int, dict[str, str]] | None = None,
                 momentum_dtype: torch.dtype = torch.float32):
        """`grad_paths`: gradient buffers of their own (a bf16 master's, host/store.py), else the
        gradient lands in the weights' buffer. `states`: layers whose master and moments the store
        holds in shared memory already (StoreReach.states), each at `updates_done` updates: their
        `shared_state` asks the store nothing. `momenta`: Muon blocks' momenta in shared memory
        (StoreReach.momenta), of `momentum_dtype`."""
        self.store = store
        self.register = register
        self.states = states or {}
        self.momenta = momenta or {}
        self.momentum_dtype = momentum_dtype
        self.updates_done = updates_done
        self.registered: list[torch.Tensor] = []
        self.w = {layer: self._map(Path(path), numels[layer], dtype) for layer, path in paths.items()}
        self.g = {layer: self._map(Path(path), numels[layer], torch.bfloat16)
                  for layer, path in (grad_paths or {}).items()}
        self.pending: dict[int, ray.ObjectRef] = {}

    def _map(self, path: Path, numel: int, dtype) -> torch.Tensor:
        t = shm_tensor(path, numel, dtype, create=False)
        if self.register:
            cuda_host_register(t)
            self.registered.append(t)
        return t

    def weights(self, layer: int) -> torch.Tensor:
        ref = self.pending.pop(layer, None)
        if ref is not None:
            ray.get(ref)
        return self.w[layer]

    def shared_state(self, layer: int, segments: list[tuple[int, int, bool]]) -> HostLayerState:
        """The layer's master and moments mapped here too, for its step on this worker's GPU."""
        if layer in self.states:
            paths, updates = dict(self.states[layer]), self.updates_done
        else:
            paths = ray.get(self.store.share_state.remote(layer))
            updates = ray.get(self.store.update_counts.remote())[layer]
        numel = self.w[layer].numel()
        held = self._map(Path(paths.pop("held")), 1, torch.int64)
        state = {key: self._map(Path(path), numel, torch.float32) for key, path in paths.items()}
        return HostLayerState(**state, compute=self.w[layer], segments=segments, updates=updates, held=held)

    def momentum(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A Muon block's momentum (over its trained elements) and marker, mapped here."""
        paths = self.momenta[layer]
        numel = Path(paths["momentum"]).stat().st_size // self.momentum_dtype.itemsize
        return (self._map(Path(paths["momentum"]), numel, self.momentum_dtype),
                self._map(Path(paths["held"]), 1, torch.int64))

    def report_updates(self, layer: int, count: int) -> None:
        ray.get(self.store.set_update_count.remote(layer, count))

    def grad_buffer(self, layer: int) -> torch.Tensor:
        return self.g.get(layer, self.w[layer])  # where the weights were, or its own (see host/store.py)

    def update(self, layer: int, hp, gradient_landed) -> None:
        gradient_landed.synchronize()
        self.pending[layer] = self.store.step_layer.remote(layer, hp)

    def expect(self, layer: int, ref: ray.ObjectRef) -> None:
        """Another worker sent this layer's update: the next read waits for it."""
        self.pending[layer] = ref

    def drain(self) -> None:
        ray.get(list(self.pending.values()))
        self.pending.clear()

    def close(self) -> None:
        for t in self.registered:
            cuda_host_unregister(t)
        self.registered.clear()


@dataclass
class HostSlot:
    buffer: torch.Tensor
    transfer: Transfer | None = None  # the last transfer into or out of the buffer
    copied: object = None  # event: the device copy out of the buffer is done


def _before_reuse(slot: HostSlot) -> list:
    """What must finish before a slot is overwritten: its last transfer, the device copy out of it."""
    after = []
    if slot.transfer is not None:
        after.append(slot.transfer.wait)
    if slot.copied is not None:
        after.append(slot.copied.synchronize)
    return after


class WindowSource(LayerSource):
    """Every layer that lives on another node, through one bounded window of pinned slots.

    One per GPU worker whatever the number of stores: its bytes depend on the layer sizes and
    `slots` (host/window.py), not on the model's depth. Layers arrive over each store's LayerLink ahead
    of their use, as the step's layer order says; a gradient leaves from the outbox as soon as it has
    landed there; an update is one small actor call, and the store serves the layer's next
    version only once it has applied it.
    """

    def __init__(self, stores: dict[int, object], links: dict[int, LayerLink], numels: dict[int, int], dtype,
                 slots: int):
        self.store_of = stores
        self.link_of = links
        self.numels = numels
        self.policy = WindowPolicy(numels, slots)
        self.slots = {n: [HostSlot(pinned_empty(n, dtype)) for _ in pool] for n, pool in self.policy.pools.items()}
        self.outbox = {n: [HostSlot(pinned_empty(n, dtype)) for _ in range(k)]
                       for n, k in pool_sizes(numels.values(), OUTBOX_SLOTS).items()}
        self.turns = dict.fromkeys(self.outbox, 0)
        self.outgoing: dict[int, HostSlot] = {}
        self.versions = dict.fromkeys(numels, 0)  # updates issued per layer: the version to ask for
        self.pending: dict[int, ray.ObjectRef] = {}
        self.bytes_in = self.bytes_out = 0

    def _slot(self, layer: int) -> HostSlot:
        return self.slots[self.numels[layer]][self.policy.where[layer]]

    def _start_fetches(self) -> None:
        for layer, index in self.policy.plan():
            slot = self.slots[self.numels[layer]][index]
            after = _before_reuse(slot)
            slot.transfer = self.link_of[layer].fetch(layer, self.versions[layer], slot.buffer, after)
            slot.copied = None
            self.bytes_in += nbytes(slot.buffer)

    def begin_step(self, order: list[int]) -> None:
        self.policy.begin_step(order)
        self._start_fetches()

    def weights(self, layer: int) -> torch.Tensor:
        self.policy.use(layer)
        self._start_fetches()
        slot = self._slot(layer)
        slot.transfer.wait()
        return slot.buffer

    def weights_copied(self, layer: int, copied) -> None:
        self._slot(layer).copied = copied

    def grad_buffer(self, layer: int) -> torch.Tensor:
        numel = self.numels[layer]
        pool = self.outbox[numel]
        slot = pool[self.turns[numel] % len(pool)]
        self.turns[numel] += 1
        if slot.transfer is not None:
            slot.transfer.wait()
        self.outgoing[layer] = slot
        return slot.buffer

    def gradient_ready(self, layer: int, landed) -> None:
        slot = self.outgoing.pop(layer)
        slot.transfer = self.link_of[layer].send(layer, slot.buffer, [landed.synchronize])
        self.bytes_out += nbytes(slot.buffer)

    def update(self, layer: int, hp, gradient_landed) -> None:
        self.versions[layer] += 1
        self.pending[layer] = self.store_of[layer].step_streamed.remote(layer, hp)

    def expect(self, layer: int, ref: ray.ObjectRef) -> None:
        """Another worker sent this layer's update: ask for the version after it."""
        self.versions[layer] += 1

    def drain(self) -> None:
        for pool in (*self.slots.values(), *self.outbox.values()):
            for slot in pool:
                if slot.transfer is not None:
                    slot.transfer.wait()
        ray.get(list(self.pending.values()))
        self.pending.clear()

    def host_bytes(self) -> int:
        """Pinned bytes this source holds for remote layers: the window and the outbox."""
        return sum(nbytes(slot.buffer) for pool in (*self.slots.values(), *self.outbox.values()) for slot in pool)

    def take_traffic(self) -> tuple[int, int]:
        """Bytes received and sent since the last call."""
        traffic, self.bytes_in, self.bytes_out = (self.bytes_in, self.bytes_out), 0, 0
        return traffic

    def close(self) -> None:
        for link in {id(link): link for link in self.link_of.values()}.values():
            link.close()


class RoutedSource(LayerSource):
    """Each layer goes to the source that reaches the store owning it."""

    def __init__(self, sources: list, layers_of: list[list[int]]):
        self.sources = sources
        self.route = {layer: source for source, layers in zip(sources, layers_of) for layer in layers}

    def begin_step(self, order: list[int]) -> None:
        for source in self.sources:
            source.begin_step(order)

    def weights(self, layer: int) -> torch.Tensor:
        return self.route[layer].weights(layer)

    def weights_copied(self, layer: int, copied) -> None:
        self.route[layer].weights_copied(layer, copied)

    def gradient_ready(self, layer: int, landed) -> None:
        self.route[layer].gradient_ready(layer, landed)

    def grad_buffer(self, layer: int) -> torch.Tensor:
        return self.route[layer].grad_buffer(layer)

    def update(self, layer: int, hp, gradient_landed) -> None:
        self.route[layer].update(layer, hp, gradient_landed)

    def shared_state(self, layer: int, segments: list[tuple[int, int, bool]]) -> HostLayerState:
        return self.route[layer].shared_state(layer, segments)

    def report_updates(self, layer: int, count: int) -> None:
        self.route[layer].report_updates(layer, count)

    def momentum(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.route[layer].momentum(layer)

    def updates_in_flight(self, layers) -> dict[int, ray.ObjectRef]:
        """The references to these layers' last updates sent from here, to share with the other workers."""
        return {layer: self.route[layer].pending[layer] for layer in layers if layer in self.route[layer].pending}

    def expect(self, refs: dict[int, ray.ObjectRef]) -> None:
        for layer, ref in refs.items():
            self.route[layer].expect(layer, ref)

    def drain(self) -> None:
        for source in self.sources:
            source.drain()

    def close(self) -> None:
        for source in self.sources:
            source.close()
