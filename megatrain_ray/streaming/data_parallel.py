"""Data parallel over the GPU workers of one node, all fed by the same host stores.

Each worker takes an equal share of a step's micro-batches. A layer's weight gradient is summed
across the workers on the devices (NCCL; gloo on the CPU path) and lands on one worker only, the
layer's owner, which alone copies it to the host and sends the store its update: device-to-host
traffic and optimizer messages are split, not repeated. The loss and the squared gradient norm
(each owner's share) are summed once per step, so clipping stays exact.

A layer's update is one message from its owner; the other workers learn that it landed through
the owner's reference to it, which the driver hands them with the next step's micro-batches. Each
read of a layer then waits for that layer's update only, as on one GPU: no per-layer barrier. A
layer stepped on a device (the embedding, streaming/device_step.py) is stepped by its owner, which
broadcasts the new weights to the others at the step's end: none of them reads it from the host.

The process group is the workers' own: each joins it with the rank, world size and a master
address/port that the session hands it, inside a Ray actor that Ray supervises.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


def layer_owners(numels: list[int], world: int) -> list[int]:
    """The rank that owns each layer's gradient: largest layers first (equal sizes in the order
    backward finishes them, last layer first), each to the rank that owns the fewest bytes so far.
    So the bytes copied out and the update messages split evenly, and the decoder blocks, which
    finish one after another, alternate owners."""
    load = [0] * world
    owners = [0] * len(numels)
    for layer in sorted(reversed(range(len(numels))), key=lambda i: -numels[i]):
        rank = min(range(world), key=lambda r: (load[r], r))
        owners[layer] = rank
        load[rank] += numels[layer]
    return owners


def split_micro_batches(micro_batches: list, world: int) -> list[list]:
    """Contiguous equal shares, rank order: the sum of the shares' gradients is the step's gradient."""
    if len(micro_batches) % world:
        raise ValueError(f"{len(micro_batches)} micro-batches do not split evenly over {world} workers")
    k = len(micro_batches) // world
    return [micro_batches[r * k:(r + 1) * k] for r in range(world)]


def split_unevenly(micro_batches: list, world: int) -> list[list]:
    """Contiguous shares differing by one at most (validation, which sums and needs no equal work)."""
    k, extra = divmod(len(micro_batches), world)
    bounds = [r * k + min(r, extra) for r in range(world + 1)]
    return [micro_batches[bounds[r]:bounds[r + 1]] for r in range(world)]


class Group:
    """This worker's place among the data-parallel workers; a group of one does no communication."""

    def __init__(self, rank: int, world: int, owners: list[int]):
        self.rank = rank
        self.world = world
        self.owners = owners

    @classmethod
    def solo(cls, num_layers: int) -> "Group":
        return cls(0, 1, [0] * num_layers)

    @classmethod
    def join(cls, rank: int, world: int, address: str, port: int, device: torch.device, numels: list[int],
             timeout_s: float) -> "Group":
        """Join the workers' process group (blocks until all `world` have joined)."""
        cuda = device.type == "cuda"
        dist.init_process_group(
            "nccl" if cuda else "gloo", init_method=f"tcp://{address}:{port}", rank=rank, world_size=world,
            timeout=timedelta(seconds=timeout_s), device_id=device if cuda else None,
        )
        return cls(rank, world, layer_owners(numels, world))

    def owns(self, layer: int) -> bool:
        return self.owners[layer] == self.rank

    def reduce(self, tensor: torch.Tensor, layer: int):
        """Sum `tensor` over the workers into the layer owner's copy, asynchronously; None alone.

        The collective waits for the work queued so far on the current stream; the handle's
        wait() makes the stream current then (or, on the CPU, the caller) wait for it."""
        if self.world == 1:
            return None
        return dist.reduce(tensor, dst=self.owners[layer], op=dist.ReduceOp.SUM, async_op=True)

    def broadcast(self, tensor: torch.Tensor, layer: int):
        """The layer owner's `tensor` into every other worker's, asynchronously; None alone. As
        `reduce`: the handle's wait() makes the current stream (on the CPU, the caller) wait."""
        if self.world == 1:
            return None
        return dist.broadcast(tensor, src=self.owners[layer], async_op=True)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum in place over the workers (every rank gets the same bits)."""
        if self.world > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)

    def close(self) -> None:
        if self.world > 1 and dist.is_initialized():
            dist.destroy_process_group()
