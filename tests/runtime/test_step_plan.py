"""One run plans its step once, on the driver, and every GPU worker builds that plan; the in-process
trainer plans and builds through the same two functions (planning/step_plan.py, runtime/worker.py)."""

import time

import pytest
import ray

from megatrain_ray.config import config_from_dict
from megatrain_ray.models.registry import PRESETS
from megatrain_ray.runtime import local, session as session_module
from megatrain_ray.runtime.local import LocalTrainer
from megatrain_ray.runtime.probe import Probe
from megatrain_ray.runtime.session import Session
from megatrain_ray.runtime.training import run_training
from helpers.runs import tiny_raw


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
    the embedding's AdamW step runs there, from the same plan."""
    plans = counting(monkeypatch, session_module, "plan_step")
    built = []
    start = Session.start_executor

    def start_and_look(self):
        described = start(self)
        built.extend(Probe(self).built())
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


def test_the_in_process_trainer_plans_and_builds_through_the_same_functions(monkeypatch, tmp_path):
    plans = counting(monkeypatch, local, "plan_step")
    builds = counting(monkeypatch, local, "build_executor")
    config = config_from_dict(tiny_raw(tmp_path, steps=1, executor={"keep_graphs": 1}))
    trainer = LocalTrainer(config, PRESETS["tiny-llama"])
    trainer.close()
    assert len(plans) == 1 and len(builds) == 1
    plan = plans[0][2]
    (args, _, executor) = builds[0]
    assert args[2] is plan and executor is trainer.executor and len(executor.kept) == plan.kept == 1


def test_a_plan_is_refused_on_the_driver_before_the_stores_start(local_ray, tmp_path):
    """A step that cannot fit is a PlanError from plan_step, raised by the Session before any store
    allocates its state, and the session leaves no actor behind."""
    from megatrain_ray.planning.plan import PlanError

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
