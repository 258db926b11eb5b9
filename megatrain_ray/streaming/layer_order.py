"""A step's layer order: which layers each streamed unit binds, and the order a step visits them
(forward, the head, backward). Shared by the executor, the layer sources that fetch ahead of it
and the planner's traffic model, none of which needs torch for it."""

from __future__ import annotations

from dataclasses import dataclass

from megatrain_ray.models.arch import ModelArch
from megatrain_ray.models.layout import BLOCK, HEAD
from megatrain_ray.models.registry import model_layouts


@dataclass(frozen=True)
class Unit:
    """One streamed unit of a step: a kind and the layers whose weights it binds."""

    kind: str
    layers: tuple[int, ...]


def model_units(arch: ModelArch) -> list[Unit]:
    """Embedding, blocks, head; a head tied to the embedding binds the embedding's layer too, and a
    block that runs a block several layers share (LayerLayout.shares) binds the layer that holds it.
    That layer is always an earlier one, whose own backward comes last: its gradient, summed over
    every unit that binds it, leaves once, after that backward, as the tied embedding's does."""
    layouts = model_layouts(arch)
    units = [Unit(layouts[0].kind, (0,))]
    for layout in layouts:
        if layout.kind == BLOCK:
            assert all(0 < held < layout.index for held in layout.shares), "a shared block lies in an earlier layer"
            units.append(Unit(BLOCK, (layout.index, *layout.shares)))
    head = layouts[-1].index
    units.append(Unit(HEAD, (head, 0) if arch.tie_word_embeddings else (head,)))
    return units


def kept_blocks(units: list[Unit], kept: int) -> list[Unit]:
    """The last `kept` blocks: they keep their forward's autograd graph for backward."""
    blocks = [u for u in units if u.kind == BLOCK]
    return blocks[len(blocks) - min(kept, len(blocks)):]


def step_order(units: list[Unit], kept: int = 0) -> list[Unit]:
    """Units that read weights, in execution order: forward, the head (its forward and backward at
    once), backward, which skips the kept blocks: their graphs hold their weights."""
    skipped = kept_blocks(units, kept)
    return units + [u for u in reversed(units[:-1]) if u not in skipped]


def layer_order(arch: ModelArch, kept: int = 0) -> list[int]:
    """The order in which a step whose last `kept` blocks keep their graphs reads layers' weights
    (the traffic model's)."""
    return [layer for unit in step_order(model_units(arch), kept) for layer in unit.layers]
