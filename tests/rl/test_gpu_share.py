"""How a GRPO run splits the GPU between the rollout and the training step (planning/gpu_share.py),
decided once in the step plan from the GPU the workers report: every decoder layer of the rollout
resident where they fit beside the KV cache and the step's need, else as many as fit and the
others streamed, else refused. The config stays as written: the split is the plan's."""

import dataclasses

import pytest

from megatrain_ray.config import ConfigError, config_from_dict
from megatrain_ray.models.registry import PRESETS, model_layouts
from megatrain_ray.objective import objective_of
from megatrain_ray.planning.gpu_share import gpu_share, split_shared, trainer_need
from megatrain_ray.planning.memory import PlanError
from megatrain_ray.planning.step_plan import DeviceFacts, plan_step, planner_view
from megatrain_ray.rl.rollout import GiB, rollout_bytes

ARCH = PRESETS["qwen2.5-7b"]  # 28 decoder layers of 233 M parameters: 0.43 GiB each in bf16
ROWS, SEQ = 64, 768


def grpo_config(**grpo):
    return config_from_dict({
        "model": {"preset": "qwen2.5-7b", "compute_dtype": "bfloat16"}, "data": {"seq_len": SEQ},
        "train": {"objective": "grpo", "micro_batch_size": 8},
        "grpo": {"group_size": 8, "prompts_per_step": 8, "max_new_tokens": 512, **grpo}})


def viewed(config):
    """The config as the planner reads it: a step's micro-batches the objective's (8 rows of 8)."""
    return planner_view(config, objective_of(config).micro_batches, False, None)


def share(config, total):
    return split_shared(ARCH, viewed(config), objective_of(config), total)


def test_every_layer_stays_resident_where_the_gpu_holds_them():
    split = share(grpo_config(), 80 * GiB)
    assert split.resident_layers is None
    assert split.rollout_bytes == rollout_bytes(ARCH, ROWS, SEQ, 2) and split.trainer_cap == 80 * GiB - split.rollout_bytes


def test_the_rollout_keeps_as_many_layers_as_fit_beside_the_step():
    config = grpo_config()
    need = trainer_need(ARCH, viewed(config))
    layer = rollout_bytes(ARCH, ROWS, SEQ, 2, 11) - rollout_bytes(ARCH, ROWS, SEQ, 2, 10)
    assert layer == model_layouts(ARCH)[1].numel * 2  # one more resident: one decoder layer's bf16 bytes
    total = need + rollout_bytes(ARCH, ROWS, SEQ, 2, 10) + layer // 2  # room for 10 layers and half an 11th
    split = share(config, total)
    assert split.resident_layers == 10
    assert split.trainer_cap == total - rollout_bytes(ARCH, ROWS, SEQ, 2, 10) >= need
    # set by the user: as set, the step planned within what it leaves
    forced = share(config.replace(grpo=dataclasses.replace(config.grpo, rollout_resident_layers=3)), total)
    assert forced.resident_layers == 3 and forced.trainer_cap == total - rollout_bytes(ARCH, ROWS, SEQ, 2, 3)
    # where not even the KV cache and two slots fit beside the step: none (the plan refuses)
    assert share(config, need + rollout_bytes(ARCH, ROWS, SEQ, 2, 0) - 1).resident_layers == -1


def test_the_need_of_the_step_and_a_wrong_setting():
    config = grpo_config()
    assert trainer_need(ARCH, viewed(config)) >= 4 * GiB
    capped = config.replace(executor=dataclasses.replace(config.executor, gpu_memory_gib=30.0))
    assert share(capped, 60 * GiB).trainer_cap == 30 * GiB
    with pytest.raises(ConfigError, match="rollout_resident_layers must be >= 0"):
        grpo_config(rollout_resident_layers=-2)


def test_the_split_is_the_step_plan_s_from_the_workers_gpu_and_said_or_refused():
    """plan_step sizes the split from the total memory the workers report of their GPU (not the
    driver's): the rollout's resident layers and bytes and the step's cap are plan fields, the
    start line says them, and the config is unchanged."""
    config = grpo_config()
    total = trainer_need(ARCH, viewed(config)) + rollout_bytes(ARCH, ROWS, SEQ, 2, 10)
    plan = plan_step(ARCH, config, DeviceFacts("cuda", "GPU", total, 400 * GiB, total_bytes=total))
    assert plan.rollout.resident_layers == 10 and plan.rollout.rollout_bytes == rollout_bytes(ARCH, ROWS, SEQ, 2, 10)
    assert plan.memory_cap == total - rollout_bytes(ARCH, ROWS, SEQ, 2, 10)
    assert plan.micro_batches == 8 and config.train.grad_accum == 1  # a step's completions' rows, the config as written
    assert "10 of its 28 decoder layers resident and the other 18 streamed" in plan.describe()
    assert config == grpo_config() and config.grpo.rollout_resident_layers is None
    roomy = plan_step(ARCH, config, DeviceFacts("cuda", "GPU", 140 * GiB, 400 * GiB, total_bytes=140 * GiB))
    assert roomy.rollout.resident_layers is None
    with pytest.raises(PlanError, match="0 of its 28 decoder layers on the GPU.*fewer grpo.prompts_per_step"):
        small = rollout_bytes(ARCH, ROWS, SEQ, 2, 0) + 2 * GiB
        plan_step(ARCH, config, DeviceFacts("cuda", "GPU", small, 400 * GiB, total_bytes=small))
    # the CPU path and a rollout on the CPU share nothing
    assert gpu_share(ARCH, viewed(config), objective_of(config), "cpu", None).rollout_bytes == 0
    on_cpu = grpo_config(rollout_device="cpu")
    assert gpu_share(ARCH, viewed(on_cpu), objective_of(on_cpu), "cuda", total).rollout_bytes == 0


