"""Faults on a real multi-node Ray cluster (ray.cluster_utils.Cluster) and non-finite steps.

A RAM node removed mid-run stops the run within seconds, naming the node and the last good
checkpoint; with auto-resume the run waits for room, restores and finishes with the weights of an
uninterrupted run.
"""

import json
import threading
import time
from pathlib import Path

import pytest
import ray
import torch
from ray.cluster_utils import Cluster

from megatrain_ray.files import checkpoint as ckpt, shard
from megatrain_ray.config import config_from_dict
from megatrain_ray.runtime.training import TrainingDiverged, run_training
from megatrain_ray.runtime.watchdog import ClusterFault
from megatrain_ray.models.registry import PRESETS
from megatrain_ray.models.registry import model_layouts
from megatrain_ray.host.store import ShardStore
from helpers.runs import tensors_of, tiny_raw

MiB = 1024**2
RAM = {"megatrain_ram": 1}
# Ray notices a dead node after health_check_failure_threshold missed checks: make that ~1.5 s.
FAST_HEALTH_CHECKS = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 300,
                      "health_check_timeout_ms": 300, "health_check_failure_threshold": 3}
# The tests remove a node as soon as the checkpoint of step EVERY is written; the run then stops (or
# auto-resumes) at the next step that needs the node, one or two steps on (the lost-node test checks
# that bound itself). 16 more steps after that checkpoint, each of which needs every node, leave room
# for a loaded box's delays between seeing the checkpoint and removing the node, well past the ~1.5 s
# Ray takes to declare the node dead; a removal that came after the run's end would fail both tests.
STEPS, EVERY = 20, 4


@pytest.fixture(scope="module")
def cluster():
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "object_store_memory": 100 * MiB, "_system_config": FAST_HEALTH_CHECKS,
        "include_dashboard": False})  # no test reads it
    for _ in range(2):
        cluster.add_node(num_cpus=1, object_store_memory=80 * MiB, resources=RAM)
    ray.init(address=cluster.address)
    cluster.wait_for_nodes()
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def fault_config(out: Path, **train):
    return config_from_dict(tiny_raw(out, steps=STEPS, checkpoint={"every": EVERY, "keep": 10},
                                     train={"resume_wait_s": 60.0, **train}))


def ram_nodes(cluster) -> list:
    return [n for n in cluster.list_all_nodes() if n is not cluster.head_node]


class Background:
    """run_training on a thread; the test removes nodes meanwhile."""

    def __init__(self, config, **kwargs):
        self.result, self.error = None, None
        self.thread = threading.Thread(target=self._run, args=(config,), kwargs=kwargs, daemon=True)
        self.thread.start()

    def _run(self, config, **kwargs):
        try:
            self.result = run_training(config, **kwargs)
        except BaseException as e:  # handed to the test
            self.error = e

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"the run did not stop within {timeout} s"


def wait_for_checkpoint(root: Path, step: int, timeout: float = 60.0) -> Path:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = [p for p in ckpt.list_checkpoints(root) if int(p.name.split("-")[1]) >= step]
        if done:
            return done[0]
        time.sleep(0.05)
    raise AssertionError(f"no checkpoint of step >= {step} under {root} within {timeout} s")


def steps_logged(out: Path) -> int:
    """Steps the run has finished: lines of its metrics.jsonl."""
    path = out / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_lost_ram_node_stops_the_run_naming_node_and_checkpoint(cluster, tmp_path):
    config = fault_config(tmp_path / "run", auto_resume=False)
    run = Background(config)
    wait_for_checkpoint(tmp_path / "run" / "checkpoints", EVERY)
    victim = ram_nodes(cluster)[-1]
    before = steps_logged(tmp_path / "run")
    cluster.remove_node(victim)
    run.join(timeout=30)

    assert isinstance(run.error, ClusterFault), repr(run.error)
    message = str(run.error)
    assert victim.node_id in message, message
    last = ckpt.list_checkpoints(tmp_path / "run" / "checkpoints")[-1]
    assert f"last good checkpoint: {last}" in message, message
    assert "--resume" in message, message
    # Stopped at the next step that needed the node, not at the run's end: at most the step in
    # flight and one that finished between reading `before` and the removal.
    after = steps_logged(tmp_path / "run")
    assert after <= before + 2 < STEPS, (before, after)
    cluster.add_node(num_cpus=1, object_store_memory=80 * MiB, resources=RAM)  # back to three nodes
    cluster.wait_for_nodes()


