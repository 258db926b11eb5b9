"""executor.gpu_memory_gib: the step plan fits the step under the cap on a GPU with more memory, giving
up what it may in order (the embedding's step on the device, kept graphs, parked activations, then
a smaller loss chunk, then a smaller MLP chunk), obeys the knobs the user set, refuses a cap too small
with the cap that would do, and `plan --cluster` names the largest model each mode trains on a small
GPU. The cap binds on CUDA only: a CPU run with one trains as without."""

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from megatrain_ray.config import ConfigError, config_from_dict, load_config
from megatrain_ray.models.registry import PRESETS, model_arch, num_params
from megatrain_ray.planning.decisions import fits_leanest
from megatrain_ray.planning.memory import (FEWEST_SLOTS, LOSS_CHUNK_TOKENS, MLP_CHUNK_TOKENS, NUM_SLOTS, PlanError,
                                           SMALLEST_LOSS_CHUNK, SMALLEST_MLP_CHUNK)
from megatrain_ray.planning.step_plan import DeviceFacts, plan_step
from megatrain_ray.planning.whatif import GPU_NODE, cluster_nodes, described_facts, load_cluster, plan_cluster
from megatrain_ray.planning.placement import plan_placement
from megatrain_ray.runtime.local import LocalTrainer
from megatrain_ray.runtime.worker import assemble_worker
from megatrain_ray.host.sources import LocalSource
from helpers.reference_training import random_micro_batches
from helpers.runs import GRAD_ACCUM, make_config

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
GiB = 1024**3
H100 = DeviceFacts("cuda", "H100 80GB", 78 * GiB, 100 * GiB)  # an idle H100 80GB, as a worker reports it


def qwen(preset: str = "qwen2.5-7b", *sets: str):
    config = load_config(EXAMPLES / "qwen2.5-7b-10g.yaml", [f"model.preset={preset}", *sets])
    return model_arch(config.model), config


def capped(config, gib):
    return config.replace(executor=dataclasses.replace(config.executor, gpu_memory_gib=gib))


def test_the_cap_is_the_budget_the_step_is_planned_against():
    arch, config = qwen()
    free = plan_step(arch, capped(config, None), H100)
    assert free.memory_cap is None and free.free_bytes == 78 * GiB
    assert (free.offload, free.loss_chunk_tokens, free.mlp_chunk_tokens, free.num_slots) == (
        False, LOSS_CHUNK_TOKENS, MLP_CHUNK_TOKENS, NUM_SLOTS)
    assert free.kept > 0 and free.embedding_on_device
    ten = plan_step(arch, config, H100)  # the example's 10 GiB
    assert ten.memory_cap == ten.free_bytes == 10 * GiB
    assert ten.memory.total <= 10 * GiB
    assert ten.offload and ten.kept == 0 and not ten.embedding_on_device
    assert ten.loss_chunk_tokens < LOSS_CHUNK_TOKENS
    assert "GPU memory capped at 10.0 GiB" in ten.describe()
    # a cap above what the GPU has free: the free memory is the budget
    assert plan_step(arch, capped(config, 200), H100).free_bytes == 78 * GiB


def chunks(config, loss: int, mlp: int, slots: int = NUM_SLOTS):
    return config.replace(executor=dataclasses.replace(config.executor, loss_chunk_tokens=loss, mlp_chunk_tokens=mlp,
                                                       num_slots=slots))


