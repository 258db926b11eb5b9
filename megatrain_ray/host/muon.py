"""Muon for the decoder blocks' matrices (optim.name: muon), its momentum in host memory.

torch.optim.Muon's update, matrix by matrix: the momentum buffer B takes the clipped gradient G as
B <- B + (1 - mu) (G - B) (a lerp), the update is G + mu (B - G) with Nesterov (else B), orthogonalized
by `ns_steps` Newton-Schulz iterations in bf16 (`newton_schulz`, the same op sequence as torch's), and
the weight becomes W (1 - lr wd) - lr' O, lr' the learning rate scaled for the matrix's shape
(`adjusted_lr`). A stacked tensor of experts ([E, rows, cols]) is E matrices, each orthogonalized on
its own. Every other tensor of the model (the embedding, the head, norms, biases, 1-D tensors) takes
AdamW with the optim.* settings (`takes_muon`).

A Muon block's state (host/store.py, LayerState): the master, one moment buffer over the layer's
trained elements (`exp_avg`: the momentum of its matrices and AdamW's first moment of its other
tensors) and a second moment for its AdamW tensors only (`exp_avg_sq`, packed: `adamw_segments`). So
a block parameter costs 4 + 4 + 2 = 10 bytes with fp32 master and momentum and bf16 compute, 8 with a
bf16 momentum and 6 with a bf16 master (stochastic rounding, as AdamW's lean modes).

Where it runs: the momentum's update and the Newton-Schulz iterations need the clip factor, known
only when the whole backward has ended, so they run in the update phase, per layer: on the GPU worker
where the step plan says so (streaming/muon_step.py: the momentum and gradient go to the device,
`orthogonalize` runs there, the new momentum and the orthogonalized update come back, the latter over
the gradient, and the store only applies it: `MuonStep.orthogonalized`), else on the store's own CPU
(host/muon_layer.py; a CPU executor, a block on a RAM node), which is correct but slow for large
matrices (megatrain_ray/README.md, "Muon").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from megatrain_ray.models.layout import BLOCK, LayerLayout, ParamSlot

NS_COEFFICIENTS = (3.4445, -4.775, 2.0315)  # torch.optim.Muon's defaults (Keller Jordan's quintic)
NS_EPS = 1e-7  # torch.optim.Muon's eps: the norm the input is divided by is at least this


@dataclass(frozen=True)
class MuonStep:
    """Muon's part of a step's message (host/adamw.py, AdamWStep.muon): its scheduled learning rate
    and settings; `orthogonalized`: the update already sits in the gradient's buffer (a GPU made it)."""

    lr: float
    weight_decay: float
    momentum: float
    nesterov: bool
    ns_steps: int
    adjust_lr: str
    orthogonalized: bool = False


def muon_step(optim, lr_factor: float) -> MuonStep | None:
    """The Muon settings of a step at `lr_factor` of the peak (None: optim.name is adamw)."""
    if optim.name != "muon":
        return None
    lr = optim.lr if optim.muon_lr is None else optim.muon_lr
    wd = optim.weight_decay if optim.muon_weight_decay is None else optim.muon_weight_decay
    return MuonStep(lr * lr_factor, wd, optim.muon_momentum, optim.muon_nesterov, optim.muon_ns_steps,
                    optim.muon_adjust_lr)


def takes_muon(layout: LayerLayout, slot: ParamSlot) -> bool:
    """A decoder block's trained matrix (2-D, or stacked experts) that gets a gradient and is no bias:
    the tensors weight decay applies to (ParamSlot.decays), in a block."""
    return layout.kind == BLOCK and slot.decays


def muon_slots(layout: LayerLayout, optimizer: str) -> list[ParamSlot]:
    """The layer's tensors that Muon steps (none under AdamW)."""
    return [slot for slot in layout.params if optimizer == "muon" and takes_muon(layout, slot)]


def adamw_segments(layout: LayerLayout, optimizer: str) -> list[tuple[int, int, bool]]:
    """(start, end, decays) of the layer's trained tensors that AdamW steps, in order: every one under
    AdamW, the others than Muon's in a Muon block."""
    muon = {slot.offset for slot in muon_slots(layout, optimizer)}
    k = layout.trained_numel
    return [(start, min(end, k), decays) for start, end, decays in layout.segments()
            if start not in muon and start < k]


