"""The Mixtral family (`mixtral`): Mistral attention, every MLP a mixture of SwiGLU experts.

The first mixture-of-experts family; qwen3_moe.py and gpt_oss.py change what differs. The
block's arithmetic is models/moe.py's; this file says the names, shapes and routing.

Tensor names: the layout uses transformers 5's module names (the router `mlp.gate.weight`, the
experts stacked as `mlp.experts.gate_up_proj` [E, 2 x intermediate, hidden] and
`mlp.experts.down_proj` [E, hidden, intermediate]), which is what the executor computes with.
Checkpoint files hold what the released Mixtral checkpoints hold and what transformers 5's
save_pretrained writes: `block_sparse_moe.gate.weight` and per expert
`block_sparse_moe.experts.N.w1/w3/w2.weight` (gate, up, down); transformers 5 loads them through
its conversion mapping. Import reads that layout, export writes it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F

from megatrain_ray.models import moe
from megatrain_ray.models.arch import ModelArch
from megatrain_ray.models.family import ModelFamily, Weights
from megatrain_ray.models.hf_adapter import DECODER_FIELDS, read_fields, with_defaults, write_fields
from megatrain_ray.models.layout import LayerLayout, ParamSlot, Shapes, decoder_layouts
from megatrain_ray.models.llama import (
    Rope, attention, chunked_cross_entropy, chunked_mlp, embed_forward, final_norm, lm_head_weight, mlp,
    rms_norm, rope_context, rope_scaling_from_hf,
)
from megatrain_ray.models.moe import MOE_FIELDS, MoeArch


def attention_shapes(arch: ModelArch) -> Shapes:
    h, hd = arch.hidden_size, arch.head_dim
    q, kv = arch.num_heads * hd, arch.num_kv_heads * hd
    shapes: Shapes = [("input_layernorm.weight", (h,))]
    for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
        shapes.append((f"self_attn.{name}.weight", (rows, h)))
        if arch.qkv_bias:
            shapes.append((f"self_attn.{name}.bias", (rows,)))
    shapes.append(("self_attn.o_proj.weight", (h, q)))
    if arch.qk_norm:
        shapes += [("self_attn.q_norm.weight", (hd,)), ("self_attn.k_norm.weight", (hd,))]
    return shapes + [("post_attention_layernorm.weight", (h,))]


def swiglu_expert_shapes(arch: MoeArch) -> Shapes:
    e, h, i = arch.num_experts, arch.hidden_size, arch.expert_size
    return [("mlp.gate.weight", (e, h)), ("mlp.experts.gate_up_proj", (e, 2 * i, h)),
            ("mlp.experts.down_proj", (e, h, i))]


def refuse_sliding_window(config: dict[str, Any]) -> None:
    window = config.get("sliding_window") if config.get("use_sliding_window", True) else None
    if window is not None:
        raise ValueError(f"{config['model_type']}: sliding_window {window} is not supported (only full attention)")


class MixtralFamily(ModelFamily):
    model_types: tuple[str, ...] = ("mixtral",)
    arch_type = MoeArch
    hf_class = "MixtralForCausalLM"
    hf_fields = with_defaults(DECODER_FIELDS, rms_norm_eps=1e-5) + MOE_FIELDS
    fixed_fields: dict[str, Any] = {}  # arch fields its config.json does not say (a family's constants)
    # a layer tensor's name in memory -> the name checkpoint files store it under, or the names of
    # its pieces per expert e (one tensor per expert, its rows cut in order)
    stored_names: dict[str, str | tuple[str, ...]] = {
        "mlp.gate.weight": "block_sparse_moe.gate.weight",
        "mlp.experts.gate_up_proj": ("block_sparse_moe.experts.{e}.w1.weight",
                                     "block_sparse_moe.experts.{e}.w3.weight"),
        "mlp.experts.down_proj": ("block_sparse_moe.experts.{e}.w2.weight",),
    }
    presets: dict[str, ModelArch] = {
        "tiny-mixtral": MoeArch("mixtral", 256, 64, 128, 2, 4, 2, 16, rms_norm_eps=1e-5, rope_theta=1e6,
                                num_experts=4, num_experts_per_tok=2),
        # mistralai/Mixtral-8x7B-v0.1 config.json
        "mixtral-8x7b": MoeArch("mixtral", 32000, 4096, 14336, 32, 32, 8, 128, rms_norm_eps=1e-5, rope_theta=1e6,
                                max_position_embeddings=32768, num_experts=8, num_experts_per_tok=2,
                                router_aux_loss_coef=0.02),
    }

    # -- shapes and names ------------------------------------------------------------------------
    def arch_from_hf(self, config: dict[str, Any]) -> MoeArch:
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config['hidden_act']!r} is not supported (only silu)")
        self.refuse(config)
        rope_scaling, rope_theta = rope_scaling_from_hf(config)
        return self.arch_type(model_type=config["model_type"], **read_fields(config, self.hf_fields),
                              rope_theta=rope_theta, rope_scaling=rope_scaling, **self.fixed_fields)

    def refuse(self, config: dict[str, Any]) -> None:
        """ValueError for what its config.json may say that the templates do not run."""
        refuse_sliding_window(config)
        if float(config.get("router_jitter_noise") or 0.0) != 0.0:
            raise ValueError("router_jitter_noise is not supported (only 0)")

    def hf_config(self, arch: MoeArch, torch_dtype: str) -> dict[str, Any]:
        config = {
            "architectures": [self.hf_class], "model_type": arch.model_type, "hidden_act": "silu",
            "rope_theta": arch.rope_theta, "sliding_window": None, "torch_dtype": torch_dtype,
            **write_fields(arch, self.hf_fields),
        }
        if arch.rope_scaling is not None:
            config["rope_scaling"] = {"rope_type": "llama3", **dataclasses.asdict(arch.rope_scaling)}
        return config

    def block_shapes(self, arch: MoeArch, layer: int) -> Shapes:
        return attention_shapes(arch) + swiglu_expert_shapes(arch)

    def stored(self, arch: MoeArch, slot: ParamSlot) -> ParamSlot:
        """Checkpoint names (see the module docstring), by the family's table (stored_names)."""
        names = self.stored_names.get(slot.name)
        if names is None:
            return slot
        if isinstance(names, str):
            return moe.stored_as(slot, names)
        return moe.stored_per_expert(slot, lambda e: [name.format(e=e) for name in names])

    def dense_equivalent(self, arch: MoeArch) -> ModelArch:
        return arch.dense_equivalent()

    def layouts(self, arch: MoeArch) -> tuple[LayerLayout, ...]:
        return decoder_layouts(arch, lambda i: self.block_shapes(arch, i), lambda s: self.stored(arch, s))

    # -- the stateless templates -----------------------------------------------------------------
    def context(self, arch: MoeArch, position_ids: torch.Tensor, dtype: torch.dtype, packed: bool | None = None) -> Any:
        return rope_context(arch, position_ids, dtype, packed)

    def embed(self, arch: MoeArch, w: Weights, input_ids: torch.Tensor) -> torch.Tensor:
        return embed_forward(w, input_ids)

    def norm(self, arch: MoeArch, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, weight, arch.rms_norm_eps)

    def attention(self, arch: MoeArch, w: Weights, x: torch.Tensor, ctx: Rope) -> torch.Tensor:
        return attention(arch, w, x, ctx)

    def route(self, arch: MoeArch, w: Weights, flat: torch.Tensor):
        logits = F.linear(flat, w["mlp.gate.weight"])
        weights, experts = moe.softmax_topk(logits, arch.num_experts_per_tok, normalize=True)
        return logits, weights, experts  # fp32 weights, as transformers' Mixtral router keeps them

    def experts(self, arch: MoeArch, w: Weights, rows: torch.Tensor, d: moe.Dispatch) -> torch.Tensor:
        return moe.swiglu_experts(w, rows, d)

    def block(self, arch: MoeArch, w: Weights, x: torch.Tensor, ctx: Any, mlp_chunk: int = 0, aux: bool = False):
        """A decoder layer; with `aux`, (output, router load stats or None) for the auxiliary loss."""
        x = x + self.attention(arch, w, self.norm(arch, x, w["input_layernorm.weight"]), ctx)
        h = self.norm(arch, x, w["post_attention_layernorm.weight"])
        stats = None
        if "mlp.experts.gate_up_proj" in w:
            y, stats = moe.sparse_mlp(arch, w, h, lambda w_, f: self.route(arch, w_, f),
                                      lambda w_, r, d: self.experts(arch, w_, r, d), aux, mlp_chunk)
        elif 0 < mlp_chunk < h.shape[0] * h.shape[1]:
            y = chunked_mlp(w, h, mlp_chunk)
        else:
            y = mlp(w, h)
        return (x + y, stats) if aux else x + y

    def final_norm(self, arch: MoeArch, head: Weights, x: torch.Tensor) -> torch.Tensor:
        return final_norm(arch, head, x)

    def head_loss(self, arch: MoeArch, head: Weights, embed: Weights | None, x: torch.Tensor,
                  labels: torch.Tensor, chunk_tokens: int, scale: float) -> torch.Tensor:
        hidden = self.final_norm(arch, head, x)
        return chunked_cross_entropy(hidden, lm_head_weight(arch, head, embed), labels, chunk_tokens, scale)

    def logits(self, arch: MoeArch, head: Weights, embed: Weights | None, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.final_norm(arch, head, x), lm_head_weight(arch, head, embed))

    # -- the router's auxiliary loss (models/family.py, ModelFamily.aux_loss_on) -----------------
    def aux_loss_on(self, arch: MoeArch) -> bool:
        return arch.aux_loss_coef > 0 and arch.sparse_layers() > 0

    def aux_loss_term(self, arch: MoeArch, stats: torch.Tensor, totals: torch.Tensor) -> torch.Tensor:
        return moe.aux_loss_term(arch, stats, totals)

    # -- what the planner and the benchmark count ----------------------------------------------
    def inactive_params(self, arch: MoeArch) -> int:
        return moe.inactive_params(arch, self.layouts(arch))

    def matmul_params(self, arch: MoeArch) -> int:
        """Active parameters: a token's k experts, not all E."""
        return moe.matmul_params(arch, self.layouts(arch))

    def working_set_bytes(self, arch: MoeArch, tokens: int, mlp_tokens: int, dtype_bytes: int) -> int:
        return moe.working_set_bytes(arch, tokens, mlp_tokens, dtype_bytes)


MIXTRAL = MixtralFamily()
