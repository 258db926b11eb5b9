"""The Phi-3 family (Phi-3, Phi-3.5, Phi-4, Phi-4-mini; model_type phi3): its layers, names and
stateless templates.

A Llama block with the checkpoint's fused tensors kept fused in the layout (self_attn.qkv_proj:
q, k, v stacked; mlp.gate_up_proj: gate, then up), so the Hugging Face names round-trip with no
special case; RoPE on the first partial_rotary_factor of each head (Phi-4-mini: 96 of 128) with
either plain frequencies or LongRoPE (short factors, or long ones once the micro-batch reaches
past original_max_position_embeddings, and cos/sin scaled), and an optional sliding window.
Numerics follow transformers' Phi3ForCausalLM.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from megatrain_ray.models import ops
from megatrain_ray.models.arch import ModelArch
from megatrain_ray.models.family import Weights
from megatrain_ray.models.hf_adapter import DECODER_FIELDS, HfField, read_fields, with_defaults, without, write_fields
from megatrain_ray.models.layout import LayerLayout, Shapes, decoder_layouts
from megatrain_ray.models.llama import WORKING_SET_PER_TOKEN, LlamaFamily, Rope, rms_norm

PHI3_PAD_DEFAULT = 32000  # transformers' Phi3Config pad_token_id when config.json has none


@dataclass(frozen=True)
class Phi3Arch(ModelArch):
    partial_rotary_factor: float = 1.0  # share of each head's features that RoPE rotates
    rope_type: str = "default"  # default | longrope (transformers also reads 'su' and 'yarn' as longrope)
    rope_short_factor: tuple[float, ...] | None = None  # LongRoPE, one per rotated frequency
    rope_long_factor: tuple[float, ...] | None = None
    rope_factor: float | None = None  # as the config gives them; None: transformers' derivation
    rope_attention_factor: float | None = None
    original_max_position_embeddings: int = 4096
    sliding_window: int | None = None
    pad_token_id: int | None = None  # its embedding row gets no gradient from the lookup (nn.Embedding padding_idx)

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("rope_short_factor", "rope_long_factor"):  # lists from JSON and YAML
            if getattr(self, name) is not None:
                object.__setattr__(self, name, tuple(float(f) for f in getattr(self, name)))
        if self.rope_type not in ("default", "longrope"):
            raise ValueError(f"rope_type {self.rope_type!r} is not supported for phi3 (default or longrope)")
        if self.rope_type == "longrope":
            for name in ("rope_short_factor", "rope_long_factor"):
                factors = getattr(self, name)
                if factors is None or len(factors) != self.rotary_dim // 2:
                    raise ValueError(f"longrope needs {name} with {self.rotary_dim // 2} values "
                                     f"(rotary dim {self.rotary_dim} / 2), got {factors and len(factors)}")
        if not 0 < self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise ValueError(f"partial_rotary_factor {self.partial_rotary_factor} gives rotary dim {self.rotary_dim}"
                             f" of head_dim {self.head_dim}; it must be even and positive")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive, got {self.sliding_window}")
        if self.pad_token_id is not None and not 0 <= self.pad_token_id < self.vocab_size:
            raise ValueError(f"pad_token_id {self.pad_token_id} is outside the vocabulary (0..{self.vocab_size - 1}); "
                             f"transformers cannot build this model either")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)


# ---------------------------------------------------------------------------------------------
# The templates
# ---------------------------------------------------------------------------------------------


@dataclass
class PhiContext:
    cos: torch.Tensor  # [B, T, rotary_dim], compute dtype
    sin: torch.Tensor
    doc: torch.Tensor | None  # [B, T] document ids; None when no row packs several documents


def attention_scaling(arch: Phi3Arch) -> float:
    """LongRoPE's cos/sin scale, as transformers derives it when the config does not give it."""
    if arch.rope_type == "default":
        return 1.0
    if arch.rope_attention_factor is not None:
        return arch.rope_attention_factor
    factor = arch.rope_factor or arch.max_position_embeddings / arch.original_max_position_embeddings
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(arch.original_max_position_embeddings))


