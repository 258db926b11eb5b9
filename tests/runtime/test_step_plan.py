"""Every caller reaches its step's decisions through one function, once per run (planning/step_plan.py:
plan_step), and renders or builds the StepPlan it returns: a run's session, whose GPU workers build
that plan; the in-process trainer; `plan` on the cluster Ray is connected to and `plan --cluster`
on a described one; the benchmark, once per step shape. Workers are assembled by one function
(runtime/worker.py: assemble_worker)."""

import argparse
import time

import pytest
import ray

from megatrain_ray import api
from megatrain_ray.bench import telemetry as bench_telemetry
from megatrain_ray.config import config_from_dict
from megatrain_ray.models.registry import PRESETS
from megatrain_ray.planning import step_plan, whatif
from megatrain_ray.planning.memory import size
from megatrain_ray.runtime import local, session as session_module
from megatrain_ray.runtime.local import LocalTrainer
from megatrain_ray.bench.telemetry import Probe, ProbedWorker
from megatrain_ray.bench.arguments import add_arguments
from megatrain_ray.bench.run import bench_config, run_shapes, shapes_from
from megatrain_ray.runtime.session import Session
from megatrain_ray.runtime.training import run_training
from helpers.runs import tiny_raw
from helpers.sessions import probed_session


def counting(monkeypatch, module, name: str) -> list:
    """Every call of module.name, recorded (arguments and result) while the real function runs."""
    real, calls = getattr(module, name), []

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append((args, kwargs, out))
        return out

    monkeypatch.setattr(module, name, spy)
    return calls


