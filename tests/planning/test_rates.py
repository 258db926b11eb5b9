"""Whose rates predict a step: the table's for a GPU model it holds (the name as CUDA reports it or
`--gpu` gives; measured for the H100 SXM, scaled from their datasheets for the others), the probes'
for another live GPU (a layer at the H100's ratio of layer rate to matmul rate), none for another
described one, and the text names them."""

import pytest
import torch

from megatrain_ray.config import ConfigError, config_from_dict
from megatrain_ray.models.registry import model_arch
from megatrain_ray.planning.prediction import predict_step
from megatrain_ray.planning.report import describe
from megatrain_ray.planning.decisions import with_auto_settings
from megatrain_ray.planning.rates import (H100, SPECS, device_key, named_rates, probe_gpu, probed_rates, rates_for_gpu,
                                          table_rates)
from megatrain_ray.planning.step_plan import DeviceFacts, plan_step
from megatrain_ray.planning.whatif import ClusterSpec, GpuNodeSpec, plan_cluster
from megatrain_ray.runtime.cluster import named_gpu_rates

CONFIG = config_from_dict({"model": {"preset": "qwen2.5-1.5b"}, "train": {"micro_batch_size": 1, "grad_accum": 8},
                           "data": {"seq_len": 4096}})
ARCH = model_arch(CONFIG.model)
STEP = plan_step(ARCH, CONFIG, DeviceFacts("cuda", "a GPU", 2**50, 2**50))


def test_the_table_is_found_by_the_name_cuda_reports():
    assert table_rates("NVIDIA H100 80GB HBM3") is H100 and table_rates("NVIDIA H100-SXM5-80GB") is H100
    assert rates_for_gpu("NVIDIA H100 80GB HBM3", probe=lambda: 1 / 0) is H100  # a table entry needs no probe
    found = {name: device_key(name) for name in (
        "NVIDIA GeForce RTX 3080", "NVIDIA GeForce RTX 4060 Ti", "NVIDIA GeForce RTX 5090", "NVIDIA A100-SXM4-80GB",
        "NVIDIA A100-PCIE-40GB", "NVIDIA A100 80GB PCIe", "NVIDIA L40S", "NVIDIA H100 PCIe", "NVIDIA H200",
        "NVIDIA B200", "NVIDIA GH200 480GB")}
    assert list(found.values()) == ["rtx3080", "rtx4060ti", "rtx5090", "a100-80", "a100-40", "a100-80", "l40s",
                                    "h100-pcie", "h200", "b200", "gh200"]
    # other GPUs that share a number: matched whole, they are not in the table
    for other in ("NVIDIA GeForce RTX 3080 Ti", "NVIDIA GeForce RTX 4090 Laptop GPU", "NVIDIA H100 NVL", "NVIDIA L40",
                  "NVIDIA GeForce RTX 4070 SUPER", "NVIDIA GeForce RTX 4060"):
        assert device_key(other) is None, other
    rtx = rates_for_gpu("NVIDIA GeForce RTX 4090", probe=lambda: 1 / 0)
    assert rtx.gpu == "RTX 4090" and "not a measurement" in rtx.describe()


def test_a_datasheet_gpu_is_scaled_as_the_measured_h100_compares_with_its_own_datasheet():
    rtx3080, h200 = named_rates("rtx3080"), named_rates("H200")
    assert rtx3080.layer_flops_per_s == pytest.approx(H100.layer_flops_per_s * 59.5 / 989.4)
    assert rtx3080.matmul_flops_per_s == pytest.approx(H100.matmul_flops_per_s * 59.5 / 989.4)
    assert rtx3080.h2d_bytes_per_s == pytest.approx(H100.h2d_bytes_per_s / 2)  # PCIe 4.0 x16 against 5.0 x16
    assert named_rates("rtx4060ti").h2d_bytes_per_s == pytest.approx(H100.h2d_bytes_per_s / 4)  # 4.0 x8
    # an H200 computes as an H100 SXM (the same bf16 peak) but is not the machine measured: said so
    assert h200.layer_flops_per_s == pytest.approx(H100.layer_flops_per_s) and h200 is not H100
    for rates in (rtx3080, h200):
        assert "a datasheet-scaled estimate, not a measurement" in rates.describe()
    assert "measured on the H100" in H100.describe() and "estimate" not in H100.describe()
    assert {spec.memory_gib for key, spec in SPECS.items() if key.startswith("a100")} == {40, 80}


