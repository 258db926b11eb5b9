"""Whose rates predict a step: the table's for a GPU model it holds (the name as CUDA reports it),
the probes' for another (a layer at the H100's ratio of layer rate to matmul rate), and the text
names them."""

import pytest
import torch

from megatrain_ray.config import config_from_dict
from megatrain_ray.models.registry import model_arch
from megatrain_ray.planning import plan as planner
from megatrain_ray.planning.rates import H100, probe_gpu, probed_rates, rates_for_gpu, table_rates
from megatrain_ray.planning.step_plan import DeviceFacts, plan_step

CONFIG = config_from_dict({"model": {"preset": "qwen2.5-1.5b"}, "train": {"micro_batch_size": 1, "grad_accum": 8},
                           "data": {"seq_len": 4096}})
ARCH = model_arch(CONFIG.model)
STEP = plan_step(ARCH, CONFIG, DeviceFacts("cuda", "a GPU", 2**50, 2**50))


def test_the_table_is_found_by_the_name_cuda_reports():
    assert table_rates("NVIDIA H100 80GB HBM3") is H100 and table_rates("NVIDIA H100-SXM5-80GB") is H100
    assert table_rates("NVIDIA H200") is None and table_rates("NVIDIA A100-SXM4-80GB") is None
    assert rates_for_gpu("NVIDIA H100 PCIe", probe=lambda: 1 / 0) is H100  # a table entry needs no probe


def test_a_gpu_outside_the_table_is_probed_and_scaled_as_the_h100_measured():
    rates = rates_for_gpu("NVIDIA H200", probe=lambda: ("NVIDIA H200", 900e12, 55e9))
    assert rates.gpu == "NVIDIA H200" and rates.h2d_bytes_per_s == 55e9
    assert rates.layer_flops_per_s == 900e12 * 620 / 799  # the H100 table: layer 620, matmul 799 TFLOP/s
    assert "probed here" in rates.describe()


def test_the_prediction_follows_the_rates_and_names_them():
    slow = probed_rates("a GPU at half the H100's rates", H100.matmul_flops_per_s / 2, H100.h2d_bytes_per_s / 2)
    fast, half = planner.predict_step(ARCH, CONFIG, rates=H100), planner.predict_step(ARCH, CONFIG, rates=slow)
    assert half.compute_s == 2 * fast.compute_s and half.h2d_s == 2 * fast.h2d_s
    assert planner.predict_step(ARCH, CONFIG) == fast  # the default is the H100 machine's
    assert "predicted step on the H100's rates (measured on the H100" in planner.describe(ARCH, CONFIG, STEP, rates=H100)
    text = planner.describe(ARCH, CONFIG, STEP, no_prediction="no GPU here")
    assert text.endswith("no GPU here") and "predicted step" not in text and "tokens/s" not in text


@pytest.mark.gpu
def test_the_probes_measure_this_gpu():
    """Within what any GPU of the last decade and its PCIe or NVLink-C2C link can do."""
    name, matmul, h2d = probe_gpu()
    assert name == torch.cuda.get_device_name() and 10e12 < matmul < 5000e12 and 1e9 < h2d < 1000e9
    rates = rates_for_gpu(name)
    print(rates.describe())  # the GPU run's record of whose rates this machine gets