def second_moment_numel(layout: LayerLayout, optimizer: str) -> int:
    """Elements of the layer's second moment: its trained ones, or a Muon block's AdamW tensors'."""
    if not muon_slots(layout, optimizer):
        return layout.trained_numel
    return sum(end - start for start, end, _ in adamw_segments(layout, optimizer))


def matrices(flat: torch.Tensor, shape: tuple[int, ...]) -> list[torch.Tensor]:
    """A tensor's matrices: itself (2-D) or each [rows, cols] of its leading dimensions (stacked experts)."""
    whole = flat.view(shape)
    return [whole] if whole.dim() == 2 else list(whole.reshape(-1, *shape[-2:]).unbind(0))


def newton_schulz(update: torch.Tensor, steps: int, coefficients=NS_COEFFICIENTS, eps: float = NS_EPS) -> torch.Tensor:
    """The orthogonalized update of one matrix, in bf16: torch.optim.Muon's quintic iteration, op
    for op (the wide side second, the input divided by its Frobenius norm, then X <- aX + (bA + cA^2)X
    with A = XX^T, each product an addmm as torch's), so that the same input gives the same bits."""
    a, b, c = coefficients
    x = update.bfloat16()
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x = x.div(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def newton_schulz_flops(layout: LayerLayout, optimizer: str, steps: int) -> int:
    """The matrix products' FLOP of one step's orthogonalization of the layer's Muon matrices: per
    iteration of an r x c matrix (r <= c) 2r²c for A = XX^T, 2r³ for A², 2r²c for the product with X."""
    total = 0
    for slot in muon_slots(layout, optimizer):
        r, c = sorted(slot.shape[-2:])
        total += slot.numel // (r * c) * steps * (4 * r * r * c + 2 * r ** 3)
    return total


def adjusted_lr(lr: float, adjust: str, shape: tuple[int, ...]) -> float:
    """torch.optim.Muon's learning rate for a matrix of `shape` (its first two dimensions, as torch
    reads them; a stacked expert's are its own rows and columns)."""
    rows, cols = shape[-2], shape[-1]
    if adjust == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr * math.sqrt(max(1, rows / cols))


def orthogonalize(grad: torch.Tensor, momentum: torch.Tensor, shape: tuple[int, ...], grad_scale: float,
                  step: MuonStep) -> tuple[torch.Tensor, torch.Tensor]:
    """One tensor's momentum update and orthogonalized update, on the device its arguments are on:
    (the new momentum in fp32, the update O in bf16), both flat. `grad` is the tensor's gradient as
    the host holds it (any float dtype), multiplied by the clip factor `grad_scale` here as
    clip_grad_norm_ multiplies it; `momentum`, the buffer as held (fp32 or bf16)."""
    g = grad.float() * grad_scale
    buf = momentum.float().lerp_(g, 1 - step.momentum)
    update = g.lerp(buf, step.momentum) if step.nesterov else buf
    out = torch.empty(update.numel(), dtype=torch.bfloat16, device=update.device)
    for o, u in zip(matrices(out, shape), matrices(update, shape)):
        o.copy_(newton_schulz(u, step.ns_steps))
    return buf, out


def apply_factors(shape: tuple[int, ...], step: MuonStep) -> tuple[float, float]:
    """(decay, alpha) of W <- W decay + alpha O: (1 - lr wd, -lr') for a tensor of `shape` (its
    matrices share lr', stacked experts included)."""
    return 1 - step.lr * step.weight_decay, -adjusted_lr(step.lr, step.adjust_lr, shape)


def apply_update(weights: torch.Tensor, update: torch.Tensor, shape: tuple[int, ...], step: MuonStep) -> None:
    """W <- W (1 - lr wd) - lr' O on one tensor's fp32 weights, in place, as torch.optim.Muon applies it
    (torch's ops; the store runs the same arithmetic in one pass, host/adamw_kernel.py's `muon_apply`)."""
    decay, alpha = apply_factors(shape, step)
    weights.mul_(decay)
    for w, o in zip(matrices(weights, shape), matrices(update, shape)):
        w.add_(o, alpha=alpha)


def host_orthogonalized(hp):
    """The message for a store whose Muon updates a GPU worker has made and written over the gradients."""
    if hp is None or hp.muon is None:
        return hp
    return replace(hp, muon=replace(hp.muon, orthogonalized=True))
