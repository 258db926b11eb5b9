"""The GPT-OSS family (`gpt_oss`): attention with biases and a learned sink per head, sliding-window
and full attention layers alternating (`layer_types`), YaRN RoPE, and experts with biases and a
clamped SwiGLU; top-k over the router's logits (it has a bias), softmax over the chosen k.

Tensor names are transformers 5's and the released checkpoints' alike (`mlp.router.weight/bias`,
`mlp.experts.gate_up_proj` [E, hidden, 2 x intermediate] with gate and up interleaved,
`mlp.experts.down_proj` [E, intermediate, hidden] and their `_bias`, `self_attn.sinks`). The
released openai/gpt-oss-20b and -120b store the expert matrices MXFP4-quantized
(`*_blocks`/`*_scales`), which this importer does not read: start from a bf16 or fp32 checkpoint
(the export of one, or a dequantized copy).

Attention sinks ride on SDPA: the sink is one extra key, visible to every query, whose score is
the sink (an extra head dimension carries sink / scale on the queries and 1 on that key) and
whose value is 0; so softmax counts exp(sink) in its denominator and nothing in the output, as
transformers' eager attention does, and flash/efficient kernels still run.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from megatrain_ray.models import moe
from megatrain_ray.models.arch import ModelArch
from megatrain_ray.models.family import Weights
from megatrain_ray.models.hf_adapter import DECODER_FIELDS, HfField, read_fields, with_defaults
from megatrain_ray.models.layout import Shapes
from megatrain_ray.models.llama import _apply_rope, _linear, packed_causal_mask
from megatrain_ray.models.mixtral import MixtralFamily, attention_shapes
from megatrain_ray.models.moe import MOE_FIELDS, MoeArch

SLIDING, FULL = "sliding_attention", "full_attention"
SINK_DIMS = 8  # the extra head dimensions that carry the sink (8 keeps the head size a multiple of 8)


@dataclass(frozen=True)
class YarnRope:
    """rope_type 'yarn' as transformers computes it (modeling_rope_utils._compute_yarn_parameters)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None


@dataclass(frozen=True)
class GptOssArch(MoeArch):
    sliding_window: int | None = 128
    layer_types: tuple[str, ...] | None = None  # None: sliding, full, sliding, ... (transformers' default)
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    yarn: YarnRope | None = None  # None: plain RoPE

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.layer_types is not None:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
            if len(self.layer_types) != self.num_layers or set(self.layer_types) - {SLIDING, FULL}:
                raise ValueError(f"layer_types must name {self.num_layers} layers, each {SLIDING} or {FULL}")

    def layer_type(self, layer: int) -> str:
        if self.layer_types is not None:
            return self.layer_types[layer]
        return SLIDING if layer % 2 == 0 else FULL

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> "GptOssArch":
        fields = dict(fields)
        if fields.get("yarn"):
            fields["yarn"] = YarnRope(**fields["yarn"])
        return super().from_dict(fields)


def default_layer_types(n: int) -> list[str]:
    return [SLIDING if i % 2 == 0 else FULL for i in range(n)]


def gpt_oss(layers: int, experts: int) -> GptOssArch:
    """openai/gpt-oss-20b and -120b config.json: the same layer, 24 or 36 of them, 32 or 128 experts."""
    return GptOssArch("gpt_oss", 201088, 2880, 2880, layers, 64, 8, 64, rms_norm_eps=1e-5, rope_theta=150000.0,
                      qkv_bias=True, max_position_embeddings=131072, num_experts=experts, num_experts_per_tok=4,
                      router_aux_loss_coef=0.9, yarn=YarnRope(32.0, 4096, truncate=False))


# ---------------------------------------------------------------------------------------------
# RoPE (YaRN), attention with sinks, the clamped SwiGLU experts
# ---------------------------------------------------------------------------------------------


