"""AdamW over a layer's flat fp32 buffers, the LR schedule and the clipping coefficient.

The update is torch.optim.AdamW's, decoupled weight decay applied to matrices only. `adamw_step`
runs it as one pass (host/adamw_kernel.py's kernel); where that kernel cannot be built, `adamw_update`
runs torch's fused AdamW in cache-sized chunks: gradient upcast, update, weight cast. The GPU's
step of the embedding (streaming/device_step.py) runs `adamw_update` on the device. Lean state
(host/precision.py) takes the kernel's second op, or `lean_update` without it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatrain_ray.config import OptimConfig
from megatrain_ray.host import precision
from megatrain_ray.host.adamw_kernel import native_kernel
from megatrain_ray.host.muon import MuonStep, muon_step

CHUNK_ELEMENTS = 1 << 22  # 16 MiB of fp32 per pass: few thread-pool rounds, still cache-friendly; whole int8 blocks


def lr_factor(update: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Linear warmup then cosine decay to min_ratio; `update` counts from 0 like LambdaLR."""
    if warmup_steps > 0 and update < warmup_steps:
        return (update + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (update - warmup_steps) / decay_steps)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def learning_rate(cfg: OptimConfig, update: int, total_steps: int) -> float:
    return cfg.lr * lr_factor(update, cfg.warmup_steps, total_steps, cfg.min_lr_ratio)


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_'s factor: shrink only when the norm exceeds max_norm."""
    if max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))


@dataclass(frozen=True)
class AdamWStep:
    """One update's hyper-parameters, sent to every store (a small message)."""

    lr_position: int  # 1-based position in the LR schedule; the stores count their own updates for bias correction
    lr: float
    grad_scale: float  # the clipping coefficient
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    muon: MuonStep | None = None  # optim.name muon: the blocks' matrices' step (host/muon.py)


def segments_within(segments: list[tuple[int, int, bool]], lo: int, hi: int) -> list[tuple[int, int, bool]]:
    """A layer's parameter segments cut to its elements [lo, hi), counted from lo (a piece's, adamw_step)."""
    return [(max(start, lo) - lo, min(end, hi) - lo, decays) for start, end, decays in segments if start < hi and end > lo]