def test_a_rollout_on_a_gpu_of_its_own_must_fit_it():
    own = grpo_config(rollout_gpu="own")
    plan = plan_step(ARCH, own, DeviceFacts("cuda", "GPU", 80 * GiB, 400 * GiB, total_bytes=80 * GiB))
    assert plan.rollout.own_gpu and plan.rollout.rollout_bytes == rollout_bytes(ARCH, ROWS, SEQ, 2)
    assert plan.memory_cap is None and "a GPU of its own" in plan.describe()
    with pytest.raises(PlanError, match="grpo.rollout_gpu=own: the rollout's copy"):
        plan_step(ARCH, own, DeviceFacts("cuda", "GPU", 16 * GiB, 400 * GiB, total_bytes=16 * GiB))


def test_a_rollout_gpu_of_its_own_is_taken_from_the_workers():
    """grpo.rollout_gpu=own: the workers take the node's other GPUs, as many as split a step's
    micro-batches evenly (8 here: 2 of 3, 4 of 4 or 5); a node of one GPU is refused with what to do."""
    from megatrain_ray.planning.placement import NodeInfo, plan_placement

    def node(gpus: float) -> NodeInfo:
        return NodeInfo("gpu", "10.0.0.1", gpus, False, 400 * GiB)

    def on_cuda(config):
        return config.replace(executor=dataclasses.replace(config.executor, device="cuda"))

    shared, own = on_cuda(grpo_config()), on_cuda(grpo_config(rollout_gpu="own"))
    assert plan_placement(ARCH, shared, [node(2.0)], "gpu").num_gpus == 2
    assert plan_placement(ARCH, own, [node(2.0)], "gpu").num_gpus == 1
    assert [plan_placement(ARCH, own, [node(n)], "gpu").num_gpus for n in (4.0, 5.0, 6.0)] == [2, 4, 4]
    with pytest.raises(ConfigError, match="grpo.rollout_gpu=own needs 1 GPU.s. for the rollout beside the workers'"):
        plan_placement(ARCH, own, [node(1.0)], "gpu")
    # two copies of their own take two GPUs: 2 workers of 4 GPUs, 1 of 3, refused on 2
    two = on_cuda(grpo_config(rollout_gpu="own", rollout_gpus=2))
    assert [plan_placement(ARCH, two, [node(n)], "gpu").num_gpus for n in (3.0, 4.0, 6.0)] == [1, 2, 4]
    with pytest.raises(ConfigError, match="needs 2 GPU.s. for the rollout.*fewer grpo.rollout_gpus"):
        plan_placement(ARCH, two, [node(2.0)], "gpu")
    with pytest.raises(ConfigError, match="keeps every layer of the rollout's copy on its GPU"):
        grpo_config(rollout_gpu="own", rollout_resident_layers=3)


def test_the_plan_samples_on_every_worker_s_gpu_each_copy_its_share_of_the_prompts():
    """grpo.rollout_gpu=shared: by default a rollout copy on each worker's GPU (at most one a
    prompt), each with the KV cache of its share of the rows; grpo.rollout_gpus sets the count, more
    than the workers refused, more than the prompts refused before Ray; own: that many GPUs of their own."""
    facts = DeviceFacts("cuda", "GPU", 80 * GiB, 400 * GiB, total_bytes=80 * GiB)
    config = grpo_config()
    objective = objective_of(config)
    assert [gpu_share(ARCH, viewed(config), objective, "cuda", 80 * GiB, n).samplers for n in (1, 2, 3, 4)] == \
        [1, 2, 3, 4]
    four = gpu_share(ARCH, viewed(config), objective, "cuda", 80 * GiB, 4)
    assert four.rollout_bytes == rollout_bytes(ARCH, ROWS // 4, SEQ, 2) and "each of 4 GPUs" in four.describe()
    three = gpu_share(ARCH, viewed(config), objective, "cuda", 80 * GiB, 3)  # 8 prompts over 3: 3, 3, 2
    assert three.rollout_bytes == rollout_bytes(ARCH, 3 * 8, SEQ, 2)
    few = grpo_config(prompts_per_step=2)
    assert gpu_share(ARCH, viewed(few), objective_of(few), "cuda", 80 * GiB, 4).samplers == 2
    assert gpu_share(ARCH, viewed(config), objective, "cpu", None, 2).samplers == 2  # processes without GPUs
    asked = grpo_config(rollout_gpus=2)
    assert gpu_share(ARCH, viewed(asked), objective_of(asked), "cuda", 80 * GiB, 4).samplers == 2
    with pytest.raises(PlanError, match="grpo.rollout_gpus=2 copies of the rollout would share the GPUs of 1 GPU"):
        plan_step(ARCH, asked, facts)
    assert plan_step(ARCH, asked, facts, refuse=False).refused.startswith("grpo.rollout_gpus=2")
    with pytest.raises(ConfigError, match="grpo.rollout_gpus must be within 1 and grpo.prompts_per_step"):
        grpo_config(rollout_gpus=9)
    with pytest.raises(ConfigError, match="grpo.rollout_gpus must be within 1"):
        grpo_config(rollout_gpus=0)
    own = grpo_config(rollout_gpu="own", rollout_gpus=2)
    split = plan_step(ARCH, own, facts).rollout
    assert split.samplers == 2 and split.rollout_bytes == rollout_bytes(ARCH, ROWS // 2, SEQ, 2)
    assert "2 GPUs of its own" in split.describe()
    assert plan_step(ARCH, grpo_config(rollout_gpu="own"), facts).rollout.samplers == 1
    assert gpu_share(ARCH, viewed(grpo_config()), objective_of(grpo_config()), "cuda", 80 * GiB, 1).samplers == 1
