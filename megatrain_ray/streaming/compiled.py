"""What the executor runs compiled on the GPU: the decoder block, twice (for the blocks that
recompute their forward in backward, and for the blocks that keep their forward graph), and one
chunk of the LM head's loss.

A recomputing block's graph is differentiated right after it is made, so torch.compile's default
partition (save what is cheapest to keep) costs nothing beyond the block's working set. A kept
graph lives from the forward to the backward with the other kept ones, so there the partitioner
keeps at most KEPT_ACTIVATION_BUDGET of that (torch._functorch's activation_memory_budget) and
recomputes the cheapest of the rest in backward: pointwise ops such as SwiGLU's product. On the
H100 (one Qwen2.5-3B block, 4 x 4,096 tokens, 2026-11-23, examples/benchmarks/probe_kept_block.py) the
default kept 85.6 KiB a token at 14.1 ms forward + backward; a budget of 0.8 kept 56.1 KiB at
14.4 ms, 0.6 51.0 KiB at 14.9 ms, and 0.4 30.5 KiB at 16.4 ms (a matmul recomputed). Its forward
alone took 4.5 ms, what a recompute costs: 0.8 spares the most recompute per byte kept.

The head's chunk loss compiled fuses the fp32 cast, log-softmax and its gradient over the
[tokens x vocab] logits, which eager runs as separate passes (on the H100 a Qwen2.5-3B step of
65,536 tokens spent 109 ms in the eager softmax kernels alone; compiled, the step took 0.17 s less).

The two compilations of the block use two backends: torch.compile caches a function's graphs per
code object, and a different backend is what keeps the second from reusing the first's. Each
backend is made once: torch.compile counts a new backend object as a reason to recompile, and a
code object recompiled past torch._dynamo's limit runs eager.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

KEPT_ACTIVATION_BUDGET = 0.8


def kept_activation_budget(family) -> float | None:
    """The family's budget for its kept graphs (models/family.py, OptionalMembers), else ours."""
    return getattr(family, "kept_activation_budget", KEPT_ACTIVATION_BUDGET)


def compile_block(block: Callable) -> Callable:
    """The block as the recompute path runs it: torch.compile's defaults."""
    return torch.compile(block, dynamic=False)


def compile_kept_block(block: Callable, budget: float = KEPT_ACTIVATION_BUDGET) -> Callable:
    """The block as a kept graph runs it: its saved tensors within `budget` of the default's."""
    return torch.compile(block, dynamic=False, backend=_inductor_within(budget))


def compile_head_loss(head_loss: Callable) -> Callable:
    """A family's head_loss for one chunk of tokens; called with scale 1 (a Python float would be
    compiled in as a constant), the caller scales."""
    return torch.compile(head_loss, dynamic=False)


@functools.cache  # one backend per budget: torch.compile recompiles for a backend it has not seen
def _inductor_within(budget: float) -> Callable:
    def backend(gm: torch.fx.GraphModule, example_inputs):
        from torch._inductor.compile_fx import compile_fx  # the default backend's own entry

        with torch._functorch.config.patch(activation_memory_budget=budget):  # read as it partitions
            return compile_fx(gm, example_inputs)

    return backend
