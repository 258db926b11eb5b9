"""The Gemma 3 family (text models, model_type gemma3_text): its layers, names and stateless templates.

What sets it apart from Llama, each computed as transformers' Gemma3ForCausalLM does:
- embeddings scaled by sqrt(hidden_size), the scale rounded to the compute dtype first;
- RMSNorm with a (1 + w) weight, computed in fp32 and cast back after the weight;
- a norm before and after both the attention and the MLP; QK norm on every head;
- a GELU-tanh gated MLP;
- local sliding-window layers and global layers (`layer_types`), each with its own RoPE base
  (`rope_local_base_freq` local, `rope_theta` global, the global one optionally scaled linearly);
  the window holds in packed rows too (block-diagonal causal mask AND window);
- attention scaled by query_pre_attn_scalar ** -0.5, not head_dim ** -0.5;
- final logit soft-capping (cap * tanh(logits / cap)) when the config has it.
`attn_logit_softcapping` is kept for the round trip but not applied: transformers' Gemma3Attention
does not pass it to its attention function (Gemma 3 has no attention soft-capping; Gemma 2 had).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from megatrain_ray.models import ops
from megatrain_ray.models.arch import ModelArch
from megatrain_ray.models.family import IGNORE_INDEX, ModelFamily, Weights
from megatrain_ray.models.hf_adapter import DECODER_FIELDS, HfField, read_fields, write_fields
from megatrain_ray.models.layout import LayerLayout, ParamSlot, Shapes, decoder_layouts
from megatrain_ray.models.llama import WORKING_SET_PER_TOKEN, Rope, lm_head_weight

SLIDING, FULL = "sliding_attention", "full_attention"
# transformers' Gemma3TextConfig defaults: the Hub's config.json files leave most keys out
DEFAULTS = dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                num_attention_heads=8, num_key_value_heads=4, head_dim=256, rms_norm_eps=1e-6,
                max_position_embeddings=131072, query_pre_attn_scalar=256, sliding_window=4096,
                sliding_window_pattern=6, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
                tie_word_embeddings=True, pad_token_id=0, hidden_activation="gelu_pytorch_tanh")


def pattern_layer_types(num_layers: int, pattern: int) -> tuple[str, ...]:
    """Every `pattern`-th layer global, the others sliding (transformers' sliding_window_pattern)."""
    return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(num_layers))


def extend_layer_types(types: tuple[str, ...], num_layers: int) -> tuple[str, ...]:
    """The same repeating pattern over another number of layers (for a num_layers override)."""
    period = next(p for p in range(1, len(types) + 1) if all(t == types[i % p] for i, t in enumerate(types)))
    return tuple(types[i % period] for i in range(num_layers))


@dataclass(frozen=True)
class Gemma3Arch(ModelArch):
    query_pre_attn_scalar: float = 256.0
    sliding_window: int | None = 4096  # keys a sliding layer's query sees, itself included
    layer_types: tuple[str, ...] = ()  # per decoder layer: sliding_attention | full_attention
    rope_local_base_freq: float = 10_000.0  # RoPE base of the sliding layers (rope_theta: the global ones)
    rope_linear_factor: float = 1.0  # linear RoPE scaling of the global layers ('linear' rope_type); 1: none
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None  # not applied, as in transformers (module docstring)
    pad_token_id: int | None = 0  # its embedding row gets no gradient from the lookup (nn.Embedding padding_idx)

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "layer_types", tuple(self.layer_types))  # lists from JSON and YAML
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        if set(self.layer_types) - {SLIDING, FULL}:
            raise ValueError(f"layer_types may hold only {SLIDING!r} and {FULL!r}, got {sorted(set(self.layer_types))}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive, got {self.sliding_window}")
        if self.pad_token_id is not None and not 0 <= self.pad_token_id < self.vocab_size:
            raise ValueError(f"pad_token_id {self.pad_token_id} is outside the vocabulary (0..{self.vocab_size - 1})")

    def replace(self, **changes: Any) -> "Gemma3Arch":
        if "num_layers" in changes and "layer_types" not in changes:
            changes["layer_types"] = extend_layer_types(self.layer_types, changes["num_layers"])
        return dataclasses.replace(self, **changes)


