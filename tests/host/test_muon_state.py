"""optim.name muon's state in host memory: its bytes a parameter in each mode, resume bit for bit in
each mode through checkpoints written by the stores, and what is refused (a change of optimizer on
resume, int8 momentum)."""

from __future__ import annotations

import pytest
import torch

from megatrain_ray.config import ConfigError, config_from_dict
from megatrain_ray.files import checkpoint as ckpt
from megatrain_ray.host.muon import muon_slots, second_moment_numel
from megatrain_ray.host.precision import StateFormat
from megatrain_ray.host.store import ShardStore, layer_bytes
from megatrain_ray.models.registry import PRESETS
from helpers.reference_training import random_micro_batches
from test_lean_state import tensor_bytes, whole_and_resumed

MODES = [("fp32", "fp32"), ("fp32", "bf16"), ("bf16", "bf16")]  # 10, 8 and 6 bytes a block matrix's parameter


def muon_config(master: str, moments: str, steps: int = 6):
    return config_from_dict({
        "model": {"preset": "tiny-llama", "compute_dtype": "bfloat16", "init_std": 0.2},
        "optim": {"lr": 3e-3, "warmup_steps": 2, "master": master, "moments": moments, "name": "muon",
                  "muon_lr": 0.02},
        "train": {"steps": steps, "grad_accum": 1, "micro_batch_size": 1, "seed": 5},
        "executor": {"device": "cpu", "compile": False, "loss_chunk_tokens": 16},
    })


@pytest.mark.parametrize("master,moments", MODES)
def test_a_block_holds_one_moment_for_its_matrices(master, moments):
    """A Muon block: master, one momentum over its trained elements, a second moment for its AdamW
    tensors only (the norms), the compute copy or a bf16 master's gradient buffer."""
    expected = {("fp32", "fp32"): 10, ("fp32", "bf16"): 8, ("bf16", "bf16"): 6}[(master, moments)]
    fmt = StateFormat(master, moments, "muon")
    arch = PRESETS["tiny-llama"]
    store = ShardStore(arch, [1], torch.bfloat16, state_format=fmt)
    state = store.layers[1]
    n, rest = state.layout.numel, second_moment_numel(state.layout, "muon")
    assert 0 < rest < n / 100 and len(muon_slots(state.layout, "muon")) == 7  # q k v o gate up down
    v_bytes = 4 if moments == "fp32" else 2
    assert store.host_bytes() == n * expected + rest * v_bytes == layer_bytes(state.layout, torch.bfloat16, fmt)
    assert fmt.bytes_per_param(2) == expected


@pytest.mark.parametrize("master,moments", MODES)
def test_six_steps_equal_three_then_resume_three(tmp_path, master, moments):
    """The momentum is saved and restored as it is held; the update counts key a bf16 master's
    rounding noise: the resumed steps are the same bits, into another split of the layers."""
    arch = PRESETS["tiny-llama"]
    data = random_micro_batches(arch, 6, 1, batch=1, seq=8, seed=1)
    config = muon_config(master, moments)
    losses, split, final, resumed = whole_and_resumed(config, arch, data, 3, tmp_path)
    assert tensor_bytes(tmp_path / "half") == ckpt.checkpoint_bytes(config, arch)
    assert split == losses
    for layer in final:
        a, _ = ckpt.read_layer_state(final[layer], layer)
        b, steps = ckpt.read_layer_state(resumed[layer], layer)
        assert steps == 6 and a.keys() == b.keys()
        assert a["exp_avg"].abs().sum() > 0, "the momentum is held"
        for key in a:
            assert torch.equal(a[key].view(torch.uint8), b[key].view(torch.uint8)), (layer, key)


def test_a_change_of_optimizer_on_resume_is_refused():
    meta = {"config": {"optim": {"name": "adamw"}}}
    with pytest.raises(ckpt.CheckpointError, match="optim.name=adamw"):
        ckpt.check_state_format(meta, muon_config("fp32", "fp32"), "ckpt")
    ckpt.check_state_format({"config": {"optim": {"name": "muon", "moments": "fp32"}}}, muon_config("fp32", "bf16"),
                            "ckpt")


def test_muon_settings_are_checked():
    with pytest.raises(ConfigError, match="int8 is AdamW's"):
        muon_config("fp32", "int8")
    with pytest.raises(ConfigError, match="optim.name must be adamw or muon"):
        config_from_dict({"optim": {"name": "sgd"}})
    with pytest.raises(ConfigError, match="muon_adjust_lr"):
        config_from_dict({"optim": {"name": "muon", "muon_adjust_lr": "other"}})