def test_gpu_names_the_table_takes_and_refuses():
    for name in ("rtx3080", "RTX 3080", "rtx-3080", "RTX3080"):
        assert named_rates(name).gpu == "RTX 3080"
    assert named_rates("H100") is H100 and named_rates("h100-sxm") is H100  # --gpu H100, as before
    assert named_rates("h100-pcie").gpu == "H100 PCIe" and named_rates("Radeon RX 7900") is None
    assert named_gpu_rates("rtx 3080").gpu == "RTX 3080"  # no cluster needed for a named GPU
    with pytest.raises(ConfigError, match="rtx3060.*gh200"):
        named_gpu_rates("rtx3080ti")


SMALL_10G = {"gpu_memory_gib": 9.5, "host_memory_gib": 60, "network_gbps": 10}


def test_a_described_home_gpu_gets_its_own_estimate_and_an_unknown_one_no_speed():
    config = config_from_dict({"model": {"preset": "qwen2.5-1.5b"}, "train": {"grad_accum": 2},
                               "data": {"seq_len": 1024}})
    arch = model_arch(config.model)
    text, fits = plan_cluster(arch, config, ClusterSpec(GpuNodeSpec("RTX 3080 10GB", **SMALL_10G), ()), [10])
    assert fits and "predicted step on the RTX 3080's rates (a datasheet-scaled estimate" in text
    assert "H100" not in text.replace("the measured H100 SXM", "").replace("the H100 machine's 4.8", "")
    home, h100 = (predict_step(arch, with_auto_settings(config), rates=r) for r in (named_rates("rtx3080"), H100))
    assert home.compute_s == pytest.approx(h100.compute_s * 989.4 / 59.5)
    text, fits = plan_cluster(arch, config, ClusterSpec(GpuNodeSpec("Radeon RX 7900", **SMALL_10G), ()), [10])
    assert fits and "no step time: the rates table (planning/rates.py) has no GPU named 'Radeon RX 7900'" in text
    assert "tokens/s" not in text and "predicted step" not in text
    text, _ = plan_cluster(arch, config, ClusterSpec(GpuNodeSpec("Radeon RX 7900", **SMALL_10G), ()), [10], gpu="rtx4090")
    assert "predicted step on the RTX 4090's rates" in text  # --gpu names the rates of a described GPU too


def test_a_gpu_outside_the_table_is_probed_and_scaled_as_the_h100_measured():
    rates = rates_for_gpu("NVIDIA H100 NVL", probe=lambda: ("NVIDIA H100 NVL", 900e12, 55e9))
    assert rates.gpu == "NVIDIA H100 NVL" and rates.h2d_bytes_per_s == 55e9
    assert rates.layer_flops_per_s == 900e12 * 620 / 799  # the H100 table: layer 620, matmul 799 TFLOP/s
    assert "probed here" in rates.describe()


def test_the_prediction_follows_the_rates_and_names_them():
    slow = probed_rates("a GPU at half the H100's rates", H100.matmul_flops_per_s / 2, H100.h2d_bytes_per_s / 2)
    fast, half = predict_step(ARCH, CONFIG, rates=H100), predict_step(ARCH, CONFIG, rates=slow)
    assert half.compute_s == 2 * fast.compute_s and half.h2d_s == 2 * fast.h2d_s
    assert predict_step(ARCH, CONFIG) == fast  # the default is the H100 machine's
    assert "predicted step on the H100's rates (measured on the H100" in describe(ARCH, CONFIG, STEP, rates=H100)
    text = describe(ARCH, CONFIG, STEP, no_prediction="no GPU here")
    assert text.endswith("no GPU here") and "predicted step" not in text and "tokens/s" not in text


@pytest.mark.gpu
def test_the_probes_measure_this_gpu():
    """Within what any GPU of the last decade and its PCIe or NVLink-C2C link can do."""
    name, matmul, h2d = probe_gpu()
    assert name == torch.cuda.get_device_name() and 10e12 < matmul < 5000e12 and 1e9 < h2d < 1000e9
    rates = rates_for_gpu(name)
    print(rates.describe())  # the GPU run's record of whose rates this machine gets


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU here the plan is for that GPU")
def test_plan_without_a_gpu_plans_for_the_one_gpu_names(local_ray, capsys):
    """`plan --gpu rtx3080` on a machine without a GPU: the step planned for that GPU's memory (its
    datasheet's less the allowance) and predicted on its rates, not the CPU executor's memory."""
    import megatrain_ray

    result = megatrain_ray.plan({"model": {"preset": "tiny-qwen2"}, "data": {"seq_len": 64},
                                 "runtime": {"store_memory_gib": 1}}, gpu="rtx3080")
    assert result, result.text
    assert ("no GPU here: the step is planned for the RTX 3080 that --gpu names, with 9.5 GiB free of its 10 GiB"
            in result.text)
    assert "1 GPU worker(s)" in result.text and "of 9.50 GiB free:" in result.text
    assert "predicted step on the RTX 3080's rates (a datasheet-scaled estimate" in result.text
    capsys.readouterr()