def inverse_frequencies(arch: Phi3Arch, position_ids: torch.Tensor) -> torch.Tensor:
    """Plain, or LongRoPE: the long factors once the micro-batch's furthest position reaches past
    original_max_position_embeddings (a tensor comparison, as transformers: no host sync)."""
    device, dim = position_ids.device, arch.rotary_dim
    if arch.rope_type == "default":
        return ops.default_inverse_frequencies(arch.rope_theta, dim, device)
    shape = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    base = arch.rope_theta**shape
    short = 1.0 / (torch.tensor(arch.rope_short_factor, dtype=torch.float32, device=device) * base)
    long = 1.0 / (torch.tensor(arch.rope_long_factor, dtype=torch.float32, device=device) * base)
    return torch.where(position_ids.max() + 1 > arch.original_max_position_embeddings, long, short)


def phi_context(arch: Phi3Arch, position_ids: torch.Tensor, dtype: torch.dtype, packed: bool | None = None) -> PhiContext:
    cos, sin = ops.rope_tables(position_ids, inverse_frequencies(arch, position_ids), dtype, attention_scaling(arch))
    return PhiContext(cos, sin, ops.document_ids(position_ids, packed))


def attention(arch: Phi3Arch, w: Weights, x: torch.Tensor, rope: Rope) -> torch.Tensor:
    b, t, _ = x.shape
    hd, heads, kv = arch.head_dim, arch.num_heads, arch.num_kv_heads
    qkv = F.linear(x, w["self_attn.qkv_proj.weight"])
    q, k, v = qkv.split([heads * hd, kv * hd, kv * hd], dim=-1)
    q = q.reshape(b, t, heads, hd).transpose(1, 2)
    k = k.reshape(b, t, kv, hd).transpose(1, 2)
    v = v.reshape(b, t, kv, hd).transpose(1, 2)
    q, k = ops.apply_rope(q, rope.cos, rope.sin), ops.apply_rope(k, rope.cos, rope.sin)
    out = ops.attend(q, k, v, rope.mask, hd**-0.5)
    return F.linear(out.transpose(1, 2).reshape(b, t, heads * hd), w["self_attn.o_proj.weight"])


def mlp(w: Weights, x: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, w["mlp.gate_up_proj.weight"]).chunk(2, dim=-1)
    return F.linear(up * F.silu(gate), w["mlp.down_proj.weight"])


def block_forward(arch: Phi3Arch, w: Weights, x: torch.Tensor, rope: Rope, mlp_chunk: int = 0) -> torch.Tensor:
    x = x + attention(arch, w, rms_norm(x, w["input_layernorm.weight"], arch.rms_norm_eps), rope)
    h = rms_norm(x, w["post_attention_layernorm.weight"], arch.rms_norm_eps)
    if 0 < mlp_chunk < h.shape[0] * h.shape[1]:
        return x + ops.chunked_mlp(mlp, w, h, mlp_chunk)
    return x + mlp(w, h)


# ---------------------------------------------------------------------------------------------
# Its layers and Hugging Face names
# ---------------------------------------------------------------------------------------------


def block_shapes(arch: Phi3Arch) -> Shapes:
    h, hd, i = arch.hidden_size, arch.head_dim, arch.intermediate_size
    qkv = (arch.num_heads + 2 * arch.num_kv_heads) * hd
    return [
        ("input_layernorm.weight", (h,)),
        ("self_attn.qkv_proj.weight", (qkv, h)),
        ("self_attn.o_proj.weight", (h, arch.num_heads * hd)),
        ("post_attention_layernorm.weight", (h,)),
        ("mlp.gate_up_proj.weight", (2 * i, h)),
        ("mlp.down_proj.weight", (h, i)),
    ]