# ---------------------------------------------------------------------------------------------
# The templates
# ---------------------------------------------------------------------------------------------


@dataclass
class GemmaContext:
    """Per micro-batch: the RoPE tables of each layer type, and document ids of packed rows."""

    tables: dict[str, tuple[torch.Tensor, torch.Tensor]]  # layer type -> (cos, sin) [B, T, head_dim]
    doc: torch.Tensor | None  # [B, T]; None when no row packs several documents


def gemma_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """(1 + w) RMSNorm: fp32 throughout, cast after the weight (Llama casts before it)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).type_as(x)


def inverse_frequencies(arch: Gemma3Arch, layer_type: str, device: torch.device) -> torch.Tensor:
    if layer_type == SLIDING:
        return ops.default_inverse_frequencies(arch.rope_local_base_freq, arch.head_dim, device)
    inv = ops.default_inverse_frequencies(arch.rope_theta, arch.head_dim, device)
    return inv / arch.rope_linear_factor if arch.rope_linear_factor != 1.0 else inv


def gemma_context(arch: Gemma3Arch, position_ids: torch.Tensor, dtype: torch.dtype,
                  packed: bool | None = None) -> GemmaContext:
    tables = {kind: ops.rope_tables(position_ids, inverse_frequencies(arch, kind, position_ids.device), dtype)
              for kind in sorted(set(arch.layer_types))}
    return GemmaContext(tables, ops.document_ids(position_ids, packed))


def _linear(w: Weights, name: str, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w[name + ".weight"])


def attention(arch: Gemma3Arch, w: Weights, x: torch.Tensor, rope: Rope) -> torch.Tensor:
    b, t, _ = x.shape
    hd = arch.head_dim
    q = _linear(w, "self_attn.q_proj", x).view(b, t, arch.num_heads, hd).transpose(1, 2)
    k = _linear(w, "self_attn.k_proj", x).view(b, t, arch.num_kv_heads, hd).transpose(1, 2)
    v = _linear(w, "self_attn.v_proj", x).view(b, t, arch.num_kv_heads, hd).transpose(1, 2)
    q = gemma_norm(q, w["self_attn.q_norm.weight"], arch.rms_norm_eps)
    k = gemma_norm(k, w["self_attn.k_norm.weight"], arch.rms_norm_eps)
    q, k = ops.apply_rope(q, rope.cos, rope.sin), ops.apply_rope(k, rope.cos, rope.sin)
    out = ops.attend(q, k, v, rope.mask, arch.query_pre_attn_scalar**-0.5)
    return _linear(w, "self_attn.o_proj", out.transpose(1, 2).reshape(b, t, arch.num_heads * hd))


def mlp(w: Weights, x: torch.Tensor) -> torch.Tensor:
    gate = F.gelu(_linear(w, "mlp.gate_proj", x), approximate="tanh")
    return _linear(w, "mlp.down_proj", gate * _linear(w, "mlp.up_proj", x))


def block_forward(arch: Gemma3Arch, w: Weights, x: torch.Tensor, rope: Rope, mlp_chunk: int = 0) -> torch.Tensor:
    eps = arch.rms_norm_eps
    h = attention(arch, w, gemma_norm(x, w["input_layernorm.weight"], eps), rope)
    x = x + gemma_norm(h, w["post_attention_layernorm.weight"], eps)
    h = gemma_norm(x, w["pre_feedforward_layernorm.weight"], eps)
    h = ops.chunked_mlp(mlp, w, h, mlp_chunk) if 0 < mlp_chunk < h.shape[0] * h.shape[1] else mlp(w, h)
    return x + gemma_norm(h, w["post_feedforward_layernorm.weight"], eps)


def embed_forward(arch: Gemma3Arch, w: Weights, input_ids: torch.Tensor) -> torch.Tensor:
    x = F.embedding(input_ids, w["embed_tokens.weight"], padding_idx=arch.pad_token_id)
    # transformers keeps sqrt(hidden) as an fp32 buffer and casts it to the weights' dtype
    return x * torch.tensor(arch.hidden_size**0.5, device=x.device).to(x.dtype)


def final_logits(arch: Gemma3Arch, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    logits = F.linear(hidden, weight)
    cap = arch.final_logit_softcapping
    return logits if cap is None else torch.tanh(logits / cap) * cap


def chunked_cross_entropy(arch: Gemma3Arch, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                          chunk_tokens: int, scale: float) -> torch.Tensor:
    """Summed token losses times `scale`, a chunk of (soft-capped) logits at a time (models/ops.py)."""
    return ops.chunked_cross_entropy(functools.partial(_chunk_loss, arch), hidden, weight, labels, chunk_tokens, scale)


def _chunk_loss(arch: Gemma3Arch, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = final_logits(arch, hidden, weight).float()
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")


# ---------------------------------------------------------------------------------------------
# Its layers and Hugging Face names
# ---------------------------------------------------------------------------------------------


def block_shapes(arch: Gemma3Arch) -> Shapes:
    h, hd, i = arch.hidden_size, arch.head_dim, arch.intermediate_size
    q, kv = arch.num_heads * hd, arch.num_kv_heads * hd
    return [
        ("input_layernorm.weight", (h,)),
        ("self_attn.q_proj.weight", (q, h)),
        ("self_attn.k_proj.weight", (kv, h)),
        ("self_attn.v_proj.weight", (kv, h)),
        ("self_attn.o_proj.weight", (h, q)),
        ("self_attn.q_norm.weight", (hd,)),
        ("self_attn.k_norm.weight", (hd,)),
        ("post_attention_layernorm.weight", (h,)),
        ("pre_feedforward_layernorm.weight", (h,)),
        ("post_feedforward_layernorm.weight", (h,)),
        ("mlp.gate_proj.weight", (i, h)),
        ("mlp.up_proj.weight", (i, h)),
        ("mlp.down_proj.weight", (h, i)),
    ]


def rope_from_hf(config: dict[str, Any]) -> tuple[float, float, float]:
    """(global base, global linear factor, local base) from either config format: transformers 5's
    rope_parameters per layer type, or the flat rope_theta / rope_local_base_freq / rope_scaling
    of the Hub's configs."""
    params = config.get("rope_parameters") or {}
    if FULL in params or SLIDING in params:
        full, local = dict(params.get(FULL) or {}), dict(params.get(SLIDING) or {})
    else:
        full = dict(config.get("rope_scaling") or params)
        full.setdefault("rope_theta", config.get("rope_theta"))
        local = {"rope_theta": config.get("rope_local_base_freq")}
    kinds = {kind: p.get("rope_type", p.get("type", "default")) for kind, p in ((FULL, full), (SLIDING, local))}
    if kinds[SLIDING] != "default" or kinds[FULL] not in ("default", "linear"):
        raise ValueError(f"Gemma 3 RoPE types {kinds} are not supported (global: default or linear; local: default)")
    factor = float(full["factor"]) if kinds[FULL] == "linear" else 1.0
    return (float(full.get("rope_theta") or DEFAULTS["rope_theta"]), factor,
            float(local.get("rope_theta") or DEFAULTS["rope_local_base_freq"]))