def test_a_tighter_cap_gives_up_the_step_s_comforts_in_order():
    """Qwen2.5-7B from 40 GiB down to 9 GiB: the embedding's step leaves the GPU, the kept graphs go
    and the activations are parked, then the loss chunk shrinks, only once it is at its smallest
    the MLP chunk, and only then a weight slot goes, the loss chunk then as long as what they gave
    up leaves room for; only where nothing of that fits are the vocabulary layers' gradients summed
    in host memory, which gives the chunks and slots back to shrink again in the same order; every
    plan's peak stays under its cap."""
    arch, config = qwen()
    caps = [gib / 2 for gib in range(80, 24, -1)] + [gib / 20 for gib in range(240, 139, -1)]  # 40 GiB .. 7 GiB
    plans = [plan_step(arch, capped(config, cap), H100) for cap in caps]
    summing = [bool(p.host_gradients) for p in plans]
    assert summing == sorted(summing) and summing[0] is False and summing[-1] is True  # once on, on below
    stages = []
    for before, after in zip(plans, plans[1:]):  # (parking activations may make room for a kept graph again)
        assert after.embedding_on_device <= before.embedding_on_device
        if bool(after.host_gradients) != bool(before.host_gradients):
            off = chunks(config, SMALLEST_LOSS_CHUNK, SMALLEST_MLP_CHUNK, FEWEST_SLOTS)
            assert not fits_leanest(arch, off, after.memory_cap)  # nothing else was left to give
            continue
        assert after.mlp_chunk_tokens <= before.mlp_chunk_tokens and after.num_slots <= before.num_slots
    for p in plans:
        assert p.memory.total <= p.memory_cap
        config = config.replace(executor=dataclasses.replace(config.executor, host_gradients=bool(p.host_gradients)))
        if p.loss_chunk_tokens < LOSS_CHUNK_TOKENS:  # a smaller loss chunk only with nothing else left to give:
            assert p.offload and not p.embedding_on_device  # at twice the chunk, parked and no graph kept, no fit
            assert not fits_leanest(arch, chunks(config, p.loss_chunk_tokens * 2, p.mlp_chunk_tokens, p.num_slots),
                                    p.memory_cap)  # (with the MLP chunk and slots it has: the longest that fits)
        if p.mlp_chunk_tokens < config.data.seq_len:  # only where the smallest loss chunk did not fit
            assert not fits_leanest(arch, chunks(config, SMALLEST_LOSS_CHUNK, p.mlp_chunk_tokens * 2), p.memory_cap)
        if p.num_slots < NUM_SLOTS:
            assert p.mlp_chunk_tokens == SMALLEST_MLP_CHUNK
            assert not fits_leanest(arch, chunks(config, SMALLEST_LOSS_CHUNK, SMALLEST_MLP_CHUNK, p.num_slots + 1),
                                    p.memory_cap)
        stages.append((p.embedding_on_device, p.kept > 0, p.offload, p.loss_chunk_tokens < LOSS_CHUNK_TOKENS,
                       p.mlp_chunk_tokens < config.data.seq_len, p.num_slots < NUM_SLOTS, bool(p.host_gradients)))
    # the sweep passes through every stage, so that the order above was tested, not assumed
    assert (True, True, False, False, False, False, False) in stages  # everything kept
    assert (False, False, True, False, False, False, False) in stages  # parked, nothing kept, the default chunks
    assert (False, False, True, True, False, False, False) in stages  # a smaller loss chunk
    assert (False, False, True, True, True, False, False) in stages  # then a smaller MLP chunk
    assert (False, False, True, True, True, True, False) in stages  # then a weight slot fewer
    assert (False, False, True, True, False, False, True) in stages  # then the gradients in host memory
    assert (False, False, True, True, True, True, True) in stages  # and again down to the least
    assert plans[-1].num_slots >= FEWEST_SLOTS
    # and a smaller MLP chunk or a slot fewer gave the loss chunk room to grow back, somewhere on the way
    assert any(p.loss_chunk_tokens > SMALLEST_LOSS_CHUNK and (p.mlp_chunk_tokens < config.data.seq_len or
                                                               p.num_slots < NUM_SLOTS) for p in plans)


@pytest.mark.parametrize("preset, sets, gib", [
    ("qwen2.5-7b", (), 10),
    ("qwen2.5-14b", ("optim.master=bf16", "optim.moments=int8"), 24),  # the 6-byte mode
])
def test_the_done_when_runs_fit_under_their_caps_on_the_h100_machine(preset, sets, gib):
    """examples/cluster-h100-128g.yaml: the host holds the state and the parked activations, the GPU's
    predicted peak stays under the cap."""
    arch, config = qwen(preset, *sets, f"executor.gpu_memory_gib={gib}")
    spec = load_cluster(EXAMPLES / "cluster-h100-128g.yaml")
    step = plan_step(arch, config, described_facts(spec), plan_placement(arch, config, cluster_nodes(spec), GPU_NODE),
                     stores_allocated=False)
    assert step.memory_cap == step.free_bytes == gib * GiB and step.memory.total <= gib * GiB
    assert not step.embedding_on_device


def test_knobs_the_user_set_are_obeyed_or_refused_with_the_figure():
    arch, config = qwen()
    obeyed = plan_step(arch, config.replace(executor=dataclasses.replace(config.executor, loss_chunk_tokens=512)), H100)
    assert obeyed.loss_chunk_tokens == 512 and obeyed.memory.total <= 10 * GiB
    fixed = config.replace(executor=dataclasses.replace(config.executor, loss_chunk_tokens=4096, mlp_chunk_tokens=0))
    with pytest.raises(PlanError, match=r"may use 10\.0 GiB .*executor\.gpu_memory_gib.*loss chunk: 5\.22 GiB"):
        plan_step(arch, fixed, H100)