def yarn_frequencies(arch: GptOssArch, device: torch.device) -> tuple[torch.Tensor, float]:
    """(inverse frequencies, attention scaling of cos and sin), transformers' formulas."""
    dim, base, y = arch.head_dim, arch.rope_theta, arch.yarn
    pos_freqs = base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float) / dim)
    if y is None:
        return 1.0 / pos_freqs, 1.0

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = y.attention_factor
    if attention_factor is None:
        if y.mscale and y.mscale_all_dim:
            attention_factor = float(mscale(y.factor, y.mscale) / mscale(y.factor, y.mscale_all_dim))
        else:
            attention_factor = mscale(y.factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(y.original_max_position_embeddings / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(y.beta_fast or 32), correction_dim(y.beta_slow or 1)
    if y.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv = (1.0 / (y.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, attention_factor


@dataclass
class SinkContext:
    """What one block's attention needs: RoPE tables and the mask over the sink-padded sequence
    ([B or 1, 1, T+1, T+1] bool, row and column 0 the sink), None for plain causal attention."""

    cos: torch.Tensor
    sin: torch.Tensor
    mask: torch.Tensor | None


@dataclass
class GptOssContext:
    cos: torch.Tensor
    sin: torch.Tensor
    full: torch.Tensor | None
    sliding: torch.Tensor | None


def sink_padded(mask: torch.Tensor) -> torch.Tensor:
    """[B, 1, T, T] allowed-mask -> [B, 1, T+1, T+1] with the sink key visible to every query."""
    b, _, t, _ = mask.shape
    padded = torch.zeros(b, 1, t + 1, t + 1, dtype=torch.bool, device=mask.device)
    padded[:, :, :, 0] = True
    padded[:, :, 1:, 1:] = mask
    return padded


def attention_masks(arch: GptOssArch, position_ids: torch.Tensor,
                    packs: bool | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(full, sliding) sink-padded masks; None where is_causal alone is right. `packs` as
    ops.document_ids takes it."""
    t = position_ids.shape[1]
    packed = packed_causal_mask(position_ids, packs)
    full = None if packed is None else sink_padded(packed)
    window = arch.sliding_window
    uses_sliding = any(arch.layer_type(i) == SLIDING for i in range(arch.num_layers))
    if not uses_sliding or window is None or (t <= window and packed is None):
        return full, full
    i = torch.arange(t, device=position_ids.device)
    near = (i[:, None] - i[None, :]) < window
    base = packed if packed is not None else torch.ones(t, t, dtype=torch.bool, device=i.device).tril()[None, None]
    return full, sink_padded(base & near)


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                   mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """softmax over [scores, sink] without the sink's column, times v: q [B, H, T, D], k/v [B, KV, T, D]."""
    b, h, t, d = q.shape
    kv = k.shape[1]
    zeros = q.new_zeros
    sink_q = (sinks.to(q.dtype) / scale).view(1, h, 1, 1).expand(b, h, t, 1)
    q = torch.cat([zeros(b, h, 1, d + SINK_DIMS), torch.cat([q, sink_q, zeros(b, h, t, SINK_DIMS - 1)], -1)], 2)
    sink_k = torch.cat([zeros(b, kv, 1, d), q.new_ones(b, kv, 1, 1), zeros(b, kv, 1, SINK_DIMS - 1)], -1)
    k = torch.cat([sink_k, torch.cat([k, zeros(b, kv, t, SINK_DIMS)], -1)], 2)
    v = torch.cat([zeros(b, kv, 1, d + SINK_DIMS), torch.cat([v, zeros(b, kv, t, SINK_DIMS)], -1)], 2)
    if mask is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=h != kv)
    else:  # the memory-efficient kernel takes a mask but not grouped heads: repeat them
        k, v = k.repeat_interleave(h // kv, dim=1), v.repeat_interleave(h // kv, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out[:, :, 1:, :d]


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """GPT-OSS keeps its norms in fp32 and scales before casting back (transformers' GptOssRMSNorm)."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * x).to(dtype)


class GptOssFamily(MixtralFamily):
    model_types = ("gpt_oss",)
    arch_type = GptOssArch
    hf_class = "GptOssForCausalLM"
    hf_fields = with_defaults(DECODER_FIELDS, rms_norm_eps=1e-5, max_position_embeddings=131072) + MOE_FIELDS + (
        HfField("qkv_bias", "attention_bias", bool, True),
        HfField("sliding_window", "sliding_window", default=128),
        HfField("swiglu_alpha", "swiglu_alpha", float, 1.702),
        HfField("swiglu_limit", "swiglu_limit", float, 7.0),
    )
    presets: dict[str, ModelArch] = {
        "tiny-gpt-oss": GptOssArch("gpt_oss", 256, 64, 128, 2, 4, 2, 16, rms_norm_eps=1e-5, rope_theta=150000.0,
                                   qkv_bias=True, num_experts=4, num_experts_per_tok=2, sliding_window=4,
                                   yarn=YarnRope(32.0, 4096, truncate=False)),
        "gpt-oss-20b": gpt_oss(24, 32),
        "gpt-oss-120b": gpt_oss(36, 128),
    }

    # Kept graphs compile with the default partition: under the activation budget the backward of a
    # kept GPT-OSS block fed F.grouped_mm group sizes its CUDA kernel asserts on (torch 2.11, the GPU
    # case of tests/models/test_moe_parity.py); Mixtral and Qwen3-MoE ran.
    kept_activation_budget = None
    stored_names = {}  # its files hold the stacked tensors under their in-memory names

    # -- shapes and names ------------------------------------------------------------------------
    def arch_from_hf(self, config: dict[str, Any]) -> GptOssArch:
        if config.get("quantization_config"):
            raise ValueError("quantized GPT-OSS checkpoints (MXFP4 experts) are not supported: use a bf16 or fp32 one")
        n = config["num_hidden_layers"]
        layer_types = config.get("layer_types")
        scaling = config.get("rope_parameters") or config.get("rope_scaling") or {}
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type not in ("default", "yarn"):
            raise ValueError(f"rope scaling type {rope_type!r} is not supported for gpt_oss (default or yarn)")
        yarn = None
        if rope_type == "yarn":
            yarn = YarnRope(
                factor=float(scaling["factor"]),
                original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
                beta_fast=float(scaling.get("beta_fast") or 32.0), beta_slow=float(scaling.get("beta_slow") or 1.0),
                truncate=bool(scaling.get("truncate", True)), attention_factor=scaling.get("attention_factor"),
                mscale=scaling.get("mscale"), mscale_all_dim=scaling.get("mscale_all_dim"),
            )
        return GptOssArch(
            model_type="gpt_oss", **read_fields(config, self.hf_fields),
            rope_theta=float(config.get("rope_theta") or scaling.get("rope_theta") or 150000.0),
            layer_types=None if layer_types in (None, default_layer_types(n)) else tuple(layer_types), yarn=yarn,
        )

    def hf_config(self, arch: GptOssArch, torch_dtype: str) -> dict[str, Any]:
        config = super().hf_config(arch, torch_dtype)
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": arch.rope_theta}
        if arch.yarn is not None:
            rope = {"rope_type": "yarn", "rope_theta": arch.rope_theta,
                    **{k: v for k, v in dataclasses.asdict(arch.yarn).items() if v is not None}}
        config.update(layer_types=[arch.layer_type(i) for i in range(arch.num_layers)], rope_parameters=rope)
        del config["rope_theta"]
        return config

    def block_shapes(self, arch: GptOssArch, layer: int) -> Shapes:
        e, h, i = arch.num_experts, arch.hidden_size, arch.expert_size
        shapes = attention_shapes(arch)
        shapes.insert(shapes.index(("self_attn.o_proj.weight", (h, arch.num_heads * arch.head_dim))) + 1,
                      ("self_attn.o_proj.bias", (h,)))
        shapes.insert(1, ("self_attn.sinks", (arch.num_heads,)))
        return shapes + [("mlp.router.weight", (e, h)), ("mlp.router.bias", (e,)),
                         ("mlp.experts.gate_up_proj", (e, h, 2 * i)), ("mlp.experts.gate_up_proj_bias", (e, 2 * i)),
                         ("mlp.experts.down_proj", (e, i, h)), ("mlp.experts.down_proj_bias", (e, h))]

    # -- the stateless templates -----------------------------------------------------------------
    def context(self, arch: GptOssArch, position_ids: torch.Tensor, dtype: torch.dtype,
                packed: bool | None = None) -> GptOssContext:
        inv, scaling = yarn_frequencies(arch, position_ids.device)
        freqs = position_ids[..., None].float() * inv
        emb = torch.cat((freqs, freqs), dim=-1)
        full, sliding = attention_masks(arch, position_ids, packed)
        return GptOssContext((emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype), full, sliding)

    def layer_context(self, arch: GptOssArch, ctx: GptOssContext, layer: int) -> SinkContext:
        """Layout index `layer` (decoder layer layer - 1) attends over its window or everything."""
        mask = ctx.sliding if arch.layer_type(layer - 1) == SLIDING else ctx.full
        return SinkContext(ctx.cos, ctx.sin, mask)

    def norm(self, arch: GptOssArch, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, weight, arch.rms_norm_eps)

    def attention(self, arch: GptOssArch, w: Weights, x: torch.Tensor, ctx: SinkContext) -> torch.Tensor:
        b, t, _ = x.shape
        hd = arch.head_dim
        q = _linear(w, "self_attn.q_proj", x).view(b, t, arch.num_heads, hd).transpose(1, 2)
        k = _linear(w, "self_attn.k_proj", x).view(b, t, arch.num_kv_heads, hd).transpose(1, 2)
        v = _linear(w, "self_attn.v_proj", x).view(b, t, arch.num_kv_heads, hd).transpose(1, 2)
        q, k = _apply_rope(q, ctx), _apply_rope(k, ctx)
        out = sink_attention(q, k, v, w["self_attn.sinks"], ctx.mask, hd**-0.5)
        return _linear(w, "self_attn.o_proj", out.transpose(1, 2).reshape(b, t, arch.num_heads * hd))

    def route(self, arch: GptOssArch, w: Weights, flat: torch.Tensor):
        logits = F.linear(flat, w["mlp.router.weight"], w["mlp.router.bias"])
        top, experts = torch.topk(logits, arch.num_experts_per_tok, dim=-1)
        return logits, F.softmax(top, dim=1, dtype=top.dtype), experts

    def experts(self, arch: GptOssArch, w: Weights, rows: torch.Tensor, d: moe.Dispatch) -> torch.Tensor:
        gate_up = moe.grouped_mm(rows, w["mlp.experts.gate_up_proj"], d) + w["mlp.experts.gate_up_proj_bias"][d.expert]
        act = clamped_swiglu(gate_up, arch.swiglu_alpha, arch.swiglu_limit)
        return moe.grouped_mm(act, w["mlp.experts.down_proj"], d) + w["mlp.experts.down_proj_bias"][d.expert]

    def final_norm(self, arch: GptOssArch, head: Weights, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, head["model.norm.weight"], arch.rms_norm_eps)

    # -- what the planner and the benchmark count ----------------------------------------------
    def attention_flops_per_token(self, arch: GptOssArch, seq_len: int) -> float:
        """Causal attention over the whole sequence on full layers, over the window on sliding ones."""
        per_key = 12 * arch.num_heads * arch.head_dim
        full_keys = seq_len / 2
        w = arch.sliding_window or seq_len
        window_keys = full_keys if seq_len <= w else (w * (w + 1) / 2 + (seq_len - w) * w) / seq_len
        return sum(per_key * (window_keys if arch.layer_type(i) == SLIDING else full_keys)
                   for i in range(arch.num_layers))


GPT_OSS = GptOssFamily()
