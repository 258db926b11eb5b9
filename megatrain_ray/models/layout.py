"""Where each parameter sits inside its layer's flat buffer.

The model is a list of streamed layers: 0 is the embedding, 1..N the decoder blocks, N+1 the final
norm and LM head. Each layer's parameters are one contiguous flat buffer; a ParamSlot says where a
named tensor (Hugging Face naming) lives in it, so host stores, the executor and checkpoints agree.
A family (models/llama.py, ...) says which tensors a layer has; this file only lays them out.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch

from megatrain_ray.models.arch import ModelArch

EMBED, BLOCK, HEAD = "embed", "block", "head"

Shapes = list[tuple[str, tuple[int, ...]]]


@dataclass(frozen=True)
class ParamSlot:
    name: str  # local name inside the layer, e.g. "self_attn.q_proj.weight"
    shape: tuple[int, ...]
    offset: int
    # How checkpoint files store it when not as one tensor under `name`: contiguous pieces with
    # their own (local) names, shapes and offsets in the layer, e.g. the stacked experts of a
    # mixture-of-experts layer stored one tensor per expert. Empty: stored as itself.
    stored_as: tuple["ParamSlot", ...] = ()
    # False: frozen (an image-text model's vision tower unless model.train_vision: registry.model_layouts
    # marks it): the step gives it no gradient and AdamW no weight decay, so it stays as it is
    trained: bool = True
    # False: no gradient ever reaches it in transformers' training forward: a persistent buffer
    # (MiniMax's decay factors, a router's score bias), which checkpoints hold and which streams with
    # its layer, or a parameter whose output is never differentiated (DeepSeek-V3.2's indexer
    # weights: its scores only pick positions). No weight decay either: AdamW, given zero, leaves it
    # as it is, as torch.optim.AdamW skips a tensor that has no gradient
    gets_gradient: bool = True

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def decays(self) -> bool:
        """Weight decay applies to matrices only, never to norms and biases (stacked per-expert
        biases are 2-D and still biases), and never to a tensor that gets no gradient."""
        return self.trained and self.gets_gradient and len(self.shape) >= 2 and not self.name.endswith("bias")

    def stored(self) -> tuple["ParamSlot", ...]:
        """The tensors a checkpoint holds for this parameter."""
        return self.stored_as or (self,)


@dataclass(frozen=True)
class LayerLayout:
    index: int
    kind: str
    prefix: str  # Hugging Face prefix of the local names
    params: tuple[ParamSlot, ...]
    # The prefix under which checkpoint files name its tensors (ParamSlot.stored), where not
    # `prefix`: transformers stores Nemotron-H's decoder, `model.` in memory, as `backbone.`
    stored_prefix: str | None = None
    # The earlier layers whose tensors this block runs with beside its own: a block that several
    # layers share (Zamba2's shared transformer) lies in the first of them, as transformers stores
    # it, and the later ones run it under the same names (with_shared)
    shares: tuple[int, ...] = ()

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def trained_numel(self) -> int:
        """Elements of the trained parameters where the frozen ones (ParamSlot.trained) all lie after
        them: the optimizer's moments cover these only (an image-text model's frozen vision tower
        holds none); else every element."""
        frozen = [p.offset for p in self.params if not p.trained]
        if not frozen or any(p.trained and p.offset > min(frozen) for p in self.params):
            return self.numel
        return min(frozen)

    @property
    def frozen_names(self) -> frozenset[str]:
        """The local names of its frozen parameters (ParamSlot.trained): the executor detaches them."""
        return frozenset(p.name for p in self.params if not p.trained)

    def hf_name(self, local: str) -> str:
        return self.prefix + local

    def stored_name(self, local: str) -> str:
        """The name checkpoint files give a stored tensor (one of stored_params)."""
        return (self.prefix if self.stored_prefix is None else self.stored_prefix) + local

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Bind a flat buffer to named tensors: views, never copies."""
        return {p.name: flat[p.offset : p.offset + p.numel].view(p.shape) for p in self.params}

    def stored_params(self) -> list[ParamSlot]:
        """The tensors of this layer as checkpoint files name them (see ParamSlot.stored_as)."""
        return [s for p in self.params for s in p.stored()]

    def stored_views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Hugging Face name -> view of a flat buffer, one per tensor a checkpoint file holds."""
        return {self.stored_name(s.name): flat[s.offset : s.offset + s.numel].view(s.shape) for s in self.stored_params()}

    def segments(self) -> list[tuple[int, int, bool]]:
        """(start, end, decays) of each parameter, for the optimizer's weight decay."""
        return [(p.offset, p.offset + p.numel, p.decays) for p in self.params]


