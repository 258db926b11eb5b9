"""A run that stops mid-way for bad data, or because its GPU worker died, keeps its finished
steps: with checkpoint.every=0 it writes the checkpoint of its last finished step, the CLI prints
the command that continues from it (exit 2, or 3 for a fault), and --resume from it trains the
remaining steps. Through the CLI in this process, joined to the test session's Ray head."""

import json
import shlex
import time
from pathlib import Path

import ray
import torch

import pytest

from helpers.reference_training import random_micro_batches
from helpers.runs import tensors_of, tiny_raw
from megatrain_ray import cli
from megatrain_ray.config import config_from_dict
from megatrain_ray.files import checkpoint as ckpt
from megatrain_ray.host.adamw import AdamWStep
from megatrain_ray.host.memory import shm_tensor
from megatrain_ray.host.store import IN_FLUX
from megatrain_ray.models.registry import PRESETS
from megatrain_ray.data import summary
from megatrain_ray.runtime import watchdog
from megatrain_ray.runtime.cluster import RayNodes
from megatrain_ray.runtime.session import Session, StoresNotAtStep, place
from megatrain_ray.runtime.watchdog import ClusterFault, Watchdog

STEPS = 12
BAD_ROW = 150  # of 200: a step or so before the data runs out, after several steps


def write_data(path: Path) -> Path:
    lines = [json.dumps({"input_ids": [(7 * i + j) % 64 for j in range(2 + i % 5)]}) for i in range(200)]
    lines[BAD_ROW] = '{"input_ids": [1, 2'  # cut short
    path.write_text("\n".join(lines) + "\n")
    return path


