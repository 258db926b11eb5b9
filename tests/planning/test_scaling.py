"""Where N GPUs of one node stop scaling (planning/scaling.py): the predicted step at the run's
tokens per GPU with 1, 2, 4 and 8 GPUs on one set of host stores. Every GPU reads every layer
(host reads N times one GPU's), the host optimizer runs once a step on the threads the workers
leave it (the node's cores less one and one a worker), and the tokens a step that keep N GPUs busy
grow N-fold; `megatrain-ray plan` prints the table and the limits."""

import pytest

from megatrain_ray.config import config_from_dict
from megatrain_ray.models.registry import PRESETS, num_params
from megatrain_ray.planning.placement import NodeInfo, plan_placement
from megatrain_ray.planning.memory import GiB
from megatrain_ray.planning.prediction import HOST_ADAMW_PARAMS_PER_S, HOST_MEMORY_BYTES_PER_S
from megatrain_ray.planning.rates import rates_of
from megatrain_ray.planning.scaling import gpu_scaling, optimizer_gpus, scaling_end, scaling_text
from megatrain_ray.planning.step_plan import DeviceFacts, plan_step
from megatrain_ray.planning.traffic import step_traffic

ARCH = PRESETS["qwen2.5-7b"]
H200 = DeviceFacts("cuda", "H200", 139 * GiB, 100 * GiB, total_bytes=140 * GiB)


def planned(micro_batches_per_gpu: int, gpus: int, cores: int):
    config = config_from_dict({"model": {"preset": "qwen2.5-7b", "compute_dtype": "bfloat16"}, "data": {"seq_len": 4096},
                               "train": {"micro_batch_size": 1, "grad_accum": micro_batches_per_gpu * gpus},
                               "executor": {"device": "cuda", "keep_graphs": 0}})
    node = NodeInfo("gpu", "10.0.0.1", float(gpus), False, 250 * GiB, cpus=float(cores))
    step = plan_step(ARCH, config, H200, plan_placement(ARCH, config, [node], "gpu"))
    traffic = step_traffic(ARCH, step.planned_config(config), step.placement, step.kept)
    return config, step, traffic.times(), traffic.optimizer_seconds()


def test_the_7b_at_131072_tokens_a_gpu_scales_to_8_gpus_of_a_32_core_node():
    """As measured on four H200s (3.93x at 4 GPUs, examples/benchmarks/2026-11-28-h200x4.md's issue):
    compute binds at every count; each GPU reads every layer twice in bf16; the optimizer's threads
    are the 32 cores less one and one a worker, its time the measured rate's (14 threads or more)."""
    config, step, network, optimizer_s = planned(32, 2, 32)
    scales = gpu_scaling(ARCH, config, step, network, optimizer_s, rates_of("h200"))
    assert [s.gpus for s in scales] == [1, 2, 4, 8] and [s.threads for s in scales] == [30, 29, 27, 23]
    params = num_params(ARCH)
    for s in scales:
        p = s.prediction
        assert p.tokens == 131072 * s.gpus and p.bound == "compute"
        assert p.host_read_bytes == s.gpus * 2 * params * 2
        assert p.optimizer_s == pytest.approx(params / HOST_ADAMW_PARAMS_PER_S)
        assert s.tokens_per_s == pytest.approx(s.gpus * scales[0].tokens_per_s, rel=1e-9)
        assert p.busy_tokens == pytest.approx(s.gpus * scales[0].prediction.busy_tokens, abs=s.gpus)
    assert scaling_end(scales) is None
    # the optimizer (1.59 s at the measured rate) hides behind a GPU's forward while 8 threads or more are left
    forward = scales[0].prediction.forward_s
    assert optimizer_gpus(config, step, optimizer_s, forward) == max(
        n for n in range(1, 31) if params / HOST_ADAMW_PARAMS_PER_S * 14 / min(14, 31 - n) <= forward)
    text = scaling_text(ARCH, config, step, network, optimizer_s, rates_of("h200"))
    host_gpus = int((HOST_MEMORY_BYTES_PER_S * scales[0].prediction.compute_s - 2 * params) // (4 * params))
    assert "no end of scaling up to 8 GPUs" in text and f"serves {host_gpus} GPUs" in text
    assert f"| 4.00x | compute | 1.59 s (27) | {16 * params / 1e9:.0f} GB |" in text
    # a switch's uplink shared by k GPUs carries k GPUs' copies, 2 x params x 2 bytes each, within a GPU's compute
    one = scales[0].prediction
    assert one.h2d_s == pytest.approx(4 * params / rates_of("h200").h2d_bytes_per_s)
    assert f"stays behind compute for {int(one.compute_s // one.h2d_s)} of them" in text


def test_few_tokens_a_gpu_on_few_cores_stop_scaling_at_the_host_optimizer():
    """8192 tokens a GPU on an 8-core node: the optimizer's threads fall from 6 to 5, 3 and 1 as
    workers join, its time rises in proportion, and the 2 GPUs already fall short of 2x."""
    config, step, network, optimizer_s = planned(2, 2, 8)
    scales = gpu_scaling(ARCH, config, step, network, optimizer_s, rates_of("h200"))
    assert [s.threads for s in scales] == [6, 5, 3, 1]
    one = scales[0].prediction.optimizer_s
    assert [s.prediction.optimizer_s for s in scales] == pytest.approx([one, one * 6 / 5, one * 2, one * 6])
    end = scaling_end(scales)
    assert end.gpus == 2 and end.prediction.bound == "host optimizer"
    assert end.tokens_per_s < 0.9 * 2 * scales[0].tokens_per_s
    text = scaling_text(ARCH, config, step, network, optimizer_s, rates_of("h200"))
    assert "scaling ends at 2 GPUs" in text and "bound by host optimizer" in text
    assert "the host optimizer hides behind each GPU's" in text and "not even beside one GPU" in text


def test_the_plan_of_a_described_cluster_prints_the_scaling():
    from pathlib import Path

    from megatrain_ray.planning.whatif import load_cluster, plan_cluster

    config, _, _, _ = planned(32, 1, 16)
    cluster = load_cluster(Path(__file__).parents[2] / "examples" / "cluster-h200-1.5tb.yaml")
    text, fits = plan_cluster(ARCH, config, cluster, [100.0])
    assert fits and "scaling over the GPUs of one node at 131072 tokens per GPU a step" in text
    assert "| 8 | " in text and "no end of scaling up to 8 GPUs" in text