def test_auto_resume_after_lost_node_equals_uninterrupted_run(cluster, tmp_path, capsys):
    expected = run_training(fault_config(tmp_path / "whole", auto_resume=False))

    run = Background(fault_config(tmp_path / "run", auto_resume=True))
    wait_for_checkpoint(tmp_path / "run" / "checkpoints", EVERY)
    cluster.remove_node(ram_nodes(cluster)[-1])
    cluster.add_node(num_cpus=1, object_store_memory=80 * MiB, resources=RAM)
    run.join(timeout=90)

    assert run.error is None, repr(run.error)
    out = capsys.readouterr().out
    assert "auto-resume 1/3" in out and "resumed from" in out, out[-3000:]
    a, b = Path(expected["checkpoint"]), Path(run.result["checkpoint"])
    assert a.name == b.name == f"step-{STEPS:08d}"
    ta, tb = tensors_of(a), tensors_of(b)
    assert ta.keys() == tb.keys()
    for name in ta:
        assert torch.equal(ta[name], tb[name]), name


# ---------------------------------------------------------------------------------------------
# Non-finite steps
# ---------------------------------------------------------------------------------------------


def exploding_raw(out: Path, steps: int, max_bad_steps: int, embedding_step: str = "auto", num_gpus: int = 1) -> dict:
    """Weights of size 1e30 overflow fp32 in the first matmul: every step is non-finite, deterministically."""
    return tiny_raw(out, steps=steps, model={"init_std": 1e30}, train={"max_bad_steps": max_bad_steps},
                    checkpoint={"every": 0}, executor={"embedding_step": embedding_step}, runtime={"num_gpus": num_gpus})


@pytest.mark.parametrize("embedding_step,num_gpus", [("host", 1), ("device", 2)])
def test_non_finite_steps_are_skipped_and_leave_the_state_unchanged(cluster, tmp_path, capsys, embedding_step,
                                                                    num_gpus):
    """On the host, and with the embedding's step on the device of the worker that owns it
    (streaming/device_step.py), which restores its weights there, sends them to the other worker as
    after any step, and leaves its state untouched."""
    config = config_from_dict(exploding_raw(tmp_path / "run", steps=2, max_bad_steps=3, embedding_step=embedding_step,
                                            num_gpus=num_gpus))
    summary = run_training(config)
    assert capsys.readouterr().err.count("update was skipped, the weights are unchanged") == 2

    arch = PRESETS["tiny-llama"]
    initial = ShardStore(arch, list(range(len(model_layouts(arch)))), torch.float32)
    initial.init_random(config.train.seed, config.model.init_std)
    expected, _ = shard.state_tensors(initial)
    final = Path(summary["checkpoint"])
    saved = tensors_of(final)
    assert saved.keys() == expected.keys()
    for name in saved:  # master weights as initialised, both moments still zero
        assert torch.equal(saved[name], expected[name]), name
    assert json.loads((final / ckpt.META).read_text())["updates_done"] == 0


def test_too_many_non_finite_steps_stop_the_run_with_a_checkpoint(cluster, tmp_path):
    """With checkpoint.every=0 the stop writes the checkpoint of its last step (a resume from such
    a checkpoint: tests/runtime/test_stops_keep_steps.py)."""
    with pytest.raises(TrainingDiverged, match=r"2 steps in a row had a non-finite loss.*max_bad_steps=2") as e:
        run_training(config_from_dict(exploding_raw(tmp_path / "run", steps=6, max_bad_steps=2)))
    root = tmp_path / "run" / "checkpoints"
    assert e.value.checkpoint == root / "step-00000002"
    assert f"stopped after step 2; checkpoint of step 2: {e.value.checkpoint}" in str(e.value)
    _, meta = ckpt.read_manifest(ckpt.resolve("latest", root))
    assert meta["step"] == 2 and meta["data_position"] is not None


# ---------------------------------------------------------------------------------------------
# When auto-resume is on
# ---------------------------------------------------------------------------------------------


def test_auto_resume_defaults_to_on_under_ray_job_submit(monkeypatch):
    from megatrain_ray.cli import build_parser
    from megatrain_ray.runtime.training import auto_resume_enabled

    config = config_from_dict(tiny_raw(Path("unused")))
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    assert auto_resume_enabled(config, None) is False
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps({"metadata": {"job_submission_id": "raysubmit_1"}}))
    assert auto_resume_enabled(config, None) is True
    assert auto_resume_enabled(config, False) is False  # --no-auto-resume wins
    off = config_from_dict(tiny_raw(Path("unused"), train={"auto_resume": False}))
    assert auto_resume_enabled(off, None) is False  # so does the config
    parse = build_parser().parse_args
    assert parse(["train", "c.yaml"]).auto_resume is None
    assert parse(["train", "c.yaml", "--auto-resume"]).auto_resume is True
    assert parse(["train", "c.yaml", "--no-auto-resume"]).auto_resume is False