def adamw_step(
    master: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grad_weights: torch.Tensor,
    segments: list[tuple[int, int, bool]],
    hp: AdamWStep,
    step: int,
    one_pass: bool = True,
    *,
    grad: torch.Tensor | None = None,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    rounding_key: int = 0,
    offset: int = 0,
) -> str:
    """Update `master` and the moments from the gradient in `grad_weights`, then write the new
    compute-dtype weights over it: one pass in the native kernel, or torch's fused AdamW in three
    where the kernel could not be built (or `one_pass` is False, for comparisons). Returns the path
    that ran: "native" or "torch".

    `segments` are (start, end, decays) ranges of the flat buffer, one per parameter, in order;
    `step` is the layer's 1-based update count, for Adam's bias correction.

    Lean state (host/precision.py) is told by its dtypes: bf16 or int8/uint8 moments (int8 with
    their block `scales`), or a bf16 master, which is itself the compute copy: pass it as
    `grad_weights` too, with the gradient in its own buffer `grad`, and the update's `rounding_key`.

    The buffers may be a piece of a layer's (host/store.py, `update_piece`), its `segments` then
    counted from the piece's start; `offset` is that start's index in the layer, a multiple of
    precision.QUANT_BLOCK: a bf16 master's rounding noise follows the element's index in its layer and
    int8 moments' scales their blocks, so a layer updated piece by piece ends bit for bit as in one call.
    """
    if offset % precision.QUANT_BLOCK:
        raise ValueError(f"a piece of a layer starts at a multiple of {precision.QUANT_BLOCK} elements, not {offset}")
    ends, at = [], 0
    for start, end, _ in segments:
        if start != at:
            raise ValueError(f"parameter segments must tile the buffer in order: one starts at {start}, not {at}")
        ends.append(end)
        at = end
    if at != master.numel():
        raise ValueError(f"parameter segments must tile the buffer: they end at {at}, it has {master.numel()} elements")
    bf16_master = master.dtype == torch.bfloat16
    if bf16_master and (grad is None or grad_weights is not master):
        raise ValueError("a bf16 master is its own compute copy (grad_weights) and needs a gradient buffer (grad)")
    exact = master.dtype == torch.float32 and exp_avg.dtype == torch.float32 and grad is None
    kernel = native_kernel() if one_pass else None
    if kernel is None:
        if exact:
            adamw_update(master, grad_weights, exp_avg, exp_avg_sq, segments, hp, step, compute_copy=grad_weights)
        else:
            lean_update(master, exp_avg, exp_avg_sq, scales, grad if bf16_master else grad_weights,
                        None if bf16_master else grad_weights, segments, hp, step, rounding_key, offset=offset)
        return "torch"
    decays = [1.0 - hp.lr * hp.weight_decay if decays_here else 1.0 for _, _, decays_here in segments]
    beta1, beta2 = hp.betas
    scalars = (hp.grad_scale, beta1, beta2, (1 - beta2**step) ** 0.5, hp.eps, hp.lr / (1 - beta1**step))
    if exact:
        kernel.adamw_step(master, exp_avg, exp_avg_sq, grad_weights, ends, decays, *scalars)
        return "native"
    m_scale, v_scale = scales if scales is not None else (None, None)
    kernel.adamw_step_lean(master, exp_avg, exp_avg_sq, m_scale, v_scale, grad if bf16_master else grad_weights,
                           None if bf16_master else grad_weights, ends, decays, *scalars, rounding_key, offset)
    return "native"


def lean_update(
    master: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor] | None,
    grad: torch.Tensor,
    weights: torch.Tensor | None,
    segments: list[tuple[int, int, bool]],
    hp: AdamWStep,
    step: int,
    rounding_key: int,
    chunk: int = CHUNK_ELEMENTS,
    offset: int = 0,
) -> None:
    """The lean modes without the kernel: each chunk (whole int8 blocks) widened to fp32, stepped by
    torch's fused AdamW segment by segment, and narrowed again as host/precision.py defines it.
    `offset`: the buffers' first element's index in its layer (adamw_step)."""
    n = master.numel()
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        p = master[lo:hi].to(torch.float32)
        g = grad[lo:hi].to(torch.float32)
        m, v = _widen_moments(exp_avg, exp_avg_sq, scales, lo, hi)
        for start, end, decays in segments:
            a, b = max(lo, start), min(hi, end)
            if a < b:
                s = slice(a - lo, b - lo)
                _adam_chunk(p[s], g[s], m[s], v[s], hp, step, hp.weight_decay if decays else 0.0)
        _narrow_moments(m, v, exp_avg, exp_avg_sq, scales, lo, hi)
        if master.dtype == torch.bfloat16:
            master[lo:hi].copy_(precision.stochastic_round_bf16(p, rounding_key, offset + lo))
        else:
            master[lo:hi].copy_(p)
            weights[lo:hi].copy_(p)


