"""The Qwen3-MoE family (`qwen3_moe`): Qwen3 attention (q/k RMSNorm per head), mixtures of SwiGLU
experts, dense MLP layers where `mlp_only_layers` / `decoder_sparse_step` say so, and routing
weights renormalised only with `norm_topk_prob`.

Tensor names: in memory (the layout) transformers 5's `mlp.gate.weight` and stacked
`mlp.experts.gate_up_proj` / `mlp.experts.down_proj`; in checkpoint files, as the released Qwen3
MoE checkpoints and transformers 5's save_pretrained have them, one tensor per expert:
`mlp.experts.N.gate_proj/up_proj/down_proj.weight`. Dense layers are a Qwen3 MLP
(`mlp.gate_proj/up_proj/down_proj.weight`, of `intermediate_size`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from megatrain_ray.models import moe
from megatrain_ray.models.arch import ModelArch
from megatrain_ray.models.family import Weights
from megatrain_ray.models.layout import ParamSlot, Shapes
from megatrain_ray.models.llama import WORKING_SET_PER_TOKEN as DENSE_WORKING_SET
from megatrain_ray.models.mixtral import MixtralFamily, attention_shapes, refuse_sliding_window, swiglu_expert_shapes
from megatrain_ray.models.moe import MoeArch


def qwen3_moe(vocab, hidden, dense_inter, layers, heads, kv_heads, experts, expert_inter, **kw) -> MoeArch:
    return MoeArch("qwen3_moe", vocab, hidden, dense_inter, layers, heads, kv_heads, kw.pop("head_dim", 128),
                   qk_norm=True, rope_theta=kw.pop("rope_theta", 1e6), num_experts=experts, num_experts_per_tok=8,
                   moe_intermediate_size=expert_inter, norm_topk_prob=True, **kw)


class Qwen3MoeFamily(MixtralFamily):
    model_types = ("qwen3_moe",)
    hf_class = "Qwen3MoeForCausalLM"
    presets: dict[str, ModelArch] = {
        "tiny-qwen3-moe": MoeArch("qwen3_moe", 256, 64, 128, 2, 4, 2, 16, qk_norm=True, rope_theta=1e6,
                                  num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=(1,)),
        # Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B config.json
        "qwen3-30b-a3b": qwen3_moe(151936, 2048, 6144, 48, 32, 4, 128, 768, max_position_embeddings=40960),
        "qwen3-235b-a22b": qwen3_moe(151936, 4096, 12288, 94, 64, 4, 128, 1536, max_position_embeddings=40960),
        # The benchmark's MoE (examples/benchmarks/2026-11-23-h100.md, "Mixture of experts"): 7.0 B parameters, 14 bytes each fit
        # 128 GiB of host memory. Qwen3-30B-A3B's attention and router, 64 of its experts
        # (top 8 of 768 each), 20 layers; 1.4 B active parameters per token.
        "qwen3-moe-7b": qwen3_moe(151936, 2048, 6144, 20, 32, 4, 64, 768, max_position_embeddings=40960),
    }

    def arch_from_hf(self, config: dict[str, Any]) -> MoeArch:
        arch = super().arch_from_hf(config)
        return arch.replace(
            qk_norm=True, qkv_bias=bool(config.get("attention_bias", False)),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            moe_intermediate_size=int(config["moe_intermediate_size"]),
            norm_topk_prob=bool(config.get("norm_topk_prob", False)),
            decoder_sparse_step=int(config.get("decoder_sparse_step", 1)),
            mlp_only_layers=tuple(config.get("mlp_only_layers") or ()),
        )

    def moe_fields_from_hf(self, config: dict[str, Any]) -> dict[str, Any]:
        refuse_sliding_window(config)
        return moe.moe_fields_from_hf(config)

    def hf_config(self, arch: MoeArch, torch_dtype: str) -> dict[str, Any]:
        config = super().hf_config(arch, torch_dtype)
        config.update(
            attention_bias=arch.qkv_bias, moe_intermediate_size=arch.moe_intermediate_size,
            norm_topk_prob=arch.norm_topk_prob, decoder_sparse_step=arch.decoder_sparse_step,
            mlp_only_layers=list(arch.mlp_only_layers), use_sliding_window=False, num_experts=arch.num_experts,
        )
        del config["num_local_experts"]
        return config

    def block_shapes(self, arch: MoeArch, layer: int) -> Shapes:
        if arch.is_sparse(layer):
            return attention_shapes(arch) + swiglu_expert_shapes(arch)
        h, i = arch.hidden_size, arch.intermediate_size
        return attention_shapes(arch) + [("mlp.gate_proj.weight", (i, h)), ("mlp.up_proj.weight", (i, h)),
                                         ("mlp.down_proj.weight", (h, i))]

    def stored(self, arch: MoeArch, slot: ParamSlot) -> ParamSlot:
        if slot.name == "mlp.experts.gate_up_proj":
            return moe.stored_per_expert(slot, lambda e: [f"mlp.experts.{e}.gate_proj.weight",
                                                          f"mlp.experts.{e}.up_proj.weight"])
        if slot.name == "mlp.experts.down_proj":
            return moe.stored_per_expert(slot, lambda e: [f"mlp.experts.{e}.down_proj.weight"])
        return slot

    def route(self, arch: MoeArch, w: Weights, flat: torch.Tensor):
        logits = F.linear(flat, w["mlp.gate.weight"])
        weights, experts = moe.softmax_topk(logits, arch.num_experts_per_tok, normalize=arch.norm_topk_prob)
        return logits, weights.to(logits.dtype), experts

    def working_set_bytes(self, arch: MoeArch, tokens: int, mlp_tokens: int, dtype_bytes: int) -> int:
        sparse = moe.working_set_bytes(arch, tokens, mlp_tokens, dtype_bytes)
        if arch.sparse_layers() == arch.num_layers:
            return sparse
        per_h, per_i = DENSE_WORKING_SET
        dense = (tokens * per_h * arch.hidden_size + mlp_tokens * per_i * arch.intermediate_size) * dtype_bytes
        return max(sparse, dense)


QWEN3_MOE = Qwen3MoeFamily()