def steps_of(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_bad_row_mid_run_stops_with_a_checkpoint_and_resume_continues(local_ray, tmp_path, monkeypatch, capsys):
    # The summary reads the first rows only, as it does of a source too large to count before the start.
    monkeypatch.setattr(summary, "SCAN_BYTES", 0)
    monkeypatch.setattr(summary, "SCAN_ROWS", 8)
    out = tmp_path / "run"
    raw = tiny_raw(out, steps=STEPS, data={"source": str(write_data(tmp_path / "rows.jsonl")), "shuffle": False,
                                           "read_batch_rows": 8},
                   checkpoint={"every": 0, "keep": 5, "export_hf": False})
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps(raw))

    code = cli.main(["train", str(config), "--set", "data.bad_rows=stop"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"rows.jsonl row {BAD_ROW + 1} (line {BAD_ROW + 1}, counting from 1): malformed JSON" in err
    done = steps_of(out)
    k = done[-1]["step"]
    assert [r["step"] for r in done] == list(range(1, k + 1)) and 1 < k < STEPS
    checkpoint = out / "checkpoints" / f"step-{k:08d}"
    assert checkpoint.is_dir() and f"The run stopped after step {k}; checkpoint of step {k}: {checkpoint}" in err
    command = next(line for line in err.splitlines() if line.startswith("continue with: "))
    argv = shlex.split(command.removeprefix("continue with: "))
    assert argv == ["megatrain-ray", "train", str(config), "--set", "data.bad_rows=stop", "--resume", str(checkpoint)]

    # The user lets such rows be skipped (the default) and continues from that checkpoint.
    code = cli.main(["train", str(config), "--resume", str(checkpoint)])
    err = capsys.readouterr().err
    assert code == 0, err
    rows = steps_of(out)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert rows[-1]["bad_rows"] == {"malformed JSON": 1}


def continue_command(err: str) -> list[str]:
    return shlex.split(next(line for line in err.splitlines() if line.startswith("continue with: "))
                       .removeprefix("continue with: "))


def kill(*workers) -> None:
    """Kill these GPU workers, and wait until Ray has seen them die."""
    for worker in workers:
        ray.kill(worker)
    deadline = time.monotonic() + 30
    for worker in workers:
        while time.monotonic() < deadline:  # a call that came before the kill may still be answered
            try:
                ray.get(worker.gpu_ids.remote(), timeout=30)
            except ray.exceptions.RayActorError:
                break
            time.sleep(0.05)
        else:
            raise AssertionError("the killed GPU worker still answers")


def test_a_dead_gpu_worker_keeps_the_last_finished_step_and_resume_is_exact(local_ray, tmp_path, monkeypatch,
                                                                             capsys):
    """With no checkpoint due (checkpoint.every=0) and no auto-resume, a killed GPU worker leaves the
    last finished step in the stores, which is saved from them alone. One run's worker dies between
    steps 3 and 4: its step 3 is saved, and a resume from it trains steps 4 and 5. Another's dies at
    the final checkpoint (in the workers' drain), after step 5: its step 5 is saved from the stores.
    The two end with the same losses and weights, bit for bit."""
    steps, dies_before = 5, 4
    raw = {"checkpoint": {"every": 0, "keep": 5, "export_hf": False}, "train": {"auto_resume": False}}
    original_save = Session.save_checkpoint

    def dies_at_the_final_checkpoint(session, step, data_position):
        session.drain()  # step 5's updates have landed (else the stores would not hold step 5: a refusal)
        kill(*session.gpus)
        return original_save(session, step, data_position)

    monkeypatch.setattr(watchdog, "NODE_MARK_S", 0.5)  # the node is alive: no need to wait for Ray to say so
    whole, run = tmp_path / "whole", tmp_path / "run"
    for out in (whole, run):
        (tmp_path / f"{out.name}.yaml").write_text(json.dumps(tiny_raw(out, steps=steps, **raw)))

    monkeypatch.setattr(Session, "save_checkpoint", dies_at_the_final_checkpoint)
    assert cli.main(["train", str(tmp_path / "whole.yaml")]) == 3
    err = capsys.readouterr().err
    last = whole / "checkpoints" / f"step-{steps:08d}"
    assert "a process of the run died during the checkpoint of step 5" in err
    assert f"checkpoint of step {steps}, the last finished step, from the stores: {last}" in err
    monkeypatch.setattr(Session, "save_checkpoint", original_save)

    killed_then_resumed(tmp_path / "run.yaml", dies_before, whole, steps, monkeypatch, capsys)
    _, meta = ckpt.read_manifest(last)  # every file's hash checked
    assert meta["step"] == steps and meta["updates_done"] == steps


def killed_then_resumed(config: Path, dies_before: int, whole: Path, steps: int, monkeypatch, capsys) -> None:
    """The run of `config` loses its GPU workers between steps `dies_before` - 1 and `dies_before`:
    the last finished step is saved from the stores and named with the resume command, and the
    resumed run ends as the uninterrupted one (`whole`), losses and checkpoint bit for bit."""
    original = Session.train_step

    def dies_before_a_step(session, micro_batches, what="a step"):
        if what == f"step {dies_before}":
            session.drain()  # the last finished step's updates have landed: the worker dies between steps
            kill(*session.gpus)
        return original(session, micro_batches, what)

    monkeypatch.setattr(Session, "train_step", dies_before_a_step)
    code = cli.main(["train", str(config)])
    err = capsys.readouterr().err
    assert code == 3, err
    run = whole.parent / config.stem
    checkpoint = run / "checkpoints" / f"step-{dies_before - 1:08d}"
    assert checkpoint.is_dir(), err
    assert f"a process of the run died during step {dies_before}" in err
    assert f"checkpoint of step {dies_before - 1}, the last finished step, from the stores: {checkpoint}" in err
    assert continue_command(err) == ["megatrain-ray", "train", str(config), "--resume", str(checkpoint)]
    monkeypatch.setattr(Session, "train_step", original)

    assert cli.main(["train", str(config), "--resume", str(checkpoint)]) == 0, capsys.readouterr().err
    assert [r["loss"] for r in steps_of(run)] == [r["loss"] for r in steps_of(whole)]
    a, b = (tensors_of(out / "checkpoints" / f"step-{steps:08d}") for out in (whole, run))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_a_dead_worker_that_stepped_the_embedding_keeps_the_last_finished_step_and_resume_is_exact(
        local_ray, tmp_path, monkeypatch, capsys):
    """With the embedding's AdamW step on the worker's device (streaming/device_step.py, here its
    CPU path) the store's marker says which step's state its memory holds: a worker killed between
    steps 1 and 2 leaves step 1 there, which is saved from the stores, and the resumed run ends as
    the uninterrupted one, bit for bit."""
    monkeypatch.setattr(watchdog, "NODE_MARK_S", 0.5)
    raw = {"checkpoint": {"every": 0, "export_hf": False}, "train": {"auto_resume": False},
           "executor": {"embedding_step": "device"}}
    whole, run = tmp_path / "whole", tmp_path / "run"
    for out in (whole, run):
        (tmp_path / f"{out.name}.yaml").write_text(json.dumps(tiny_raw(out, steps=2, **raw)))
    assert cli.main(["train", str(tmp_path / "whole.yaml")]) == 0, capsys.readouterr().err
    killed_then_resumed(tmp_path / "run.yaml", 2, whole, 2, monkeypatch, capsys)


def held_marker_file(shm_dir: Path) -> torch.Tensor:
    """The embedding's marker in its store's shared memory (host/store.py, held_marker), mapped here."""
    (path,) = shm_dir.glob("megatrain-*-layer0-held")
    return shm_tensor(path, 1, torch.int64, create=False)


def test_the_stores_are_saved_only_when_every_layer_holds_the_last_finished_step(local_ray, tmp_path, monkeypatch):
    """Two data-parallel workers, the embedding stepped on its owner's device, one killed between
    steps: the other, blocked in a collective with it, is stopped, and the stores' checkpoint of
    step 1 is written with every layer's count at 1. Once the embedding's marker says its state is
    being copied back, or a layer holds one more update than the step (the worker died while a
    step's updates were landing), nothing is saved, the reason is given, and no staging directory
    is left behind."""
    monkeypatch.setattr(watchdog, "NODE_MARK_S", 0.5)  # the node is alive: no need to wait for Ray to say so
    monkeypatch.setattr(watchdog, "PEER_GRACE_S", 0.5)  # the other worker is blocked in a collective: it never ends
    arch = PRESETS["tiny-llama"]
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    config = config_from_dict(tiny_raw(tmp_path / "run", steps=2, train={"grad_accum": 4},
                                       runtime={"num_gpus": 2, "shm_dir": str(shm_dir)},
                                       executor={"embedding_step": "device"}))
    data = random_micro_batches(arch, 2, 4, batch=2, seq=12, seed=1)
    placement = place(arch, config, RayNodes())
    session = Session(config, arch, placement=placement, wait=Watchdog(placement, timeout_s=120).get)
    root = tmp_path / "run" / "checkpoints"
    try:
        session.init_weights()
        session.start_executor()
        session.train_step(data[0], "step 1")
        session.drain()
        kill(session.gpus[1])
        with pytest.raises(ClusterFault, match="a process of the run died during step 2"):
            session.train_step(data[1], "step 2")

        saved = session.save_from_stores(1, None)
        assert saved == root / "step-00000001"
        _, meta = ckpt.read_manifest(saved)
        assert meta["step"] == 1 and meta["updates_done"] == 1
        counts = {i: n for c in ray.get([s.update_counts.remote() for s in session.stores]) for i, n in c.items()}
        assert set(counts.values()) == {1}

        held = held_marker_file(shm_dir)
        assert held.item() == 1
        held.fill_(IN_FLUX)  # as a worker leaves it that dies while the embedding's state is copied back
        with pytest.raises(StoresNotAtStep, match=r"layer 0's optimizer state was being copied back from the "
                                                  r"worker's device \(the embedding's step"):
            session.save_from_stores(1, None)
        held.fill_(1)

        hp = AdamWStep(lr_position=2, lr=1e-3, grad_scale=1.0, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
        ray.get(session.stores[0].step_layer.remote(3, hp))  # one layer of step 2 landed
        with pytest.raises(StoresNotAtStep, match=r"layers \[3\] hold \[2\] updates, not the 1 of step 1"):
            session.save_from_stores(1, None)
        assert [p.name for p in root.iterdir()] == ["step-00000001"]
    finally:
        session.close()
