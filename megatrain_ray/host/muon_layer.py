"""A Muon block's optimizer step on the host (host/muon.py says what Muon does and which tensors take it)."""

from __future__ import annotations

import torch

from megatrain_ray.host import precision
from megatrain_ray.host.adamw import AdamWStep, adamw_update, lean_update
from megatrain_ray.host.adamw_kernel import native_kernel
from megatrain_ray.host.muon import adamw_segments, apply_factors, apply_update, muon_slots, orthogonalize


def muon_layer_update(state, hp: AdamWStep, rounding_key: int, one_pass: bool = True) -> None:
    """One Muon block's step on the host (host/store.py, LayerState): each matrix from its
    orthogonalized update (made here, or already in the gradient's buffer: MuonStep.orthogonalized),
    each other trained tensor by AdamW from its packed second moment; the compute copy published.
    The update is applied in one pass on the store's optimizer threads (host/adamw_kernel.py,
    `muon_apply`), or by torch's ops where the kernel could not be built (or `one_pass` is False)."""
    layout, step = state.layout, hp.muon
    bf16_master = state.master.dtype == torch.bfloat16
    kernel = native_kernel() if one_pass else None
    for slot in muon_slots(layout, "muon"):
        s = slice(slot.offset, slot.offset + slot.numel)
        if step.orthogonalized:
            update = state.grad[s]
        else:
            buf, update = orthogonalize(state.grad[s], state.exp_avg[s], slot.shape, hp.grad_scale, step)
            state.exp_avg[s].copy_(buf)
        if kernel is not None:
            kernel.muon_apply(state.master[s], update, None if bf16_master else state.compute[s],
                              *apply_factors(slot.shape, step), rounding_key, slot.offset)
            continue
        weights = state.master[s].float() if bf16_master else state.master[s]
        apply_update(weights, update, slot.shape, step)
        if bf16_master:
            state.master[s].copy_(precision.stochastic_round_bf16(weights, rounding_key, slot.offset))
        else:
            state.compute[s].copy_(weights)
    at = 0
    for start, end, decays in adamw_segments(layout, "muon"):
        s, v = slice(start, end), state.exp_avg_sq[at : at + end - start]
        at += end - start
        if state.exp_avg.dtype == torch.float32 and not bf16_master:
            adamw_update(state.master[s], state.grad[s], state.exp_avg[s], v, [(0, end - start, decays)], hp,
                         state.updates, compute_copy=state.compute[s])
        else:
            lean_update(state.master[s], state.exp_avg[s], v, None, state.grad[s],
                        None if bf16_master else state.compute[s], [(0, end - start, decays)], hp, state.updates,
                        rounding_key, offset=start)