def rope_from_hf(config: dict[str, Any]) -> dict[str, Any]:
    """The RoPE fields of Phi3Arch from either format: transformers 4.x (rope_scaling, with
    rope_theta and partial_rotary_factor beside it) or 5.x (all of them in rope_parameters)."""
    params = dict(config.get("rope_scaling") or config.get("rope_parameters") or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    rope_type = "longrope" if rope_type in ("su", "yarn") else rope_type  # as transformers' Phi3Config
    if rope_type not in ("default", "longrope"):
        raise ValueError(f"phi3 rope scaling type {rope_type!r} is not supported (default or longrope)")
    max_positions = int(config.get("max_position_embeddings", 4096))
    fields: dict[str, Any] = {
        "rope_theta": float(config.get("rope_theta") or params.get("rope_theta") or 10000.0),
        "partial_rotary_factor": float(config.get("partial_rotary_factor") or params.get("partial_rotary_factor") or 1.0),
        "rope_type": rope_type,
        "original_max_position_embeddings": int(config.get("original_max_position_embeddings")
                                                or params.get("original_max_position_embeddings") or max_positions),
    }
    if rope_type == "longrope":
        fields.update(rope_short_factor=tuple(map(float, params["short_factor"])),
                      rope_long_factor=tuple(map(float, params["long_factor"])),
                      rope_factor=params.get("factor"), rope_attention_factor=params.get("attention_factor"))
    return fields


class Phi3Family(LlamaFamily):
    """Llama's final norm, LM head and matmul count (over this family's own layouts); its own
    fused projections, partial rotary LongRoPE, padding index and sliding window."""

    model_types = ("phi3",)
    arch_type = Phi3Arch
    # head_dim is hidden_size / num_attention_heads, not a key of its config.json
    hf_fields = without(with_defaults(DECODER_FIELDS, rms_norm_eps=1e-5), "head_dim") + (
        HfField("sliding_window", "sliding_window", default=None),
        HfField("pad_token_id", "pad_token_id", default=PHI3_PAD_DEFAULT),
    )
    presets: dict[str, Phi3Arch] = {
        # Tiny shape for CPU tests: partial rotary (12 of 16) and LongRoPE past 8 positions.
        "tiny-phi3": Phi3Arch("phi3", 256, 64, 128, 2, 4, 2, 16, rms_norm_eps=1e-5, max_position_embeddings=64,
                              partial_rotary_factor=0.75, rope_type="longrope", rope_short_factor=(1.0,) * 6,
                              rope_long_factor=(1.0, 1.5, 2.0, 3.0, 4.0, 6.0), original_max_position_embeddings=8,
                              pad_token_id=3),
        # microsoft/Phi-4-mini-instruct config.json: vocab 200064, hidden 3072, intermediate 8192, 32 layers,
        # 24 heads, 8 kv heads, partial_rotary_factor 0.75, LongRoPE (these factors) from 4096 of 131072
        # positions, rope_theta 10000, sliding_window 262144, tied embeddings, eps 1e-5, pad 199999.
        "phi-4-mini": Phi3Arch(
            "phi3", 200064, 3072, 8192, 32, 24, 8, 128, rms_norm_eps=1e-5, rope_theta=10000.0,
            tie_word_embeddings=True, max_position_embeddings=131072, partial_rotary_factor=0.75,
            rope_type="longrope", rope_short_factor=(1.0,) * 48,
            rope_long_factor=(1, 1.118320672, 1.250641126, 1.398617824, 1.564103225, 1.74916897, 1.956131817,
                              2.187582649, 2.446418898, 2.735880826, 3.059592084, 3.421605075, 3.826451687,
                              4.279200023, 4.785517845, 5.351743533, 5.984965424, 6.693110555, 7.485043894,
                              8.370679318, 9.36110372, 10.4687158, 11.70738129, 13.09260651, 14.64173252,
                              16.37415215, 18.31155283, 20.47818807, 22.90118105, 25.61086418, 28.64115884,
                              32.03, 32.1, 32.13, 32.23, 32.6, 32.61, 32.64, 32.66, 32.7, 32.71, 32.93, 32.97,
                              33.28, 33.49, 33.5, 44.16, 47.77),
            original_max_position_embeddings=4096, sliding_window=262144, pad_token_id=199999),
        # microsoft/phi-4 config.json: vocab 100352, hidden 5120, intermediate 17920, 40 layers, 40 heads,
        # 10 kv heads, rope_theta 250000, no RoPE scaling, 16384 positions, untied, eps 1e-5, pad 100257.
        "phi-4": Phi3Arch("phi3", 100352, 5120, 17920, 40, 40, 10, 128, rms_norm_eps=1e-5, rope_theta=250000.0,
                          max_position_embeddings=16384, original_max_position_embeddings=16384,
                          pad_token_id=100257),
    }

    # -- shapes and names ------------------------------------------------------------------------
    def arch_from_hf(self, config: dict[str, Any]) -> Phi3Arch:
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config['hidden_act']!r} is not supported (only silu)")
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        if config.get("head_dim") not in (None, hidden // heads):
            raise ValueError(f"head_dim {config['head_dim']} is not supported for phi3: transformers' Phi3 "
                             f"uses hidden_size / num_attention_heads = {hidden // heads}")
        return Phi3Arch(model_type="phi3", head_dim=hidden // heads, **read_fields(config, self.hf_fields),
                        **rope_from_hf(config))

    def hf_config(self, arch: Phi3Arch, torch_dtype: str) -> dict[str, Any]:
        rope_scaling = None
        if arch.rope_type == "longrope":
            # exactly these three keys when nothing else is set: transformers 4.4x checks for them
            rope_scaling = {"type": "longrope", "short_factor": list(arch.rope_short_factor),
                            "long_factor": list(arch.rope_long_factor)}
            for key, value in (("factor", arch.rope_factor), ("attention_factor", arch.rope_attention_factor)):
                if value is not None:
                    rope_scaling[key] = value
        return {
            "architectures": ["Phi3ForCausalLM"],
            "model_type": "phi3",
            **write_fields(arch, self.hf_fields),
            "hidden_act": "silu",
            "rope_theta": arch.rope_theta,
            "partial_rotary_factor": arch.partial_rotary_factor,
            "rope_scaling": rope_scaling,
            "original_max_position_embeddings": arch.original_max_position_embeddings,
            "attention_dropout": 0.0,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "torch_dtype": torch_dtype,
        }

    def layouts(self, arch: Phi3Arch) -> tuple[LayerLayout, ...]:
        return decoder_layouts(arch, lambda i: block_shapes(arch))

    # -- the stateless templates -----------------------------------------------------------------
    def context(self, arch: Phi3Arch, position_ids: torch.Tensor, dtype: torch.dtype,
                packed: bool | None = None) -> PhiContext:
        return phi_context(arch, position_ids, dtype, packed)

    def layer_context(self, arch: Phi3Arch, ctx: PhiContext, layer: int) -> Rope:
        return Rope(ctx.cos, ctx.sin, ops.attention_mask(ctx.doc, ctx.cos.shape[1], arch.sliding_window, ctx.cos.device))

    def embed(self, arch: Phi3Arch, w: Weights, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, w["embed_tokens.weight"], padding_idx=arch.pad_token_id)

    def block(self, arch: Phi3Arch, w: Weights, x: torch.Tensor, ctx: Rope, mlp_chunk: int = 0) -> torch.Tensor:
        return block_forward(arch, w, x, ctx, mlp_chunk)

    def attention_flops_per_token(self, arch: Phi3Arch, seq_len: int) -> float:
        """12 x layers x heads x head_dim per key attended (fwd + bwd): seq/2 keys (causal), fewer
        with a window shorter than the row."""
        return 12 * arch.num_layers * ops.window_key_count(seq_len, arch.sliding_window) * arch.num_heads * arch.head_dim

    def working_set_bytes(self, arch: Phi3Arch, tokens: int, mlp_tokens: int, dtype_bytes: int) -> int:
        """The Llama fit as it is: the fused q/k/v and gate/up outputs hold what the separate ones
        did, split into views (the partial rotary's concatenation is within the fit's spread);
        plus an explicit mask when the window is shorter than the micro-batch (bounded as Gemma's)."""
        per_h, per_i = WORKING_SET_PER_TOKEN
        units = tokens * per_h * arch.hidden_size + mlp_tokens * per_i * arch.intermediate_size
        masked = arch.sliding_window is not None and arch.sliding_window < tokens
        mask = ops.masked_attention_bytes(tokens, tokens, arch.num_heads, arch.num_kv_heads, arch.head_dim,
                                          dtype_bytes) if masked else 0
        return units * dtype_bytes + mask


PHI3 = Phi3Family()
