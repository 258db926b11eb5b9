"""The GPU node's window of pinned host slots for the layers that live on other nodes.

A mirror of every remote layer would cost the GPU node 2 bytes per remote parameter, growing with
the model. The window holds `slots` layers per layer size instead, chosen Belady-style on the
step's layer order (the slot whose layer is needed furthest ahead, or never again, is refilled
first): each layer arrives ahead of its forward use and, unless it is still in the window at the
turn into backward, again ahead of its backward use. Gradients leave through an outbox of
OUTBOX_SLOTS per size. Pure arithmetic, shared by the source that fills the window
(host/remote_sources.py) and the plan that counts its bytes and its traffic.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Iterable

OUTBOX_SLOTS = 2  # gradients in flight per layer size: one being sent while the next lands


def pool_sizes(numels: Iterable[int], slots: int) -> dict[int, int]:
    """Slots per layer size: `slots`, or fewer where fewer layers have that size."""
    return {numel: min(slots, count) for numel, count in Counter(numels).items()}


def window_bytes(numels: list[int], slots: int, element_size: int) -> int:
    """Pinned bytes of the window and the outbox for layers of these sizes: bounded by the number
    of distinct layer sizes, not by the number of layers."""
    held = pool_sizes(numels, slots) if numels else {}
    outbox = pool_sizes(numels, OUTBOX_SLOTS) if numels else {}
    return element_size * sum(numel * (held[numel] + outbox[numel]) for numel in held)


class WindowPolicy:
    """Which layer each slot holds and what to fetch next, walking the step's layer order.

    `use(layer)` moves the cursor to that layer's next use (the executor asks for layers in
    that order, skipping uses it serves from its own device slots); the layer in use keeps its
    slot until the next `use`. `plan()` then returns the fetches to start: every layer of the
    order ahead, in order, for which a slot is free of anything needed sooner.
    """

    def __init__(self, numel_of: dict[int, int], slots: int):
        self.numel_of = dict(numel_of)
        self.pools = {numel: [None] * k for numel, k in pool_sizes(self.numel_of.values(), slots).items()}
        self.order: list[int] = []
        self.current = -1  # the position in use; the ones before it are done
        self.planned = 0  # uses before it are resident or being fetched
        self.where: dict[int, int] = {}  # layer -> slot index in its pool

    def begin_step(self, order: list[int]) -> None:
        """A new step: the weights changed, nothing held is current."""
        self.order = [layer for layer in order if layer in self.numel_of]
        self.current, self.planned = -1, 0
        self.where.clear()
        for pool in self.pools.values():
            pool[:] = [None] * len(pool)

    def use(self, layer: int) -> None:
        start = self.current + 1
        try:
            pos = self.order.index(layer, start)
        except ValueError:  # a use the order did not announce: serve it now
            pos = start
            self.order.insert(pos, layer)
        self.planned = max(self.planned, pos)
        self.current = pos

    def _next_use(self, layer: int) -> float:
        try:
            return self.order.index(layer, max(self.current, 0))
        except ValueError:
            return math.inf

    def _victim(self, numel: int, pos: int) -> int | None:
        best, best_use = None, -1.0
        for index, held in enumerate(self.pools[numel]):
            use = math.inf if held is None else self._next_use(held)
            if use > pos and use > best_use:
                best, best_use = index, use
        return best

    def plan(self) -> list[tuple[int, int]]:
        """(layer, slot index) for each fetch to start now, in the step's order."""
        fetches = []
        while self.planned < len(self.order):
            layer = self.order[self.planned]
            if layer not in self.where:
                numel = self.numel_of[layer]
                index = self._victim(numel, self.planned)
                if index is None:
                    break  # every slot of this size is needed sooner: look no further ahead
                evicted = self.pools[numel][index]
                if evicted is not None:
                    del self.where[evicted]
                self.pools[numel][index] = layer
                self.where[layer] = index
                fetches.append((layer, index))
            self.planned += 1
        return fetches


def fetches_per_step(numel_of: dict[int, int], order: list[int], slots: int) -> Counter:
    """How often each layer crosses the network in one step, by the policy itself: once where the
    window holds it from its forward to its backward use, else twice."""
    policy = WindowPolicy(numel_of, slots)
    policy.begin_step(order)
    fetched = Counter(layer for layer, _ in policy.plan())
    for layer in list(policy.order):
        policy.use(layer)
        fetched.update(layer for layer, _ in policy.plan())
    return fetched