@pytest.mark.parametrize("device, workers", [("cpu", 2), pytest.param("cuda", 1, marks=pytest.mark.gpu)])
def test_a_run_plans_its_step_once_and_its_workers_build_that_plan(local_ray, monkeypatch, tmp_path, device, workers):
    """`megatrain-ray train`'s own loop (two CPU workers, or one GPU): plan_step runs once in the
    driver, and each worker's executor keeps the blocks and parks what that one plan says; on a GPU
    the embedding's AdamW step runs there, from the same plan. The config the run started with is
    the one read: the plan's decisions are the plan's."""
    plans = counting(monkeypatch, session_module, "plan_step")
    monkeypatch.setattr(session_module, "GpuWorker", ProbedWorker)  # the run's workers, reporting what they built
    built, started = [], []
    start = Session.start_executor

    def start_and_look(self):
        described = start(self)
        built.extend(Probe(self).built())
        started.append(self.config)
        return described

    monkeypatch.setattr(Session, "start_executor", start_and_look)
    raw = tiny_raw(tmp_path / "run", steps=2, executor={"keep_graphs": 1, "device": device},
                   runtime={"num_gpus": workers, "worker_threads": 1})
    summary = run_training(config_from_dict(raw))
    assert summary["final_loss"] is not None
    assert len(plans) == 1, f"the step was planned {len(plans)} times"
    plan = plans[0][2]
    assert (plan.device, plan.workers, plan.micro_batches_per_worker) == (device, workers, 2 // workers)
    assert plan.kept == 1 and not plan.offload and plan.embedding_on_device == (device == "cuda")
    assert built == [(plan, 1, False)] * workers
    assert started == [config_from_dict(raw)]


def every_plan(monkeypatch) -> list:
    """Every StepPlan plan_step returns, wherever it is called from (the callers import it)."""
    real, plans = step_plan.plan_step, []

    def spy(*args, **kwargs):
        plans.append(real(*args, **kwargs))
        return plans[-1]

    for module in (step_plan, session_module, local, whatif, bench_telemetry):
        monkeypatch.setattr(module, "plan_step", spy)
    return plans


def test_the_in_process_trainer_plans_and_assembles_through_the_same_functions(monkeypatch, tmp_path):
    plans = every_plan(monkeypatch)
    assembled = counting(monkeypatch, local, "assemble_worker")
    config = config_from_dict(tiny_raw(tmp_path, steps=1, executor={"keep_graphs": 1}))
    trainer = LocalTrainer(config, PRESETS["tiny-llama"])
    trainer.close()
    assert len(plans) == 1 and len(assembled) == 1
    (args, _, worker) = assembled[0]
    assert args[2] is plans[0] and worker.executor is trainer.executor and len(worker.executor.kept) == plans[0].kept == 1
    # the build's seconds by part, for the GPU worker's start-up line (no embedding step on the CPU)
    assert list(worker.seconds) == ["the process group", "the executor"]
    assert all(s >= 0 for s in worker.seconds.values())


def test_plan_of_a_described_cluster_renders_the_one_plan(monkeypatch, capsys, tmp_path):
    plans = every_plan(monkeypatch)
    # the largest-model line plans each preset it tries through plan_step too (tests/planning/test_gpu_cap.py)
    monkeypatch.setattr(whatif, "largest_trainable", lambda *args: "")
    assert api.plan("examples/tiny.yaml", cluster="examples/cluster-4x512.yaml", model={"preset": "qwen2.5-7b"})
    out = capsys.readouterr().out
    assert len(plans) == 1
    assert f"predicted peak {size(plans[0].memory.total)} of {size(plans[0].free_bytes)} free" in out


def test_plan_of_the_cluster_renders_the_one_plan(local_ray, monkeypatch, capsys, tmp_path):
    plans = every_plan(monkeypatch)
    assert api.plan(tiny_raw(tmp_path, executor={"keep_graphs": 1}))
    out = capsys.readouterr().out
    assert len(plans) == 1 and plans[0].kept == 1
    assert f"predicted peak {size(plans[0].memory.total)}" in out and "the last 1 of 2 blocks" in out


def test_the_benchmark_plans_each_shape_once_and_renders_that_plan(local_ray, monkeypatch, capsys, tmp_path):
    """A sweep of two step shapes on one session: one plan per shape, each built by the workers
    (reassembled for the second) and printed as planned."""
    plans = every_plan(monkeypatch)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", "tiny-llama", "--device", "cpu", "--seq-len", "16", "--micro-batch", "2", "1",
                              "--grad-accum", "2", "--steps", "1", "--warmup", "0", "--optimizer-threads", "1",
                              "--keep-graphs", "1", "0"])
    shapes = shapes_from(args)
    built = []
    reconfigure = Probe.reconfigure

    def reconfigure_and_look(self, config):
        reconfigure(self, config)
        built.extend(self.built())

    monkeypatch.setattr(Probe, "reconfigure", reconfigure_and_look)
    session = probed_session(bench_config(args, shapes[0]), PRESETS["tiny-llama"])
    runs = run_shapes(PRESETS["tiny-llama"], args, shapes, session, lambda runs: None)
    out = capsys.readouterr().out
    assert [r["median"]["kept_graphs"] for r in runs] == [1, 0]
    assert len(plans) == 2 and [p.kept for p in plans] == [1, 0]
    assert built == [(plans[1], 0, False)]
    assert out.count("kept forward graphs: the last 1 of 2 blocks") == 1


def test_a_plan_is_refused_on_the_driver_before_the_stores_start(local_ray, tmp_path):
    """A step that cannot fit is a PlanError from plan_step, raised by the Session before any store
    allocates its state, and the session leaves no actor behind."""
    from megatrain_ray.planning.memory import PlanError

    raw = tiny_raw(tmp_path, steps=1)
    raw["train"] = {**raw["train"], "micro_batch_size": 64, "grad_accum": 64}
    raw["data"] = {**raw["data"], "seq_len": 2**20}
    config = config_from_dict(raw)
    with pytest.raises(PlanError, match="the step needs about"):
        Session(config, PRESETS["tiny-llama"])
    deadline = time.monotonic() + 30  # ray.kill returns before the actor is marked dead
    while (alive := [a for a in ray._private.state.actors().values() if a["State"] == "ALIVE"]) and \
            time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive, alive
