"""The mixture-of-experts block shared by the MoE families (mixtral.py, qwen3_moe.py, gpt_oss.py).

A router scores every token against every expert; each token goes to its top-k experts, and
their outputs are mixed with the routing weights. The experts are computed grouped: the N x k
(token, expert) pairs are sorted by expert, so each expert's tokens are one contiguous slice,
and one grouped matmul (torch's grouped_mm: bf16 on CUDA) or a loop over the experts' slices
(elsewhere) runs every expert at once; nothing loops over tokens. All experts of a layer live in
that layer's flat buffer as stacked tensors (`mlp.experts.gate_up_proj` [E, ...]), so they stream
with their layer like any weight.

The router's load-balancing loss is transformers' `load_balancing_loss_func`: over all layers'
router logits of one forward call, E x sum_e f_e P_e with f_e the fraction of (token, top-k)
assignments that went to expert e and P_e its mean routing probability, both averaged over
layers and tokens together. Given the assignment counts (no gradient), it is linear in each
layer's probability sums, so each layer contributes `aux_loss_term` during its own backward
recompute once the forward has counted every layer's assignments (models/family.py says how).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from megatrain_ray.models.arch import ModelArch
from megatrain_ray.models.family import Weights
from megatrain_ray.models.hf_adapter import HfField
from megatrain_ray.models.layout import LayerLayout, ParamSlot
from megatrain_ray.models.layout import matmul_params as decoder_matmul_params


@dataclass(frozen=True)
class MoeArch(ModelArch):
    """A model whose MLPs are (some of them) mixtures of experts."""

    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 0  # one expert's intermediate size; 0: intermediate_size (Mixtral, GPT-OSS)
    norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum to 1
    decoder_sparse_step: int = 1  # Qwen3-MoE: every n-th layer is sparse ...
    mlp_only_layers: tuple[int, ...] = ()  # ... except these, which have a dense MLP
    router_aux_loss_coef: float = 0.001  # as config.json says; counted only with output_router_logits
    output_router_logits: bool = False
    loss_fields = ("router_aux_loss_coef", "output_router_logits")

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be within 1..num_experts "
                             f"({self.num_experts})")
        if self.decoder_sparse_step < 1 or self.moe_intermediate_size < 0 or self.router_aux_loss_coef < 0:
            raise ValueError("decoder_sparse_step must be >= 1, moe_intermediate_size and router_aux_loss_coef >= 0")

    @property
    def expert_size(self) -> int:
        return self.moe_intermediate_size or self.intermediate_size

    @property
    def aux_loss_coef(self) -> float:
        """The coefficient the loss uses: transformers adds the auxiliary loss only with output_router_logits."""
        return self.router_aux_loss_coef if self.output_router_logits else 0.0

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer `layer` (0-based) is a mixture of experts (transformers' rule)."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    def sparse_layers(self) -> int:
        return sum(self.is_sparse(i) for i in range(self.num_layers))

    def dense_equivalent(self) -> ModelArch:
        """A dense (Llama-family) shape with the same attention and as many active MLP parameters
        per token: what `bench --parts` compares a mixture-of-experts layer with."""
        return ModelArch(
            "qwen3" if self.qk_norm else "llama", self.vocab_size, self.hidden_size,
            self.num_experts_per_tok * self.expert_size, self.num_layers, self.num_heads, self.num_kv_heads,
            self.head_dim, self.rms_norm_eps, self.rope_theta, None, self.tie_word_embeddings, self.qkv_bias,
            self.qk_norm, self.max_position_embeddings,
        )


# The MoeArch fields every MoE config.json spells alike
MOE_FIELDS: tuple[HfField, ...] = (
    HfField("num_experts", "num_local_experts", int, also=("num_experts",)),
    HfField("num_experts_per_tok", "num_experts_per_tok", int, also=("experts_per_token",)),
    HfField("router_aux_loss_coef", "router_aux_loss_coef", float, 0.001),
    HfField("output_router_logits", "output_router_logits", bool, False),
)


# ---------------------------------------------------------------------------------------------
# Stored names: stacked in memory, one tensor per expert in checkpoint files
# ---------------------------------------------------------------------------------------------


def stored_per_expert(slot: ParamSlot, names: Callable[[int], list[str]]) -> ParamSlot:
    """A stacked [E, R, C] slot stored as len(names(e)) tensors per expert, each R/len rows of it."""
    experts, rows, cols = slot.shape
    parts = len(names(0))
    piece = rows // parts
    pieces = [ParamSlot(name, (piece, cols), slot.offset + (e * rows + j * piece) * cols)
              for e in range(experts) for j, name in enumerate(names(e))]
    return dataclasses.replace(slot, stored_as=tuple(pieces))


def stored_in_rows(slot: ParamSlot, pieces: list[tuple[str, tuple[int, ...]]]) -> ParamSlot:
    """A slot stored as consecutive pieces along its first dimension, (name, shape) in order."""
    out, offset = [], slot.offset
    for name, shape in pieces:
        out.append(ParamSlot(name, shape, offset))
        offset += math.prod(shape)
    return dataclasses.replace(slot, stored_as=tuple(out))


def stored_as(slot: ParamSlot, name: str) -> ParamSlot:
    return dataclasses.replace(slot, stored_as=(ParamSlot(name, slot.shape, slot.offset),))


# ---------------------------------------------------------------------------------------------
# Routing and grouped expert compute
# ---------------------------------------------------------------------------------------------


def softmax_topk(logits: torch.Tensor, k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral / Qwen3-MoE: softmax over all experts in fp32, the top k, optionally renormalised.
    Returns (weights [N, k] fp32, experts [N, k])."""
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


