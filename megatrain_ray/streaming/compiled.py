"""What the executor runs compiled on the GPU: the decoder block, twice (for the blocks that
recompute their forward in backward, and for the blocks that keep their forward graph), and one
chunk of the LM head's loss.

A recomputing block's graph is differentiated right after it is made, so torch.compile's default
partition (save what is cheapest to keep) costs nothing beyond the block's working set. A kept
graph lives from the forward to the backward with the other kept ones, so there the partitioner
keeps at most the family's kept_activation_budget of that (torch._functorch's
activation_memory_budget) and recomputes the cheapest of the rest in backward: pointwise ops such
as SwiGLU's product, which cost far less than the block's forward a full recompute would repeat
(examples/benchmarks/probe_kept_block.py measures the trade at each budget).

The head's chunk loss compiled fuses the fp32 cast, log-softmax and its gradient over the
[tokens x vocab] logits, which eager runs as separate passes over a tensor of the vocabulary's
width: at long steps those passes are a visible share of the step.

The two compilations of the block use two backends: torch.compile caches a function's graphs per
code object, and a different backend is what keeps the second from reusing the first's. Each
backend is made once: torch.compile counts a new backend object as a reason to recompile.

A code object compiled more often than torch._dynamo's recompile limit (8 by default) runs eagerly
from then on, said only in a log line. The block's code object is compiled once per layer structure
that the family's layers have (ModelFamily.compiled_variants: a model run through transformers'
modules has several templates) for each of GRAPHS_PER_VARIANT ways it is run, so every call of a
compiled block runs under a limit that covers them all (never below the process's own). The graphs
are static: a micro-batch of another shape would need one more per layer structure, so validation
runs the training step's shape too.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

# The block's graphs per layer structure, all cached on its one code object: its forward without
# gradient (a recomputing block's first pass), with gradient (its recompute in backward), the kept
# graph's (another backend), and validation's forward (the family's `evaluating`: transformers'
# modules in eval mode, which dynamo guards on). Every call has the training step's micro-batch
# shape (validation's last micro-batch is filled with padding rows: data/dataset.py), so no other
# shape adds graphs.
GRAPHS_PER_VARIANT = 4


def compiled_blocks(family, arch) -> tuple[Callable, Callable]:
    """The family's block compiled for the recompute path and for kept graphs, each falling back to
    eager per template where compiling fails (per_template), within a limit for all its graphs."""
    variants = family.compiled_variants(arch)
    block = per_template(compile_block(family.block, variants), family)
    budget = family.kept_activation_budget
    kept = per_template(compile_kept_block(family.block, budget, variants), family) if budget is not None else block
    return block, kept


def compile_block(block: Callable, variants: int = 1, backend="inductor") -> Callable:
    """The block as the recompute path runs it: torch.compile's defaults (a test may name another
    `backend`, to run or count dynamo's graphs on the CPU)."""
    return within_limit(torch.compile(block, dynamic=False, backend=backend), variants)


def compile_kept_block(block: Callable, budget: float, variants: int = 1) -> Callable:
    """The block as a kept graph runs it: its saved tensors within `budget` of the default's."""
    return within_limit(torch.compile(block, dynamic=False, backend=_inductor_within(budget)), variants)


def within_limit(compiled: Callable, variants: int) -> Callable:
    """`compiled`, each call under a recompile limit of GRAPHS_PER_VARIANT graphs per variant: dynamo
    reads the limit as it decides whether to compile a call's frame, so it holds for these calls
    and leaves every other compiled function of the process to the process's own limit (the patch
    costs some 16 us a call on a CPU core, against a block's milliseconds)."""
    name = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"  # torch < 2.7
    limit = max(getattr(torch._dynamo.config, name), GRAPHS_PER_VARIANT * variants)

    def call(*args, **kwargs):
        with torch._dynamo.config.patch(**{name: limit}):
            return compiled(*args, **kwargs)

    return call


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


class EagerWhereItFails:
    """A compiled block that runs a layer template eagerly once compiling it failed, and says so
    once: for a family of several templates (models/transformers/, `template_of`), where one layer
    structure that torch.compile cannot take must not stop the others from being compiled."""

    def __init__(self, compiled: Callable, eager: Callable, template_of: Callable):
        self.compiled, self.eager, self.template_of = compiled, eager, template_of
        self.failed: set = set()

    def __call__(self, arch, w, x, ctx, **kw):
        template = self.template_of(arch, ctx)
        if template not in self.failed:
            try:
                return self.compiled(arch, w, x, ctx, **kw)
            except Exception as e:  # torch.compile's failures have no common type
                self.failed.add(template)
                reason = (str(e).strip().splitlines() or [""])[0][:200]
                print(f"torch.compile failed on layer template {template} ({type(e).__name__}: {reason}); "
                      "layers of that structure run eagerly", flush=True)
        return self.eager(arch, w, x, ctx, **kw)


def per_template(compiled: Callable, family) -> Callable:
    """`compiled`, falling back per template for a family that names its layers' templates."""
    template_of = family.template_of  # ModelFamily.template_of: None for a family of one template
    return compiled if template_of is None else EagerWhereItFails(compiled, family.block, template_of)
