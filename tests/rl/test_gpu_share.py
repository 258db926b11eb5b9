"""How a GRPO run splits the GPU between the rollout and the training step (runtime/grpo.py,
share_gpu), decided once from the model's shape: every decoder layer of the rollout resident
where they fit beside the KV cache and the step's need, else as many as fit and the others
streamed, else refused."""

import dataclasses

import pytest

from megatrain_ray.config import ConfigError, config_from_dict
from megatrain_ray.models.registry import PRESETS, model_layouts
from megatrain_ray.rl.rollout import GiB, rollout_bytes
from megatrain_ray.runtime.grpo import grpo_run_config, plan_shared_gpu, share_gpu, trainer_need

ARCH = PRESETS["qwen2.5-7b"]  # 28 decoder layers of 233 M parameters: 0.43 GiB each in bf16
ROWS, SEQ = 64, 768


def grpo_config(**grpo):
    config = config_from_dict({
        "model": {"preset": "qwen2.5-7b", "compute_dtype": "bfloat16"}, "data": {"seq_len": SEQ},
        "train": {"objective": "grpo", "micro_batch_size": 8},
        "grpo": {"group_size": 8, "prompts_per_step": 8, "max_new_tokens": 512, **grpo},
        "executor": {"device": "cpu"}})
    return grpo_run_config(config, ARCH)  # on the CPU: no GPU to share yet


def test_every_layer_stays_resident_where_the_gpu_holds_them():
    config = grpo_config()
    share = share_gpu(config, ARCH, 80 * GiB)
    assert share.resident_layers is None
    assert share.rollout_bytes == rollout_bytes(ARCH, ROWS, SEQ, 2) and share.trainer_bytes == 80 * GiB - share.rollout_bytes


def test_the_rollout_keeps_as_many_layers_as_fit_beside_the_step():
    config = grpo_config()
    need = trainer_need(config, ARCH)
    layer = rollout_bytes(ARCH, ROWS, SEQ, 2, 11) - rollout_bytes(ARCH, ROWS, SEQ, 2, 10)
    assert layer == model_layouts(ARCH)[1].numel * 2  # one more resident: one decoder layer's bf16 bytes
    total = need + rollout_bytes(ARCH, ROWS, SEQ, 2, 10) + layer // 2  # room for 10 layers and half an 11th
    share = share_gpu(config, ARCH, total)
    assert share.resident_layers == 10
    assert share.trainer_bytes == total - rollout_bytes(ARCH, ROWS, SEQ, 2, 10) >= need
    # set by the user: as set, the step planned within what it leaves
    forced = share_gpu(config.replace(grpo=dataclasses.replace(config.grpo, rollout_resident_layers=3)), ARCH, total)
    assert forced.resident_layers == 3 and forced.trainer_bytes == total - rollout_bytes(ARCH, ROWS, SEQ, 2, 3)
    # where not even the KV cache and two slots fit beside the step: none (plan_shared_gpu refuses)
    assert share_gpu(config, ARCH, need + rollout_bytes(ARCH, ROWS, SEQ, 2, 0) - 1).resident_layers == -1


def test_the_need_of_the_step_and_a_wrong_setting():
    config = grpo_config()
    assert trainer_need(config, ARCH) >= 4 * GiB
    capped = config.replace(executor=dataclasses.replace(config.executor, gpu_memory_gib=30.0))
    assert share_gpu(capped, ARCH, 60 * GiB).trainer_bytes == 30 * GiB
    with pytest.raises(ConfigError, match="rollout_resident_layers must be >= 0"):
        grpo_config(rollout_resident_layers=-2)


def test_the_split_is_said_and_carried_in_the_config_or_refused():
    config = grpo_config()
    total = trainer_need(config, ARCH) + rollout_bytes(ARCH, ROWS, SEQ, 2, 10)
    said = []
    planned = plan_shared_gpu(config, ARCH, total, said.append)
    assert planned.grpo.rollout_resident_layers == 10
    assert planned.executor.gpu_memory_gib == round((total - rollout_bytes(ARCH, ROWS, SEQ, 2, 10)) / GiB, 2)
    assert "10 of its 28 decoder layers resident and the other 18 streamed" in said[0]
    assert plan_shared_gpu(config, ARCH, 80 * GiB, said.append).grpo.rollout_resident_layers is None
    with pytest.raises(ConfigError, match="0 of its 28 decoder layers on the GPU.*fewer grpo.prompts_per_step"):
        plan_shared_gpu(config, ARCH, rollout_bytes(ARCH, ROWS, SEQ, 2, 0) + 2 * GiB)


def test_a_rollout_gpu_of_its_own_is_taken_from_the_workers():
    """grpo.rollout_gpu=own: the workers take every GPU of the node but one; a node of one GPU is
    refused with what to do."""
    from megatrain_ray.planning.placement import NodeInfo, plan_placement

    def node(gpus: float) -> NodeInfo:
        return NodeInfo("gpu", "10.0.0.1", gpus, False, 400 * GiB)

    def on_cuda(config):
        return config.replace(executor=dataclasses.replace(config.executor, device="cuda"))

    shared, own = on_cuda(grpo_config()), on_cuda(grpo_config(rollout_gpu="own"))
    assert plan_placement(ARCH, shared, [node(2.0)], "gpu").num_gpus == 2
    assert plan_placement(ARCH, own, [node(2.0)], "gpu").num_gpus == 1
    with pytest.raises(ConfigError, match="grpo.rollout_gpu=own needs a GPU for the rollout beside the workers'"):
        plan_placement(ARCH, own, [node(1.0)], "gpu")
    with pytest.raises(ConfigError, match="keeps every layer of the rollout's copy on its GPU"):
        grpo_config(rollout_gpu="own", rollout_resident_layers=3)
