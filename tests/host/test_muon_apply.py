"""The store's one-pass application of Muon's update (host/adamw_kernel.py, `muon_apply`) against
torch's ops that host/muon.py's `apply_update` runs (torch.optim.Muon's `mul_` then `add_`), bit for
bit: the same fp32 arithmetic, the same bf16 roundings (to nearest even, or at random from the same
noise with a bf16 master)."""

import pytest
import torch

from megatrain_ray.host import precision
from megatrain_ray.host.adamw_kernel import native_kernel
from megatrain_ray.host.muon import MuonStep, apply_factors, apply_update
from helpers.threads import three_threads  # noqa: F401 (a fixture)

# An odd matrix (no multiple of a vector width; four of the kernel's 64 Ki-element tiles for three
# threads) and stacked experts, each at an odd offset in its layer (the bf16 master's noise).
SHAPES = [((331, 617), 12_345), ((3, 97, 211), 70_001)]
STEP = MuonStep(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, ns_steps=5, adjust_lr="match_rms_adamw",
                orthogonalized=True)
KEY = 0x9E3779B9


@pytest.fixture(scope="module")
def kernel():
    ops = native_kernel()
    if ops is None:
        pytest.skip("the host kernel cannot be built here")
    return ops


@pytest.mark.usefixtures("three_threads")
@pytest.mark.parametrize("shape,offset", SHAPES, ids=["matrix", "experts"])
@pytest.mark.parametrize("master_dtype,update_dtype", [(torch.float32, torch.bfloat16), (torch.float32, torch.float32),
                                                      (torch.bfloat16, torch.bfloat16)],
                         ids=["fp32-bf16", "fp32-fp32", "bf16-master"])
def test_the_one_pass_apply_equals_torchs_ops(kernel, shape, offset, master_dtype, update_dtype):
    n = torch.Size(shape).numel()
    g = torch.Generator().manual_seed(0)
    master = torch.randn(n, generator=g).to(master_dtype)
    update = torch.randn(n, generator=g).to(update_dtype)
    update[:7] = torch.tensor([0.0, -0.0, 1e-30, -1e30, 3.0, float("inf"), float("nan")]).to(update_dtype)

    weights = master.to(torch.float32, copy=True)  # torch's ops, as muon_layer_update runs them without the kernel
    apply_update(weights, update, shape, STEP)
    want = precision.stochastic_round_bf16(weights, KEY, offset) if master_dtype == torch.bfloat16 else weights

    ours = master.clone()
    copy = None if master_dtype == torch.bfloat16 else update.clone()  # the update's buffer, written over
    kernel.muon_apply(ours, update if copy is None else copy, copy, *apply_factors(shape, STEP), KEY, offset)
    assert_same_bits(ours, want)
    if copy is not None:
        assert_same_bits(copy, weights.to(update_dtype))


def assert_same_bits(ours: torch.Tensor, want: torch.Tensor) -> None:
    """Equal bit for bit, but a NaN's bits (the kernel writes bf16's quiet NaN, torch may keep a sign)."""
    nan = want.isnan()
    assert torch.equal(ours.isnan(), nan)
    bits = torch.int16 if want.dtype == torch.bfloat16 else torch.int32
    assert torch.equal(ours[~nan].view(bits), want[~nan].view(bits))