def test_a_cap_too_small_is_refused_with_the_cap_that_would_do():
    arch, config = qwen()
    with pytest.raises(PlanError) as refused:
        plan_step(arch, capped(config, 4), H100)
    needed = float(re.search(r"it fits under (\d+\.\d) GiB", str(refused.value)).group(1))
    assert needed > 4
    fits = plan_step(arch, capped(config, needed), H100)
    assert fits.memory.total <= needed * GiB
    with pytest.raises(PlanError):
        plan_step(arch, capped(config, needed - 0.2), H100)


def test_gpu_memory_gib_is_validated():
    with pytest.raises(ConfigError, match="executor.gpu_memory_gib must be a finite number > 0"):
        config_from_dict({"model": {"preset": "tiny-llama"}, "executor": {"gpu_memory_gib": 0}})


def largest_named(text: str) -> dict[str, str]:
    """The largest-model line of `plan --cluster`: the preset named for each of AdamW's modes (Muon's,
    `optim.name=muon optim.master=...`, left out)."""
    found = re.findall(r"(?<!muon )optim\.master=(\w+) optim\.moments=(\w+): ([\w.\-]+) \(\d+\.\d B params\): peak", text)
    return {f"{master}/{moments}": name for master, moments, name in found}


def test_plan_names_the_largest_model_a_10_gib_card_with_64_gib_trains():
    """examples/cluster-10g-64g.yaml: for each mode, the preset it names fits host and GPU both,
    with the shape printed, and no larger preset does."""
    spec = load_cluster(EXAMPLES / "cluster-10g-64g.yaml")
    arch, config = qwen()
    text, _ = plan_cluster(arch, capped(config, None), spec, [10.0])
    named = largest_named(text)
    assert len(named) == 4 and num_params(PRESETS[named["bf16/int8"]]) > num_params(PRESETS[named["fp32/fp32"]])
    nodes = cluster_nodes(spec)
    facts = described_facts(spec)
    for mode, name in named.items():
        master, moments = mode.split("/")
        moded = config.replace(optim=dataclasses.replace(config.optim, master=master, moments=moments))
        for other, other_arch in PRESETS.items():
            if other.startswith("tiny-") or num_params(other_arch) <= num_params(PRESETS[name]):
                continue
            try:  # a larger preset: refused by the host's memory or by the GPU's
                step = plan_step(other_arch, moded, facts, plan_placement(other_arch, moded, nodes, GPU_NODE),
                                 stores_allocated=False, refuse=False)
            except (ConfigError, PlanError):
                continue
            assert step.refused is not None, f"{other} fits in {mode} but {name} was named"
    assert "loss chunk" in text and "activations parked in host memory" in text


def test_the_executor_takes_the_plan_s_chunks():
    """The worker builds what the plan says, not what the config says (runtime/worker.py)."""
    config = make_config("tiny-llama")
    trainer = LocalTrainer(config, PRESETS["tiny-llama"])
    plan = dataclasses.replace(trainer.plan, loss_chunk_tokens=3, mlp_chunk_tokens=6)
    worker = assemble_worker(trainer.arch, config, plan, LocalSource(trainer.stores), torch.device("cpu"))
    assert (worker.executor.loss_chunk_tokens, worker.executor.mlp_chunk) == (3, 6)
    worker.source.close()
    trainer.close()


def test_a_cpu_run_with_a_cap_trains_as_without():
    """The cap binds on CUDA only (the worker's allocator there): on the CPU the same step, exactly."""
    arch = PRESETS["tiny-llama"]
    losses = []
    for cap in (None, 0.001):
        config = make_config("tiny-llama", gpu_memory_gib=cap)
        trainer = LocalTrainer(config, arch)
        assert trainer.plan.memory_cap is None
        data = random_micro_batches(arch, 1, GRAD_ACCUM, 2, 16, seed=0)
        losses.append([trainer.train_step(step).loss for step in data])
        trainer.close()
    assert losses[0] == losses[1]


@pytest.mark.gpu
def test_the_worker_s_allocator_is_held_to_the_cap():
    """On a GPU larger than the cap, an allocation past it fails as it would on the small GPU."""
    from megatrain_ray.runtime.worker import hold_to_cap

    device = torch.device("cuda")
    arch, config = qwen("tiny-llama", "executor.gpu_memory_gib=1")
    plan = plan_step(arch, config, DeviceFacts("cuda", "GPU", 78 * GiB, 100 * GiB))
    hold_to_cap(plan, device)
    try:
        small = torch.empty(GiB // 2, dtype=torch.uint8, device=device)
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(GiB, dtype=torch.uint8, device=device)
        del small
    finally:
        hold_to_cap(dataclasses.replace(plan, memory_cap=None), device)
        torch.cuda.empty_cache()
