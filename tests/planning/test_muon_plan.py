"""The plan with optim.name muon: the largest preset per Muon state mode, the model's mean host bytes a
parameter (a block matrix's 10/8/6, the embedding's and head's AdamW 14/10/6), the GPU's Newton-Schulz
time in the predicted step, and the advice of a refusal in Muon's own settings."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from megatrain_ray.config import ConfigError, load_config
from megatrain_ray.host.precision import format_of
from megatrain_ray.host.store import layer_bytes
from megatrain_ray.models.registry import PRESETS, model_layouts, num_params
from megatrain_ray.planning.placement import plan_placement
from megatrain_ray.planning.prediction import LAYER_TFLOPS, muon_seconds, predict_step
from megatrain_ray.planning.whatif import GPU_NODE, cluster_nodes, load_cluster, plan_cluster

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SEVEN_B = ["model.preset=qwen2.5-7b", "model.path=null", "model.compute_dtype=bfloat16", "data.seq_len=4096", "train.micro_batch_size=4",
           "train.grad_accum=8", "optim.name=muon"]


def muon_7b(*more: str):
    return load_config(EXAMPLES / "tiny.yaml", [*SEVEN_B, *more])


@pytest.mark.parametrize("master,moments,block", [("fp32", "fp32", 10), ("fp32", "bf16", 8), ("bf16", "bf16", 6)])
def test_the_placement_holds_the_model_s_mean_bytes(master, moments, block):
    config = muon_7b(f"optim.master={master}", f"optim.moments={moments}")
    arch = PRESETS["qwen2.5-7b"]
    placement = plan_placement(arch, config, cluster_nodes(load_cluster(EXAMPLES / "cluster-h200-1.5tb.yaml")), GPU_NODE)
    held = sum(layer_bytes(layout, torch.bfloat16, format_of(config.optim)) for layout in model_layouts(arch))
    assert placement.bytes_per_param == pytest.approx(held / num_params(arch))
    assert block < placement.bytes_per_param < block + 0.7  # the 1.1 B embedding and head take AdamW's bytes


def test_the_largest_model_per_mode_lists_muon_s_modes():
    config = muon_7b()
    text, fits = plan_cluster(PRESETS["qwen2.5-7b"], config, load_cluster(EXAMPLES / "cluster-h100-128g.yaml"), [100.0])
    assert fits, text
    largest = text[text.index("the largest model preset it trains"):]
    for mode in ("master=fp32 optim.moments=fp32", "master=fp32 optim.moments=bf16", "master=bf16 optim.moments=bf16"):
        assert re.search(rf"optim\.name=muon optim\.{mode}: \S+ \(\d+\.\d B params\)", largest), largest
    assert "Muon's Newton-Schulz on the GPU 0.85 s (not hidden)" in text


def test_the_predicted_step_adds_the_gpu_s_newton_schulz():
    arch, muon = PRESETS["qwen2.5-7b"], muon_7b()
    adamw = muon.replace(optim=dataclasses.replace(muon.optim, name="adamw"))
    assert muon_seconds(arch, muon) == pytest.approx(525.9e12 / LAYER_TFLOPS, rel=1e-3)  # 5 iterations of 28 blocks
    assert muon_seconds(arch, adamw) == 0.0
    a, m = predict_step(arch, adamw), predict_step(arch, muon)
    assert m.step_s == pytest.approx(a.step_s + m.newton_schulz_s)
    assert predict_step(arch, muon, num_gpus=2).newton_schulz_s == pytest.approx(m.newton_schulz_s / 2)


def test_a_refusal_advises_muon_s_leanest_mode():
    config = muon_7b()
    with pytest.raises(ConfigError) as refused:
        plan_placement(PRESETS["qwen2.5-7b"], config, cluster_nodes(load_cluster(EXAMPLES / "cluster-10g-64g.yaml")),
                       GPU_NODE)
    assert "optim.master: bf16, optim.moments: bf16: 6 bytes a block matrix's parameter" in str(refused.value)
    assert "int8" not in str(refused.value) and "runtime.disk_dir, with optim.name adamw" in str(refused.value)
