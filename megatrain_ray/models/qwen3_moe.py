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
from megatrain_ray.models.hf_adapter import DECODER_FIELDS, HfField, without
from megatrain_ray.models.layout import Shapes
from megatrain_ray.models.llama import WORKING_SET_PER_TOKEN as DENSE_WORKING_SET
from megatrain_ray.models.mixtral import MixtralFamily, attention_shapes, refuse_sliding_window, swiglu_expert_shapes
from megatrain_ray.models.moe import MOE_FIELDS, MoeArch


def qwen3_moe(vocab, hidden, dense_inter, layers, heads, kv_heads, experts, expert_inter, **kw) -> MoeArch:
    return MoeArch("qwen3_moe", vocab, hidden, dense_inter, layers, heads, kv_heads, kw.pop("head_dim", 128),
                   qk_norm=True, rope_theta=kw.pop("rope_theta", 1e6), num_experts=experts, num_experts_per_tok=8,
                   moe_intermediate_size=expert_inter, norm_topk_prob=True, **kw)


class Qwen3MoeFamily(MixtralFamily):
    model_types = ("qwen3_moe",)
    hf_class = "Qwen3MoeForCausalLM"
    hf_fields = DECODER_FIELDS + (
        HfField("num_experts", "num_experts", int, also=("num_local_experts",)),
        *without(MOE_FIELDS, "num_experts"),
        HfField("qkv_bias", "attention_bias", bool, False),
        HfField("moe_intermediate_size", "moe_intermediate_size", int),
        HfField("norm_topk_prob", "norm_topk_prob", bool, False),
        HfField("decoder_sparse_step", "decoder_sparse_step", int, 1),
        HfField("mlp_only_layers", "mlp_only_layers", tuple, fallback=lambda read: (), write=list),
    )
    fixed_fields = {"qk_norm": True}
    stored_names = {
        "mlp.experts.gate_up_proj": ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight"),
        "mlp.experts.down_proj": ("mlp.experts.{e}.down_proj.weight",),
    }
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

    def refuse(self, config: dict[str, Any]) -> None:
        refuse_sliding_window(config)

    def hf_config(self, arch: MoeArch, torch_dtype: str) -> dict[str, Any]:
        return {**super().hf_config(arch, torch_dtype), "use_sliding_window": False}

    def block_shapes(self, arch: MoeArch, layer: int) -> Shapes:
        if arch.is_sparse(layer):
            return attention_shapes(arch) + swiglu_expert_shapes(arch)
        h, i = arch.hidden_size, arch.intermediate_size
        return attention_shapes(arch) + [("mlp.gate_proj.weight", (i, h)), ("mlp.up_proj.weight", (i, h)),
                                         ("mlp.down_proj.weight", (h, i))]

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
