"""The Llama family (Llama 2/3, Mistral, Qwen2/2.5, Qwen3): its layers, names and stateless templates.

Each template is a pure function of (bound weights, activations): weights arrive per call as
views into a streamed buffer, so nothing here owns persistent device memory. Numerics follow
Hugging Face transformers (RMSNorm in fp32, RoPE tables in fp32 cast to the compute dtype).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from megatrain_ray.models import ops
from megatrain_ray.models.arch import ModelArch, RopeScaling
from megatrain_ray.models.family import IGNORE_INDEX, ModelFamily, Weights
from megatrain_ray.models.hf_adapter import read_fields, write_fields
from megatrain_ray.models.layout import LayerLayout, Shapes, decoder_layouts



@dataclass
class Rope:
    """Per-micro-batch attention context: RoPE tables and the mask for packed documents."""

    cos: torch.Tensor  # [B, T, head_dim], compute dtype
    sin: torch.Tensor
    mask: torch.Tensor | None  # [B, 1, T, T] bool, None for plain causal attention


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def inverse_frequencies(arch: ModelArch, device: torch.device) -> torch.Tensor:
    dim = arch.head_dim
    inv = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))
    s = arch.rope_scaling
    if s is None:
        return inv
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def packed_causal_mask(position_ids: torch.Tensor, packed: bool | None = None) -> torch.Tensor | None:
    """Block-diagonal causal mask when a row packs several documents (positions restart at 0);
    `packed` as ops.document_ids takes it."""
    doc = ops.document_ids(position_ids, packed)
    return ops.attention_mask(doc, position_ids.shape[1], None, position_ids.device)


def rope_context(arch: ModelArch, position_ids: torch.Tensor, dtype: torch.dtype, packed: bool | None = None) -> Rope:
    inv = inverse_frequencies(arch, position_ids.device)
    freqs = position_ids[..., None].float() * inv
    emb = torch.cat((freqs, freqs), dim=-1)
    return Rope(emb.cos().to(dtype), emb.sin().to(dtype), packed_causal_mask(position_ids, packed))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _apply_rope(x: torch.Tensor, rope: Rope) -> torch.Tensor:
    cos, sin = rope.cos[:, None], rope.sin[:, None]  # broadcast over heads
    return x * cos + _rotate_half(x) * sin


def _linear(w: Weights, name: str, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w[name + ".weight"], w.get(name + ".bias"))


def attention(arch: ModelArch, w: Weights, x: torch.Tensor, rope: Rope) -> torch.Tensor:
    b, t, _ = x.shape
    hd = arch.head_dim
    q = _linear(w, "self_attn.q_proj", x).view(b, t, arch.num_heads, hd)
    k = _linear(w, "self_attn.k_proj", x).view(b, t, arch.num_kv_heads, hd)
    v = _linear(w, "self_attn.v_proj", x).view(b, t, arch.num_kv_heads, hd)
    if arch.qk_norm:
        q = rms_norm(q, w["self_attn.q_norm.weight"], arch.rms_norm_eps)
        k = rms_norm(k, w["self_attn.k_norm.weight"], arch.rms_norm_eps)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    q, k = _apply_rope(q, rope), _apply_rope(k, rope)
    gqa = arch.num_heads != arch.num_kv_heads
    if rope.mask is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=hd**-0.5, enable_gqa=gqa)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=rope.mask, scale=hd**-0.5, enable_gqa=gqa)
    out = out.transpose(1, 2).reshape(b, t, arch.num_heads * hd)
    return _linear(w, "self_attn.o_proj", out)


def mlp(w: Weights, x: torch.Tensor) -> torch.Tensor:
    return _linear(w, "mlp.down_proj", F.silu(_linear(w, "mlp.gate_proj", x)) * _linear(w, "mlp.up_proj", x))


def embed_forward(w: Weights, input_ids: torch.Tensor) -> torch.Tensor:
    return F.embedding(input_ids, w["embed_tokens.weight"])


def block_forward(arch: ModelArch, w: Weights, x: torch.Tensor, rope: Rope, mlp_chunk: int = 0) -> torch.Tensor:
    x = x + attention(arch, w, rms_norm(x, w["input_layernorm.weight"], arch.rms_norm_eps), rope)
    h = rms_norm(x, w["post_attention_layernorm.weight"], arch.rms_norm_eps)
    if 0 < mlp_chunk < h.shape[0] * h.shape[1]:
        return x + chunked_mlp(w, h, mlp_chunk)
    return x + mlp(w, h)


def chunked_mlp(w: Weights, h: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    """The SwiGLU MLP over checkpointed chunks of tokens (models/ops.py)."""
    return ops.chunked_mlp(mlp, w, h, chunk_tokens)


def final_norm(arch: ModelArch, w: Weights, x: torch.Tensor) -> torch.Tensor:
    return rms_norm(x, w["model.norm.weight"], arch.rms_norm_eps)


def lm_head_weight(arch: ModelArch, head: Weights, embed: Weights | None) -> torch.Tensor:
    if arch.tie_word_embeddings:
        assert embed is not None, "tied embeddings: the head needs the embedding's weights"
        return embed["embed_tokens.weight"]
    return head["lm_head.weight"]


def chunked_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int, scale: float
) -> torch.Tensor:
    """Summed token losses times `scale`, a chunk of logits at a time (models/ops.py)."""
    return ops.chunked_cross_entropy(_chunk_loss, hidden, weight, labels, chunk_tokens, scale)


def _chunk_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = F.linear(hidden, weight).float()
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")


# ---------------------------------------------------------------------------------------------
# Its layers and Hugging Face names
# ---------------------------------------------------------------------------------------------

HF_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
              "qwen3": "Qwen3ForCausalLM"}


def block_shapes(arch: ModelArch) -> Shapes:
    h, hd, i = arch.hidden_size, arch.head_dim, arch.intermediate_size
    q, kv = arch.num_heads * hd, arch.num_kv_heads * hd
    shapes: Shapes = [("input_layernorm.weight", (h,)), ("self_attn.q_proj.weight", (q, h))]
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


def rope_scaling_from_hf(config: dict[str, Any]) -> tuple[RopeScaling | None, float]:
    """(llama3 scaling or None, rope_theta); transformers 5.x keeps both in rope_parameters."""
    scaling = config.get("rope_scaling") or (config.get("rope_parameters") or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    rope_scaling = None
    if rope_type == "llama3":
        rope_scaling = RopeScaling(
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        )
    elif rope_type not in ("default", None):
        raise ValueError(f"rope scaling type {rope_type!r} is not supported (default or llama3)")
    # a key present as null means unset
    return rope_scaling, float(config.get("rope_theta") or scaling.get("rope_theta") or 10000.0)


# Per token, a decoder layer's saved tensors during its recompute + backward: the norms' fp32
# copies, q/k/v/attention output, the MLP's gate/up/act/product (fitted on the H100, in units of
# the compute dtype; planning/memory.py says how).
WORKING_SET_PER_TOKEN = (13, 1)  # x hidden_size, x intermediate_size (or the MLP chunk)


class LlamaFamily(ModelFamily):
    model_types = tuple(HF_CLASSES)
    presets: dict[str, ModelArch] = {
        # Tiny shapes for CPU tests: one of each family quirk.
        "tiny-llama": ModelArch("llama", 256, 64, 128, 2, 4, 2, 16, rms_norm_eps=1e-5, rope_theta=10000.0),
        "tiny-qwen2": ModelArch("qwen2", 256, 64, 128, 2, 4, 2, 16, qkv_bias=True, rope_theta=1e6),
        "tiny-qwen3": ModelArch("qwen3", 256, 64, 128, 2, 4, 2, 16, qk_norm=True, tie_word_embeddings=True,
                                rope_theta=1e6),
        # Benchmark shapes (Qwen2.5 family); random initialisation, no download.
        "qwen2.5-1.5b": ModelArch("qwen2", 151936, 1536, 8960, 28, 12, 2, 128, qkv_bias=True, rope_theta=1e6,
                                  tie_word_embeddings=True, max_position_embeddings=32768),
        "qwen2.5-3b": ModelArch("qwen2", 151936, 2048, 11008, 36, 16, 2, 128, qkv_bias=True, rope_theta=1e6,
                                tie_word_embeddings=True, max_position_embeddings=32768),
        "qwen2.5-7b": ModelArch("qwen2", 152064, 3584, 18944, 28, 28, 4, 128, qkv_bias=True, rope_theta=1e6,
                                max_position_embeddings=32768),
        "qwen2.5-14b": ModelArch("qwen2", 152064, 5120, 13824, 48, 40, 8, 128, qkv_bias=True, rope_theta=1e6,
                                 max_position_embeddings=32768),
        "llama3-8b": ModelArch("llama", 128256, 4096, 14336, 32, 32, 8, 128, rms_norm_eps=1e-5,
                               rope_theta=500000.0, max_position_embeddings=8192),
        # A ~120B dense shape for planning RAM-node clusters: Mistral Large 2 (Mistral-Large-Instruct-2407's
        # config.json: hidden 12288, MLP 28672, 88 layers, 96 query / 8 KV heads of 128, vocab 32768), 122.6 B params.
        "mistral-large-123b": ModelArch("mistral", 32768, 12288, 28672, 88, 96, 8, 128, rms_norm_eps=1e-5,
                                        rope_theta=1e6, max_position_embeddings=131072),
    }

    # -- shapes and names ------------------------------------------------------------------------
    def arch_from_hf(self, config: dict[str, Any]) -> ModelArch:
        model_type = config["model_type"]
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config['hidden_act']!r} is not supported (only silu)")
        rope_scaling, rope_theta = rope_scaling_from_hf(config)
        return ModelArch(
            model_type=model_type,
            **read_fields(config, self.hf_fields),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            qkv_bias=model_type == "qwen2" or bool(config.get("attention_bias", False)),
            qk_norm=model_type == "qwen3",
        )

    def hf_config(self, arch: ModelArch, torch_dtype: str) -> dict[str, Any]:
        config: dict[str, Any] = {
            "architectures": [HF_CLASSES[arch.model_type]],
            "model_type": arch.model_type,
            **write_fields(arch, self.hf_fields),
            "hidden_act": "silu",
            "rope_theta": arch.rope_theta,
            "torch_dtype": torch_dtype,
        }
        if arch.model_type == "llama":
            config["attention_bias"] = arch.qkv_bias
            config["mlp_bias"] = False
        if arch.model_type == "mistral":
            config["sliding_window"] = None
        if arch.model_type in ("qwen2", "qwen3"):
            config["use_sliding_window"] = False
            config["sliding_window"] = None
        if arch.model_type == "qwen3":
            config["attention_bias"] = arch.qkv_bias
        if arch.rope_scaling is not None:
            config["rope_scaling"] = {"rope_type": "llama3", **dataclasses.asdict(arch.rope_scaling)}
        return config

    def layouts(self, arch: ModelArch) -> tuple[LayerLayout, ...]:
        return decoder_layouts(arch, lambda i: block_shapes(arch))

    # -- the stateless templates -----------------------------------------------------------------
    def context(self, arch: ModelArch, position_ids: torch.Tensor, dtype: torch.dtype,
                packed: bool | None = None) -> Rope:
        return rope_context(arch, position_ids, dtype, packed)

    def embed(self, arch: ModelArch, w: Weights, input_ids: torch.Tensor) -> torch.Tensor:
        return embed_forward(w, input_ids)

    def block(self, arch: ModelArch, w: Weights, x: torch.Tensor, ctx: Rope, mlp_chunk: int = 0) -> torch.Tensor:
        return block_forward(arch, w, x, ctx, mlp_chunk)

    def head_loss(self, arch: ModelArch, head: Weights, embed: Weights | None, x: torch.Tensor,
                  labels: torch.Tensor, chunk_tokens: int, scale: float) -> torch.Tensor:
        hidden = final_norm(arch, head, x)
        return chunked_cross_entropy(hidden, lm_head_weight(arch, head, embed), labels, chunk_tokens, scale)

    def logits(self, arch: ModelArch, head: Weights, embed: Weights | None, x: torch.Tensor) -> torch.Tensor:
        return F.linear(final_norm(arch, head, x), lm_head_weight(arch, head, embed))

    # -- what the planner and the benchmark count ----------------------------------------------
    def working_set_bytes(self, arch: ModelArch, tokens: int, mlp_tokens: int, dtype_bytes: int) -> int:
        per_h, per_i = WORKING_SET_PER_TOKEN
        return (tokens * per_h * arch.hidden_size + mlp_tokens * per_i * arch.intermediate_size) * dtype_bytes


LLAMA = LlamaFamily()
