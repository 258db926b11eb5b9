"""Random init of the host state: drawn by threads piece by piece, the same weights whatever the
thread count and whatever split of the model across stores."""

import pytest
import torch

from megatrain_ray.host import store as store_module
from megatrain_ray.host.precision import StateFormat
from megatrain_ray.host.store import ShardStore
from megatrain_ray.models.registry import PRESETS, model_layouts

ARCH = PRESETS["tiny-llama"]
STD = 0.02


def initialised(layers: list[int], threads: int, fmt: StateFormat = StateFormat()) -> dict[int, torch.Tensor]:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        store = ShardStore(ARCH, layers, torch.bfloat16, state_format=fmt)
        store.init_random(seed=3, std=STD)
    finally:
        torch.set_num_threads(before)
    return {i: (s.master.clone(), s.compute.clone()) for i, s in store.layers.items()}


@pytest.fixture
def small_pieces(monkeypatch):
    """Pieces of 1,000 elements: every matrix of the tiny model is cut into many, shared out among threads."""
    monkeypatch.setattr(store_module, "INIT_PIECE", 1000)


@pytest.mark.usefixtures("small_pieces")
def test_weights_do_not_depend_on_threads_or_the_split_across_stores():
    one = initialised([0, 1, 2], threads=1)
    split = {**initialised([0, 1], threads=3), **initialised([2], threads=2)}
    for i in one:
        assert torch.equal(one[i][0], split[i][0]), f"layer {i}"
        assert torch.equal(one[i][1], one[i][0].to(torch.bfloat16)), "the compute copy is the master, rounded"
    block = one[1][0]
    layout = model_layouts(ARCH)[1]
    for slot in layout.params:
        w = block[slot.offset: slot.offset + slot.numel]
        if slot.name.endswith("norm.weight"):
            assert torch.equal(w, torch.ones_like(w))
        else:  # normal with the asked spread, and pieces not repeating one another
            assert abs(float(w.std()) - STD) < 0.1 * STD, slot.name
            assert not torch.equal(w[:1000], w[1000:2000]), slot.name
    assert not torch.equal(one[1][0], one[2][0]), "layers draw different weights"


@pytest.mark.usefixtures("small_pieces")
def test_a_bf16_master_holds_the_fp32_draw_rounded():
    fp32 = initialised([1], threads=2)
    bf16 = initialised([1], threads=1, fmt=StateFormat("bf16", "int8"))
    assert torch.equal(bf16[1][0], fp32[1][0].to(torch.bfloat16))