def marked_slots(layout: LayerLayout, names: frozenset[str], **fields) -> LayerLayout:
    """The layout with the named tensors' slots given `fields` (ParamSlot's: trained, gets_gradient)."""
    if not names & {s.name for s in layout.params}:
        return layout
    params = tuple(dataclasses.replace(s, **fields) if s.name in names else s for s in layout.params)
    return dataclasses.replace(layout, params=params)


def frozen_slots(layout: LayerLayout, names: frozenset[str]) -> LayerLayout:
    """The layout with the named tensors marked untrained (ParamSlot.trained): an image-text model's
    vision tower, at the embedding layer's end whether it trains or not (the same offsets either
    way), then holds no optimizer state (LayerLayout.trained_numel)."""
    return marked_slots(layout, names, trained=False)


def detached(w: dict[str, torch.Tensor], names: frozenset[str]) -> dict[str, torch.Tensor]:
    """The weights with the named ones detached: no gradient reaches them (a frozen parameter, a
    persistent buffer), and AdamW, given zero, leaves them as they are."""
    return {k: (v.detach() if k in names else v) for k, v in w.items()} if names else w


def shared_part(own: dict[str, torch.Tensor], held: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Of the weights of a layer that a block shares tensors with (LayerLayout.shares), those the
    block runs with: the ones its own layout lacks."""
    return {name: t for name, t in held.items() if name not in own}


def with_shared(own: dict[str, torch.Tensor], holders: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A block's weights: its own, and the shared part of each layer it shares tensors with."""
    merged = dict(own)
    for held in holders:
        merged.update(shared_part(own, held))
    return merged


def lay_out(index: int, kind: str, prefix: str, shapes: Shapes) -> LayerLayout:
    """Parameters back to back in the given order."""
    params, offset = [], 0
    for name, shape in shapes:
        slot = ParamSlot(name, tuple(shape), offset)
        params.append(slot)
        offset += slot.numel
    return LayerLayout(index, kind, prefix, tuple(params))


def decoder_layouts(arch: ModelArch, block_shapes: Callable[[int], Shapes],
                    stored: Callable[[ParamSlot], ParamSlot] = lambda s: s) -> tuple[LayerLayout, ...]:
    """The Hugging Face decoder layout every family here shares: the embedding, one block per
    decoder layer (its shapes by layer index from 0), the final norm and an LM head unless it is
    tied to the embedding. `stored` rewrites a block's slots (how checkpoints store them)."""
    n = arch.num_layers
    layouts = [lay_out(0, EMBED, "model.", [("embed_tokens.weight", (arch.vocab_size, arch.hidden_size))])]
    for i in range(n):
        block = lay_out(i + 1, BLOCK, f"model.layers.{i}.", block_shapes(i))
        layouts.append(dataclasses.replace(block, params=tuple(stored(p) for p in block.params)))
    head: Shapes = [("model.norm.weight", (arch.hidden_size,))]
    if not arch.tie_word_embeddings:
        head.append(("lm_head.weight", (arch.vocab_size, arch.hidden_size)))
    layouts.append(lay_out(n + 1, HEAD, "", head))
    return tuple(layouts)


def matmul_params(arch: ModelArch, layouts: tuple[LayerLayout, ...]) -> int:
    """Parameters that take part in a matmul per token: all but an untied input embedding, which
    is a lookup (a tied one is the LM head's matrix too)."""
    total = sum(layout.numel for layout in layouts)
    return total - (0 if arch.tie_word_embeddings else arch.vocab_size * arch.hidden_size)


def module_key(name: str) -> str:
    """A parameter's layout name as an nn.Module attribute (which cannot hold dots)."""
    return name.replace(".", "__")
