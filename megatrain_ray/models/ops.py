"""Tensor pieces that families share: attention masks from document ids and a sliding window,
attention, partial rotary embeddings, an MLP run over chunks of tokens, and the token loss over
chunks of logits.

Masks are built per block call from a [B, T] row of document ids (never held per micro-batch for
the whole step): a boolean [B or 1, 1, T, T] is T^2 bytes a row, which a step of many long
micro-batches could not keep. Every decision here is on Python values and static shapes, so the
executor's torch.compile of a block traces it without a graph break.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
import torch.utils.checkpoint


def packs_documents(position_ids) -> bool:
    """Whether some row packs several documents (its positions restart at 0), of a tensor or of
    the host's numpy copy of a batch. The executor asks the host's: asking a GPU tensor waits for
    everything queued before it, once per micro-batch, and those waits were nearly all of a step's
    wait before its first layer."""
    if isinstance(position_ids, torch.Tensor):
        return bool((position_ids[:, 1:] == 0).any())
    return bool((np.asarray(position_ids)[:, 1:] == 0).any())


def document_ids(position_ids: torch.Tensor, packed: bool | None = None) -> torch.Tensor | None:
    """[B, T] ids of the document each position belongs to when a row packs several (positions
    restart at 0); None when no row does. `packed`: that answer where the caller knows it (None:
    asked of `position_ids`). Runs per micro-batch, outside the compiled block."""
    if not (packs_documents(position_ids) if packed is None else packed):
        return None
    return torch.cumsum((position_ids == 0).long(), dim=1)


def attention_mask(doc: torch.Tensor | None, t: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """True where query i may attend to key j: causal, within `window` positions (j > i - window,
    as transformers' sliding window), and within one document. None where plain causal attention
    is exact (one document per row and no window shorter than the row)."""
    windowed = window is not None and window < t
    if doc is None and not windowed:
        return None
    i = torch.arange(t, device=device)
    mask = i[:, None] >= i[None, :]
    if windowed:
        mask = mask & (i[:, None] - i[None, :] < window)
    mask = mask[None, None]
    if doc is not None:
        mask = mask & (doc[:, :, None] == doc[:, None, :])[:, None]
    return mask


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """[B, H, T, D] attention output: SDPA, causal or with the boolean mask. With a mask, grouped
    key/value heads are repeated first: SDPA's enable_gqa with a mask falls back to the math kernel
    on CUDA (which materialises the scores), as transformers' sdpa_attention also avoids."""
    gqa = q.shape[1] != k.shape[1]
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    if gqa:
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first cos.shape[-1] features of each head ([B, H, T, D] against [B, T, R]); the
    rest pass through (partial rotary embeddings)."""
    cos, sin = cos[:, None], sin[:, None]
    rotary = cos.shape[-1]
    if rotary == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rot, rest = x[..., :rotary], x[..., rotary:]
    return torch.cat((rot * cos + rotate_half(rot) * sin, rest), dim=-1)


def rope_tables(position_ids: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype,
                attention_scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [B, T, 2 x len(inv_freq)] in fp32, scaled, then cast, as transformers does."""
    freqs = position_ids[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * attention_scaling).to(dtype), (emb.sin() * attention_scaling).to(dtype)


def default_inverse_frequencies(base: float, dim: int, device: torch.device) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))


def chunked_mlp(mlp: Callable[[dict, torch.Tensor], torch.Tensor], w: dict, h: torch.Tensor,
                chunk_tokens: int) -> torch.Tensor:
    """`mlp` over chunks of tokens, each under a checkpoint: for long sequences the
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


def chunked_cross_entropy(chunk_loss: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
                          hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int,
                          scale: float) -> torch.Tensor:
    """Sum of `chunk_loss(hidden, weight, labels)` over chunks of tokens, times `scale`, never
    materialising [tokens x vocab] logits at once: each chunk runs under a checkpoint, so autograd
    holds one chunk's logits at a time and recomputes them in backward. Tokens that fit one chunk
    run plainly: nothing to recompute (the executor's head differentiates chunk by chunk as it goes)."""
    hidden = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1)
    if hidden.shape[0] <= chunk_tokens:
        return chunk_loss(hidden, weight, labels) * scale
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[0], chunk_tokens):
        end = start + chunk_tokens
        total = total + torch.utils.checkpoint.checkpoint(
            chunk_loss, hidden[start:end], weight, labels[start:end], use_reentrant=False)
    return total * scale


def window_key_count(seq_len: int, window: int | None) -> float:
    """Keys a query attends to on average in a causal row of seq_len, within `window`: seq_len / 2
    without one (the convention of the attention FLOP count), fewer when the window is shorter."""
    if window is None or window >= seq_len:
        return seq_len / 2
    return window - window * window / (2 * seq_len)


def masked_attention_bytes(tokens: int, row: int, heads: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """What attention with an explicit mask adds to a block's working set over `tokens` tokens in
    rows of `row`: the boolean mask and the additive one SDPA makes of it in the compute dtype
    (row bytes per token each, times the dtype's), and the keys and values repeated to every head."""
    return tokens * (row * (1 + dtype_bytes) + 2 * (heads - kv_heads) * head_dim * dtype_bytes)
