"""A step's schedule: which layers each streamed unit binds, and the order a step visits them
(forward, the head, backward). Shared by the executor, the layer sources that fetch ahead of it
and the planner's traffic model, none of which needs torch for it."""

from __future__ import annotations

from dataclasses import dataclass

from megatrain_ray.models.arch import ModelArch
from megatrain_ray.models.layout import BLOCK, HEAD
from megatrain_ray.models.registry import model_layouts


@dataclass(frozen=True)
class Unit:
    """One streamed step of the schedule: a kind and the layers whose weights it binds."""

    kind: str
    layers: tuple[int, ...]


def model_units(arch: ModelArch) -> list[Unit]:
    """Embedding, blocks, head; a head tied to the embedding binds the embedding's layer too."""
    layouts = model_layouts(arch)
    units = [Unit(layouts[0].kind, (0,))]
    units += [Unit(BLOCK, (l.index,)) for l in layouts if l.kind == BLOCK]
    head = layouts[-1].index
    units.append(Unit(HEAD, (head, 0) if arch.tie_word_embeddings else (head,)))
    return units


def step_order(units: list[Unit]) -> list[Unit]:
    """Units in execution order: forward, the head (its forward and backward at once), backward."""
    return units + list(reversed(units[:-1]))


def layer_schedule(arch: ModelArch) -> list[int]:
    """The order in which a step reads layers' weights (what a LayerSource's begin_step is told)."""
    return [layer for unit in step_order(model_units(arch)) for layer in unit.layers]
