"""A layer updated piece by piece, as its gradient lands over a link in pieces (host/transport.py),
ends bit for bit as in one update, in every state mode: AdamW is elementwise, and the pieces keep
each element's weight decay, its int8 block and (a bf16 master) its rounding noise. And the pieces
against torch.optim.AdamW, as the one-call step is held to it (test_host_adamw.py)."""

import random

import pytest
import torch

from megatrain_ray.host import adamw as adamw_module
from megatrain_ray.host.adamw import AdamWStep, adamw_step, segments_within
from megatrain_ray.host.precision import StateFormat
from megatrain_ray.host.store import ShardStore
from megatrain_ray.host.transport import piece_bounds
from megatrain_ray.models.layout import frozen_slots
from megatrain_ray.models.registry import PRESETS
from helpers.kernel import path_of
from helpers.threads import three_threads  # noqa: F401 (a fixture)
from test_host_adamw import BETAS, EPS, LR, SEGMENTS, STEPS, assert_relative, flat_segments, torch_reference

MODES = [("fp32", "fp32"), ("fp32", "bf16"), ("fp32", "int8"), ("bf16", "int8"), ("bf16", "fp32"), ("bf16", "bf16")]
PIECE = 768  # three int8 blocks: pieces whose bounds fall inside parameters and kernel tiles alike
HP = [AdamWStep(1, 3e-3, 1.0, BETAS, EPS, 0.1), AdamWStep(2, 2e-3, 0.6, BETAS, EPS, 0.1)]


def store_of(fmt: StateFormat, frozen_tail: bool) -> ShardStore:
    """Layer 1 of tiny-llama (36,992 elements), its last tensor frozen (no moments) where asked."""
    store = ShardStore(PRESETS["tiny-llama"], [1], torch.bfloat16, state_format=fmt, seed=3)
    if frozen_tail:
        layout = store.layers[1].layout
        last = max(layout.params, key=lambda p: p.offset).name
        store.layers[1] = store._allocate(frozen_slots(layout, frozenset({last})))
        assert store.layers[1].layout.trained_numel < layout.numel
    store.init_random(seed=5, std=0.02)
    return store


def write_gradient(store: ShardStore, update: int) -> None:
    state = store.layers[1]
    g = torch.randn(state.layout.numel, generator=torch.Generator().manual_seed(10 + update)) * 1e-2
    state.grad.copy_(g)  # where the gradient lands: over the compute copy, or (bf16 master) its own buffer


@pytest.mark.usefixtures("three_threads")
@pytest.mark.parametrize("one_pass", [True, False], ids=["kernel", "torch-fallback"])
@pytest.mark.parametrize("frozen_tail", [False, True], ids=["all-trained", "frozen-tail"])
@pytest.mark.parametrize("master,moments", MODES)
def test_a_layer_updated_in_pieces_equals_one_update_bit_for_bit(master, moments, frozen_tail, one_pass,
                                                                   monkeypatch):
    if not one_pass:
        monkeypatch.setattr(adamw_module, "native_kernel", lambda: None)
    path_of(one_pass)  # the kernel, where it says so, is built: the store's updates run it
    fmt = StateFormat(master, moments)
    whole, pieced = store_of(fmt, frozen_tail), store_of(fmt, frozen_tail)
    bounds = piece_bounds(whole.layers[1].layout.numel, PIECE)
    assert len(bounds) == 49 and bounds[-1][1] - bounds[-1][0] < PIECE
    order = random.Random(0).sample(bounds, len(bounds))  # any order: each element is on its own
    for update, hp in enumerate([*HP, None]):  # two updates, then a skipped one (weights put back)
        write_gradient(whole, update)
        write_gradient(pieced, update)
        whole.step_layer(1, hp)
        pieced.begin_update(1, hp)
        for lo, hi in order:
            pieced.update_piece(1, hp, lo, hi)
    a, b = whole.layers[1], pieced.layers[1]
    assert a.updates == b.updates == 2
    for key, t in a.tensors().items():
        assert torch.equal(t, b.tensors()[key]), key
    assert torch.equal(a.compute, b.compute)


def test_a_piece_must_start_on_an_int8_block():
    n = 1024
    with pytest.raises(ValueError, match="multiple of 256"):
        adamw_step(torch.zeros(n), torch.zeros(n), torch.zeros(n), torch.zeros(n), [(0, n, True)], HP[0], 1, offset=100)


@pytest.mark.usefixtures("three_threads")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_pieces_match_torch_adamw(dtype):
    """The one-call test's layer (odd parameter sizes, clipping, weight decay on some) stepped in pieces
    of 4,096 elements: torch.optim.AdamW's result to its tolerance, and the one call's exactly."""
    gen = torch.Generator().manual_seed(0)
    n = sum(n for n, _ in SEGMENTS)
    init = torch.randn(n, generator=gen) * 0.05
    grads = [(torch.randn(n, generator=gen) * 0.01).to(dtype) for _ in range(STEPS)]
    ref_master, ref_m, ref_v, scales = torch_reference(init, grads, 0.1, 1.0)
    runs = []
    for bounds in ([(0, n)], piece_bounds(n, 4096)):
        master, m, v = init.clone(), torch.zeros(n), torch.zeros(n)
        compute = init.to(dtype, copy=True)
        for step, (g, scale) in enumerate(zip(grads, scales, strict=True), start=1):
            compute.copy_(g)
            hp = AdamWStep(step, LR, scale, BETAS, EPS, 0.1)
            for lo, hi in bounds:
                adamw_step(master[lo:hi], m[lo:hi], v[lo:hi], compute[lo:hi], segments_within(flat_segments(), lo, hi),
                           hp, step, offset=lo)
        runs.append((master, m, v, compute))
    master, m, v, compute = runs[1]
    assert_relative(master, ref_master, "master")
    assert_relative(m, ref_m, "exp_avg")
    assert_relative(v, ref_v, "exp_avg_sq")
    for ours, one_call in zip(runs[1], runs[0], strict=True):
        assert torch.equal(ours, one_call)
