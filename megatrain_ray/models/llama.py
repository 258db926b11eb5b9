"""Stateless layer templates of the Llama family (Llama 2/3, Mistral, Qwen2/2.5, Qwen3).

Each template is a pure function of (bound weights, activations): weights arrive per call as
views into a streamed buffer, so nothing here owns persistent device memory. Numerics follow
Hugging Face transformers (RMSNorm in fp32, RoPE tables in fp32 cast to the compute dtype).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from megatrain_ray.models.arch import ModelArch

Weights = dict[str, torch.Tensor]
IGNORE_INDEX = -100


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


def packed_causal_mask(position_ids: torch.Tensor) -> torch.Tensor | None:
    """Block-diagonal causal mask when a row packs several documents (positions restart at 0)."""
    starts = position_ids == 0
    if int(starts[:, 1:].sum()) == 0:
        return None
    doc = torch.cumsum(starts.long(), dim=1)
    same_doc = doc[:, :, None] == doc[:, None, :]
    t = position_ids.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=position_ids.device).tril()
    return (same_doc & causal)[:, None]


def rope_context(arch: ModelArch, position_ids: torch.Tensor, dtype: torch.dtype) -> Rope:
    inv = inverse_frequencies(arch, position_ids.device)
    freqs = position_ids[..., None].float() * inv
    emb = torch.cat((freqs, freqs), dim=-1)
    return Rope(emb.cos().to(dtype), emb.sin().to(dtype), packed_causal_mask(position_ids))


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
    """The MLP over chunks of tokens, each under a checkpoint: for long sequences, the
    [tokens x intermediate] tensors exist for one chunk at a time, in forward and in backward."""
    flat = h.reshape(-1, h.shape[-1])
    outs = []
    for start in range(0, flat.shape[0], chunk_tokens):
        piece = flat[start : start + chunk_tokens]
        if torch.is_grad_enabled():
            outs.append(torch.utils.checkpoint.checkpoint(mlp, w, piece, use_reentrant=False))
        else:
            outs.append(mlp(w, piece))
    return torch.cat(outs).view(h.shape)


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
    """Sum of token losses, never materialising [tokens x vocab] logits at once.

    Each chunk's logits are recomputed inside a checkpoint during backward, so the autograd
    graph holds one chunk's logits at a time, not all of them.
    """
    hidden = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1)
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[0], chunk_tokens):
        end = start + chunk_tokens
        total = total + torch.utils.checkpoint.checkpoint(
            _chunk_loss, hidden[start:end], weight, labels[start:end], use_reentrant=False
        )
    return total * scale


def _chunk_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = F.linear(hidden, weight).float()
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