def whole(value: float) -> float | int:
    """An integral value as an int: transformers' strict configs type some of these as int."""
    return int(value) if float(value).is_integer() else value


# Per token, a Gemma 3 block's tensors alive during its recompute and backward, in units of the
# compute dtype, from the Llama fit (models/llama.py: 13 x hidden + 1 x intermediate, measured on
# the H100) plus what Gemma adds: two more hidden-size norms (post-attention, post-feedforward),
# each keeping its fp32 input (2 units) and its output (1); the QK norms keep fp32 copies of q and
# k (2 units each, beside the Llama fit's bf16 q and k); and a sliding layer's (or a packed row's)
# explicit mask, seq_len bytes per token as booleans and again in the compute dtype as SDPA's
# additive mask, beside keys and values repeated to every head (ops.masked_attention_bytes). An
# estimate until measured (`megatrain-ray bench` reports the peak).
EXTRA_NORMS_PER_HIDDEN = 2 * 3


class Gemma3Family(ModelFamily):
    model_types = ("gemma3_text",)
    arch_type = Gemma3Arch
    # read from config.json over transformers' Gemma3TextConfig defaults (DEFAULTS)
    hf_fields = DECODER_FIELDS + (
        HfField("query_pre_attn_scalar", "query_pre_attn_scalar", float, write=whole),
        HfField("sliding_window", "sliding_window"),
        HfField("final_logit_softcapping", "final_logit_softcapping", default=None),
        HfField("attn_logit_softcapping", "attn_logit_softcapping", default=None),
        HfField("pad_token_id", "pad_token_id"),
    )
    refused = {
        "gemma3": "it is the multimodal Gemma 3 (a vision tower beside the text model); megatrain-ray trains "
                  "Gemma 3 text models (gemma3_text). Save its text model first, then point model.path at it: "
                  "full = Gemma3ForConditionalGeneration.from_pretrained(DIR); "
                  "text = Gemma3ForCausalLM(full.config.text_config); "
                  "text.model.load_state_dict(full.model.language_model.state_dict()); text.save_pretrained(OUT)",
    }
    presets: dict[str, Gemma3Arch] = {
        # Tiny shape for CPU tests: one sliding and one global layer, a window shorter than a row.
        "tiny-gemma3": Gemma3Arch("gemma3_text", 256, 64, 128, 2, 4, 2, 16, qk_norm=True, tie_word_embeddings=True,
                                  rope_theta=1e6, query_pre_attn_scalar=24.0, sliding_window=8,
                                  layer_types=pattern_layer_types(2, 2), rope_linear_factor=8.0,
                                  max_position_embeddings=4096),
        # google/gemma-3-4b-it and -27b-it: their config.json text_config (hidden, intermediate, layers,
        # linear RoPE factor 8, window 1024; the 27b also heads 32, kv 16, head_dim 128, scalar 168), the
        # rest transformers' Gemma3TextConfig defaults (vocab 262208, heads 8, kv 4, head_dim 256, scalar
        # 256, rope_theta 1e6, local base 1e4, every 6th layer global, 131072 positions, eps 1e-6).
        "gemma-3-4b": Gemma3Arch("gemma3_text", 262208, 2560, 10240, 34, 8, 4, 256, qk_norm=True,
                                 tie_word_embeddings=True, rope_theta=1e6, query_pre_attn_scalar=256.0,
                                 sliding_window=1024, layer_types=pattern_layer_types(34, 6),
                                 rope_linear_factor=8.0, max_position_embeddings=131072),
        "gemma-3-27b": Gemma3Arch("gemma3_text", 262208, 5376, 21504, 62, 32, 16, 128, qk_norm=True,
                                  tie_word_embeddings=True, rope_theta=1e6, query_pre_attn_scalar=168.0,
                                  sliding_window=1024, layer_types=pattern_layer_types(62, 6),
                                  rope_linear_factor=8.0, max_position_embeddings=131072),
    }

    # -- shapes and names ------------------------------------------------------------------------
    def arch_from_hf(self, config: dict[str, Any]) -> Gemma3Arch:
        c = {**DEFAULTS, **config}
        if c["hidden_activation"] != "gelu_pytorch_tanh":
            raise ValueError(f"hidden_activation {c['hidden_activation']!r} is not supported (Gemma 3: gelu_pytorch_tanh)")
        if c.get("attention_bias"):
            raise ValueError("attention_bias: true is not supported (Gemma 3 has no attention biases)")
        if c.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention: true is not supported (causal language models only)")
        rope_theta, factor, local_base = rope_from_hf(config)
        return Gemma3Arch(
            model_type="gemma3_text",
            **read_fields(c, self.hf_fields),
            rope_theta=rope_theta,
            qk_norm=True,
            layer_types=tuple(c.get("layer_types") or pattern_layer_types(c["num_hidden_layers"],
                                                                          c["sliding_window_pattern"])),
            rope_local_base_freq=local_base,
            rope_linear_factor=factor,
        )

    def hf_config(self, arch: Gemma3Arch, torch_dtype: str) -> dict[str, Any]:
        return {
            "architectures": ["Gemma3ForCausalLM"],
            "model_type": "gemma3_text",
            **write_fields(arch, self.hf_fields),
            "hidden_activation": "gelu_pytorch_tanh",
            "attention_bias": False,
            "layer_types": list(arch.layer_types),
            # the flat RoPE keys, which transformers 4.5x and 5.x both read
            "rope_theta": arch.rope_theta,
            "rope_local_base_freq": arch.rope_local_base_freq,
            "rope_scaling": (None if arch.rope_linear_factor == 1.0
                             else {"rope_type": "linear", "factor": arch.rope_linear_factor}),
            "torch_dtype": torch_dtype,
        }

    def layouts(self, arch: Gemma3Arch) -> tuple[LayerLayout, ...]:
        return decoder_layouts(arch, lambda i: block_shapes(arch))

    def init_param(self, slot: ParamSlot, view: torch.Tensor, gen: torch.Generator, std: float) -> None:
        """As transformers: the (1 + w) norms start at w = 0 (a scale of one), matrices normal."""
        if slot.name.endswith("norm.weight"):
            view.zero_()
        else:
            view.normal_(0.0, std, generator=gen)

    # -- the stateless templates -----------------------------------------------------------------
    def context(self, arch: Gemma3Arch, position_ids: torch.Tensor, dtype: torch.dtype,
                packed: bool | None = None) -> GemmaContext:
        return gemma_context(arch, position_ids, dtype, packed)

    def layer_context(self, arch: Gemma3Arch, ctx: GemmaContext, layer: int) -> Rope:
        kind = arch.layer_types[layer - 1]
        cos, sin = ctx.tables[kind]
        window = arch.sliding_window if kind == SLIDING else None
        return Rope(cos, sin, ops.attention_mask(ctx.doc, cos.shape[1], window, cos.device))

    def embed(self, arch: Gemma3Arch, w: Weights, input_ids: torch.Tensor) -> torch.Tensor:
        return embed_forward(arch, w, input_ids)

    def block(self, arch: Gemma3Arch, w: Weights, x: torch.Tensor, ctx: Rope, mlp_chunk: int = 0) -> torch.Tensor:
        return block_forward(arch, w, x, ctx, mlp_chunk)

    def head_loss(self, arch: Gemma3Arch, head: Weights, embed: Weights | None, x: torch.Tensor,
                  labels: torch.Tensor, chunk_tokens: int, scale: float) -> torch.Tensor:
        hidden = gemma_norm(x, head["model.norm.weight"], arch.rms_norm_eps)
        return chunked_cross_entropy(arch, hidden, lm_head_weight(arch, head, embed), labels, chunk_tokens, scale)

    def logits(self, arch: Gemma3Arch, head: Weights, embed: Weights | None, x: torch.Tensor) -> torch.Tensor:
        hidden = gemma_norm(x, head["model.norm.weight"], arch.rms_norm_eps)
        return final_logits(arch, hidden, lm_head_weight(arch, head, embed))

    # -- what the planner and the benchmark count ----------------------------------------------
    def attention_flops_per_token(self, arch: Gemma3Arch, seq_len: int) -> float:
        """12 x heads x head_dim per key attended, fwd + bwd: seq/2 keys in a global layer (causal),
        at most the window in a sliding one (ops.window_key_count)."""
        keys = sum(ops.window_key_count(seq_len, arch.sliding_window if kind == SLIDING else None)
                   for kind in arch.layer_types)
        return 12 * keys * arch.num_heads * arch.head_dim

    def working_set_bytes(self, arch: Gemma3Arch, tokens: int, mlp_tokens: int, dtype_bytes: int) -> int:
        """The Llama fit plus Gemma's extra norms, fp32 q/k of the QK norms and a window mask
        (see EXTRA_NORMS_PER_HIDDEN). `tokens` is one micro-batch; its rows are at most that long,
        so the mask is bounded by tokens^2 bytes (exact for one row a micro-batch)."""
        per_h, per_i = WORKING_SET_PER_TOKEN
        qk_fp32 = 2 * (arch.num_heads + arch.num_kv_heads) * arch.head_dim
        units = tokens * ((per_h + EXTRA_NORMS_PER_HIDDEN) * arch.hidden_size + qk_fp32) + mlp_tokens * per_i * arch.intermediate_size
        masked = arch.sliding_window is not None and arch.sliding_window < tokens
        mask = ops.masked_attention_bytes(tokens, tokens, arch.num_heads, arch.num_kv_heads, arch.head_dim,
                                          dtype_bytes) if masked else 0
        return units * dtype_bytes + mask


GEMMA3 = Gemma3Family()
