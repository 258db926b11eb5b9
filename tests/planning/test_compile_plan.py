"""Whether the blocks compile is the step plan's decision, made once: executor.compile on a GPU,
unless the model's forward draws random numbers (dropout: its recompute replays the forward's draws,
which a compiled forward and recompute need not draw alike). The planner's kept-graph memory and the
executor (runtime/worker.py passes plan.compile) both follow it."""

import dataclasses

import pytest

pytest.importorskip("transformers")

from transformers import AutoConfig  # noqa: E402

from megatrain_ray.config import config_from_dict  # noqa: E402
from megatrain_ray.models.transformers import modules as hm  # noqa: E402
from megatrain_ray.models.registry import PRESETS, load_hf_arch  # noqa: E402
from megatrain_ray.planning.memory import GiB, KEPT, kept_graph_bytes  # noqa: E402
from megatrain_ray.planning.step_plan import DeviceFacts, plan_step  # noqa: E402
from helpers.hf_parity import randomize, saved  # noqa: E402

GPU = DeviceFacts("cuda", "GPU", 80 * GiB, 400 * GiB)


def gpt2_with_dropout(root):
    """A small GPT-2 with its defaults' dropout (resid_pdrop, embd_pdrop, attn_pdrop 0.1)."""
    fields = {k: v for k, v in AutoConfig.for_model("gpt2").to_dict().items() if k != "architectures"}
    model = randomize(hm.build_small(hm.small_config(fields, hm.decoder_parts(hm.build_empty(fields)).kinds)))
    return load_hf_arch(saved(model, root / "hf"))


def test_a_model_that_draws_random_numbers_is_planned_and_run_uncompiled(tmp_path):
    arch = gpt2_with_dropout(tmp_path)
    raw = {"model": {"path": str(tmp_path / "hf")}, "data": {"seq_len": 64},
           "executor": {"compile": True, "keep_graphs": 1, "offload_activations": "off"}}
    config = config_from_dict(raw)
    plan = plan_step(arch, config, GPU)
    assert plan.compile is False and plan.kept == 1
    eager = dataclasses.replace(config, executor=dataclasses.replace(config.executor, compile=False))
    # the kept graph is planned as the eager block keeps it (not within the compiled activation budget)
    assert plan.memory.by_use[KEPT] == kept_graph_bytes(arch, plan.planned_config(eager))
    assert plan.memory.by_use[KEPT] > kept_graph_bytes(arch, plan.planned_config(config).replace(
        executor=dataclasses.replace(plan.planned_config(config).executor, compile=True)))
    assert config.executor.compile is True  # the config as written


def test_blocks_compile_on_a_gpu_where_asked_and_nowhere_else():
    llama = PRESETS["tiny-llama"]
    config = config_from_dict({"model": {"preset": "tiny-llama"}, "executor": {"compile": True}})
    assert plan_step(llama, config, GPU).compile is True
    assert plan_step(llama, config, DeviceFacts("cpu", "cpu", None, 400 * GiB)).compile is False
    off = config_from_dict({"model": {"preset": "tiny-llama"}, "executor": {"compile": False}})
    assert plan_step(llama, off, GPU).compile is False


def test_the_working_set_a_worker_measured_is_planned_with_and_leaves_the_shape_as_read(tmp_path):
    """A device's measurement (DeviceFacts.measured_working_set, planning/probe.py) is the step plan's:
    the layer's working set and each kept graph are planned from it, and the model's shape carries
    no measurement (one shape, whatever device measured it)."""
    arch = gpt2_with_dropout(tmp_path)
    config = config_from_dict({"model": {"path": str(tmp_path / "hf"), "compute_dtype": "bfloat16"},
                               "data": {"seq_len": 64}, "executor": {"keep_graphs": 1, "offload_activations": "off"}})
    estimated = plan_step(arch, config, GPU)
    measured = plan_step(arch, config, dataclasses.replace(GPU, measured_working_set=1000.0))
    tokens = config.train.micro_batch_size * config.data.seq_len
    assert measured.measured_working_set == 1000.0
    assert measured.memory.by_use["one layer's working set"] == tokens * 1000 * 2
    assert estimated.memory.by_use["one layer's working set"] != tokens * 1000 * 2
    assert measured.kept == 1 and measured.memory.by_use[KEPT] == kept_graph_bytes(
        arch, measured.planned_config(config), measured=1000.0) != estimated.memory.by_use[KEPT]
    assert "measured_working_set" not in arch.to_dict()