def _widen_moments(m, v, scales, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    if m.dtype == torch.int8:
        b0, b1 = lo // precision.QUANT_BLOCK, precision.num_blocks(hi)
        return (precision.dequantize_signed(m[lo:hi], scales[0][b0:b1]),
                precision.dequantize_sqrt(v[lo:hi], scales[1][b0:b1]))
    return m[lo:hi].to(torch.float32), v[lo:hi].to(torch.float32)


def _narrow_moments(m32, v32, m, v, scales, lo: int, hi: int) -> None:
    if m.dtype == torch.int8:
        b0, b1 = lo // precision.QUANT_BLOCK, precision.num_blocks(hi)
        qm, sm = precision.quantize_signed(m32)
        qv, sv = precision.quantize_sqrt(v32)
        m[lo:hi], scales[0][b0:b1], v[lo:hi], scales[1][b0:b1] = qm, sm, qv, sv
    else:
        m[lo:hi].copy_(m32)
        v[lo:hi].copy_(v32)


def _has_fused_adamw(device: torch.device) -> bool:
    """torch's fused AdamW: on CUDA since torch 2.0, on the CPU since 2.4."""
    return hasattr(torch, "_fused_adamw_") and device.type in ("cpu", "cuda")


def adamw_update(
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    segments: list[tuple[int, int, bool]],
    hp: AdamWStep,
    step: int,
    compute_copy: torch.Tensor | None = None,
    chunk: int = CHUNK_ELEMENTS,
) -> None:
    """Update `master` in place from `grad` (any float dtype) and refresh `compute_copy`;
    `step` is the layer's 1-based update count, for Adam's bias correction.

    `segments` are (start, end, decays) ranges of the flat buffer, one per parameter, so that
    weight decay rides inside the fused kernel instead of costing a pass of its own. `grad` may
    be `compute_copy` itself: each chunk of gradient is read before it is overwritten.
    """
    scratch = (torch.empty(min(master.numel(), chunk), dtype=torch.float32, device=master.device)
               if grad.dtype != torch.float32 else None)
    for start, end, decays in segments:
        wd = hp.weight_decay if decays else 0.0
        for lo in range(start, end, chunk):
            hi = min(end, lo + chunk)
            g = grad[lo:hi] if scratch is None else scratch[: hi - lo].copy_(grad[lo:hi])
            _adam_chunk(master[lo:hi], g, exp_avg[lo:hi], exp_avg_sq[lo:hi], hp, step, wd)
            if compute_copy is not None:
                compute_copy[lo:hi].copy_(master[lo:hi])


def _adam_chunk(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, hp: AdamWStep, step: int,
                wd: float) -> None:
    """The clipping factor rides along as the fused kernel's grad_scale (it divides by it)."""
    beta1, beta2 = hp.betas
    if _has_fused_adamw(p.device):
        torch._fused_adamw_(
            [p], [g], [m], [v], [], [torch.tensor(float(step), device=p.device)],
            lr=hp.lr, beta1=beta1, beta2=beta2, weight_decay=wd, eps=hp.eps, amsgrad=False, maximize=False,
            grad_scale=torch.tensor(1.0 / hp.grad_scale, device=p.device) if hp.grad_scale != 1.0 else None,
        )
        return
    p.mul_(1.0 - hp.lr * wd)
    g = g * hp.grad_scale
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bias1 = 1 - beta1**step
    bias2 = 1 - beta2**step
    denom = (v.sqrt() / math.sqrt(bias2)).add_(hp.eps)
    p.addcdiv_(m, denom, value=-hp.lr / bias1)


class LrSchedule:
    """Turns a step's gradient norm into that step's AdamW message (its LR, its clipping); counts
    the updates done, the schedule's position. The schedule spans optim.schedule_steps where set
    (a resumed run keeps its checkpoint's: files/checkpoint.schedule_on_resume), else `total_steps`."""

    def __init__(self, cfg: OptimConfig, total_steps: int, updates_done: int = 0):
        self.cfg = cfg
        self.total_steps = cfg.schedule_steps or total_steps
        self.updates_done = updates_done

    def next(self, grad_norm: float) -> AdamWStep:
        cfg = self.cfg
        factor = lr_factor(self.updates_done, cfg.warmup_steps, self.total_steps, cfg.min_lr_ratio)
        hp = AdamWStep(
            lr_position=self.updates_done + 1,
            lr=learning_rate(cfg, self.updates_done, self.total_steps),
            grad_scale=clip_coefficient(grad_norm, cfg.grad_clip),
            betas=cfg.betas,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            muon=muon_step(cfg, factor),
        )
        self.updates_done += 1
        return hp