@dataclass
class Dispatch:
    """The N x k (token, expert) pairs sorted by expert: each expert's rows are one slice."""

    token: torch.Tensor  # [N*k] the token of each sorted row
    expert: torch.Tensor  # [N*k] its expert
    slot: torch.Tensor  # [N*k] its position in the token-major [N, k] order
    counts: torch.Tensor  # [E] rows per expert
    offsets: torch.Tensor  # [E] int32, the end of each expert's slice
    _bounds: list[int] | None = None

    @property
    def bounds(self) -> list[int]:
        """Slice ends on the host (one sync per dispatch): for the loop over experts."""
        if self._bounds is None:
            self._bounds = [0] + self.offsets.tolist()
        return self._bounds


def dispatch(experts: torch.Tensor, num_experts: int) -> Dispatch:
    k = experts.shape[-1]
    flat = experts.reshape(-1)
    slot = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # static shape, unlike bincount: compiles
    return Dispatch(slot // k, flat[slot], slot, counts, torch.cumsum(counts, 0).to(torch.int32))


def grouped_mm(x: torch.Tensor, w: torch.Tensor, d: Dispatch) -> torch.Tensor:
    """x [rows, K] sorted by expert, w [E, K, M] (a transposed view is fine) -> [rows, M]."""
    if x.is_cuda and x.dtype == torch.bfloat16 and hasattr(F, "grouped_mm"):
        return F.grouped_mm(x, w, offs=d.offsets)
    b = d.bounds
    outs = [x[b[e] : b[e + 1]] @ w[e] for e in range(w.shape[0]) if b[e + 1] > b[e]]
    return torch.cat(outs)


def combine(rows: torch.Tensor, weights: torch.Tensor, d: Dispatch, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Each token's k expert outputs, weighted and summed (transformers casts each weighted output
    to the hidden dtype before it adds them). Unsorting is a gather, not an atomic scatter-add."""
    weighted = (rows * weights.reshape(-1)[d.slot, None]).to(dtype)
    unsorted = weighted[torch.argsort(d.slot)]
    return unsorted.view(n, -1, rows.shape[-1]).sum(dim=1)


def load_stats(logits: torch.Tensor, d: Dispatch) -> torch.Tensor:
    """[2, E]: top-k assignments per expert (no gradient) and routing probabilities summed over tokens."""
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    return torch.stack([d.counts.to(torch.float32), probs.sum(dim=0)])


def aux_loss_term(arch: MoeArch, stats: torch.Tensor, totals: torch.Tensor) -> torch.Tensor:
    """One layer's share of coef x load_balancing_loss_func: E x sum_e C_e p_e / (layers x tokens)^2,
    with C the assignment counts of all layers (constants) and p this layer's probability sums."""
    counts = totals[0].detach()
    rows = counts.sum() / arch.num_experts_per_tok  # sparse layers x tokens
    return arch.aux_loss_coef * arch.num_experts * (counts * stats[1]).sum() / (rows * rows)


# A family's expert MLP: (weights, sorted rows [N*k, H], dispatch) -> expert outputs [N*k, H].
Experts = Callable[[Weights, torch.Tensor, Dispatch], torch.Tensor]
# A family's router: (weights, tokens [N, H]) -> (logits [N, E], weights [N, k], experts [N, k]).
Router = Callable[[Weights, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def moe_mlp(arch: MoeArch, w: Weights, h: torch.Tensor, router: Router, experts: Experts,
            want_stats: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The sparse MLP over tokens h [..., H]: (output like h, load stats or None)."""
    flat = h.reshape(-1, h.shape[-1])
    logits, weights, chosen = router(w, flat)
    d = dispatch(chosen, arch.num_experts)
    out = combine(experts(w, flat[d.token], d), weights, d, flat.shape[0], h.dtype).view(h.shape)
    return out, (load_stats(logits, d) if want_stats else None)


def chunked_moe_mlp(arch: MoeArch, w: Weights, h: torch.Tensor, router: Router, experts: Experts,
                    want_stats: bool, chunk_tokens: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The sparse MLP over chunks of tokens, each under a checkpoint (routing is per token, so the
    result is the same): for long sequences, one chunk's routed rows exist at a time."""
    flat = h.reshape(-1, h.shape[-1])
    outs, stats = [], None
    for start in range(0, flat.shape[0], chunk_tokens):
        piece = flat[start : start + chunk_tokens]
        args = (arch, w, piece, router, experts, want_stats)
        if torch.is_grad_enabled():
            out, s = torch.utils.checkpoint.checkpoint(moe_mlp, *args, use_reentrant=False)
        else:
            out, s = moe_mlp(*args)
        outs.append(out)
        stats = s if stats is None else stats + s
    return torch.cat(outs).view(h.shape), stats


def sparse_mlp(arch: MoeArch, w: Weights, h: torch.Tensor, router: Router, experts: Experts,
               want_stats: bool, mlp_chunk: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    if 0 < mlp_chunk < h.shape[0] * h.shape[1]:
        return chunked_moe_mlp(arch, w, h, router, experts, want_stats, mlp_chunk)
    return moe_mlp(arch, w, h, router, experts, want_stats)


def swiglu_experts(w: Weights, rows: torch.Tensor, d: Dispatch) -> torch.Tensor:
    """Mixtral / Qwen3-MoE experts: gate_up_proj [E, 2I, H] and down_proj [E, H, I], as nn.Linear weights."""
    gate, up = grouped_mm(rows, w["mlp.experts.gate_up_proj"].transpose(1, 2), d).chunk(2, dim=-1)
    return grouped_mm(F.silu(gate) * up, w["mlp.experts.down_proj"].transpose(1, 2), d)


# ---------------------------------------------------------------------------------------------
# What the planner and the benchmark count
# ---------------------------------------------------------------------------------------------


def is_expert_param(slot: ParamSlot) -> bool:
    return slot.name.startswith("mlp.experts.")


def inactive_params(arch: MoeArch, layouts: tuple[LayerLayout, ...]) -> int:
    """Expert parameters a token does not use: (E - k) / E of every stacked expert tensor."""
    stacked = sum(p.numel for layout in layouts for p in layout.params if is_expert_param(p))
    return stacked * (arch.num_experts - arch.num_experts_per_tok) // arch.num_experts


def active_layer_params(arch: ModelArch, layout: LayerLayout) -> int:
    """A layer's parameters that one token uses (all of them in a dense layer)."""
    if not isinstance(arch, MoeArch):
        return layout.numel
    return layout.numel - inactive_params(arch, (layout,))


def matmul_params(arch: MoeArch, layouts: tuple[LayerLayout, ...]) -> int:
    """Active parameters doing matmuls per token: all but the input embedding and the experts a
    token is not routed to (a tied head is a matmul and counted)."""
    return decoder_matmul_params(arch, layouts) - inactive_params(arch, layouts)


# Per token, alive during a block's recompute and backward, in units of the compute dtype:
# attention and norms as in the dense families (13 x hidden), and per routed (token, expert) row
# the gathered input and the weighted output (2 x hidden) and gate/up/activation (3 x expert
# size); the router's fp32 logits and probabilities (4 x experts). An estimate from the tensors
# autograd keeps, not fitted on the GPU like the dense families' constants.
WORKING_SET_PER_TOKEN = 13
WORKING_SET_PER_ROUTED_ROW = (2, 3)  # x hidden_size, x expert size


def working_set_bytes(arch: MoeArch, tokens: int, mlp_tokens: int, dtype_bytes: int) -> int:
    per_h, per_i = WORKING_SET_PER_ROUTED_ROW
    rows = mlp_tokens * arch.num_experts_per_tok
    routed = rows * (per_h * arch.hidden_size + per_i * arch.expert_size) * dtype_bytes
    return tokens * WORKING_SET_PER_TOKEN * arch.hidden_size * dtype_bytes + routed + mlp_tokens * arch.num_experts * 8
