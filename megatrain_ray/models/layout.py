"""Where each parameter sits inside its layer's flat buffer.

The model is a list of streamed layers: 0 is the embedding, 1..N the decoder blocks, N+1 the final
norm and LM head. Each layer's parameters are one contiguous flat buffer; a ParamSlot says where a
named tensor (Hugging Face naming) lives in it, so host stores, the executor and checkpoints agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from megatrain_ray.models.arch import ModelArch

EMBED, BLOCK, HEAD = "embed", "block", "head"


@dataclass(frozen=True)
class ParamSlot:
    name: str  # local name inside the layer, e.g. "self_attn.q_proj.weight"
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def decays(self) -> bool:
        """Weight decay applies to matrices only, never to norms and biases."""
        return len(self.shape) >= 2


@dataclass(frozen=True)
class LayerLayout:
    index: int
    kind: str
    prefix: str  # Hugging Face prefix of the local names
    params: tuple[ParamSlot, ...]

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    def hf_name(self, local: str) -> str:
        return self.prefix + local

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Bind a flat buffer to named tensors: views, never copies."""
        return {p.name: flat[p.offset : p.offset + p.numel].view(p.shape) for p in self.params}

    def segments(self) -> list[tuple[int, int, bool]]:
        """(start, end, decays) of each parameter, for the optimizer's weight decay."""
        return [(p.offset, p.offset + p.numel, p.decays) for p in self.params]


def _layout(index: int, kind: str, prefix: str, shapes: list[tuple[str, tuple[int, ...]]]) -> LayerLayout:
    params, offset = [], 0
    for name, shape in shapes:
        slot = ParamSlot(name, shape, offset)
        params.append(slot)
        offset += slot.numel
    return LayerLayout(index, kind, prefix, tuple(params))


def block_shapes(arch: ModelArch) -> list[tuple[str, tuple[int, ...]]]:
    h, hd, i = arch.hidden_size, arch.head_dim, arch.intermediate_size
    q, kv = arch.num_heads * hd, arch.num_kv_heads * hd
    shapes: list[tuple[str, tuple[int, ...]]] = [("input_layernorm.weight", (h,)), ("self_attn.q_proj.weight", (q, h))]
    if arch.qkv_bias:
        shapes.append(("self_attn.q_proj.bias", (q,)))
    shapes.append(("self_attn.k_proj.weight", (kv, h)))
    if arch.qkv_bias:
        shapes.append(("self_attn.k_proj.bias", (kv,)))
    shapes.append(("self_attn.v_proj.weight", (kv, h)))
    if arch.qkv_bias:
        shapes.append(("self_attn.v_proj.bias", (kv,)))
    shapes.append(("self_attn.o_proj.weight", (h, q)))
    if arch.qk_norm:
        shapes += [("self_attn.q_norm.weight", (hd,)), ("self_attn.k_norm.weight", (hd,))]
    shapes += [
        ("post_attention_layernorm.weight", (h,)),
        ("mlp.gate_proj.weight", (i, h)),
        ("mlp.up_proj.weight", (i, h)),
        ("mlp.down_proj.weight", (h, i)),
    ]
    return shapes


@lru_cache(maxsize=32)
def model_layouts(arch: ModelArch) -> tuple[LayerLayout, ...]:
    n = arch.num_layers
    layouts = [_layout(0, EMBED, "model.", [("embed_tokens.weight", (arch.vocab_size, arch.hidden_size))])]
    for i in range(n):
        layouts.append(_layout(i + 1, BLOCK, f"model.layers.{i}.", block_shapes(arch)))
    head = [("model.norm.weight", (arch.hidden_size,))]
    if not arch.tie_word_embeddings:
        head.append(("lm_head.weight", (arch.vocab_size, arch.hidden_size)))
    layouts.append(_layout(n + 1, HEAD, "", head))
    return tuple(layouts)


def hf_names(arch: ModelArch) -> dict[str, tuple[int, ParamSlot]]:
    """Every Hugging Face tensor name of the model -> (layer index, slot)."""
    return {layout.hf_name(p.name): (layout.index, p) for layout in model_layouts(arch) for p in layout.params}
