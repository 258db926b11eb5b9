"""A run with layers fully on disk (runtime.disk_dir, StorePlan.disk_compute_layers): under a RAM cap
that the optimizer state on disk alone does not meet, the plan puts the compute copies of some layers
there too; the GPU worker streams those through its window from the store on its own node, which
reads them from their files. The steps are the in-process trainer's (all in RAM) bit for bit, in a
fp32 master's mode (the gradient lands over the copy) and a bf16 master's (in a window buffer of its
own); a resume from the run's checkpoint continues exactly; the store's RAM is within the cap, which
the tier without the compute copies on disk exceeds; the disk's bytes a step are within the plan's.
A disk that fills under those files mid-run stops the run as a full disk does, not as a lost link."""

import dataclasses
import errno
import json
import os

import ray
import torch

from megatrain_ray import cli
from megatrain_ray.config import config_from_dict
from megatrain_ray.files import checkpoint as ckpt
from megatrain_ray.models.registry import PRESETS
from megatrain_ray.runtime.cluster import RayNodes
from megatrain_ray.runtime.session import Session, place
from helpers.reference_training import random_micro_batches
from helpers.runs import assert_same_checkpoints, tiny_raw
from test_disk_tier_run import BLOCKS, configs, resumes_exactly, run_in_ram

CAPS = {("bf16", "int8"): 1.5e6, ("fp32", "fp32"): 2.4e6}  # bytes: the optimizer state on disk alone needs 2.3 MB and 3.9 MB


def run_on_disk(config, arch, data, checkpoint_after: int | None = None):
    """The run's losses, its store's state, its disk stats and RAM, its plan; and the checkpoint path."""
    session = Session(config, arch)
    path = None
    try:
        store = session.placement.stores[0]
        session.init_weights()
        session.start_executor()
        losses = []
        for n, step in enumerate(data, 1):
            losses.append(session.train_step(step).loss)
            if n == checkpoint_after:
                path = session.save_checkpoint(n, None)
        session.drain("the last updates")
        stats, ram = ray.get([session.stores[0].disk_stats.remote(), session.stores[0].host_bytes.remote()])
        state, steps = ray.get(session.stores[0].state_tensors.remote())  # after the stats: it reads the files
    finally:
        session.close()
    return losses, state, steps, stats, ram, store, path


def test_layers_fully_on_disk_train_as_in_ram_bit_for_bit_and_resume_exactly(local_ray, tmp_path):
    arch = PRESETS["tiny-llama"].replace(num_layers=BLOCKS)
    data = random_micro_batches(arch, 3, 2, batch=2, seq=12, seed=1)
    for (master, moments), cap in CAPS.items():
        dtype = "bfloat16" if master == "bf16" else "float32"
        ram, tier = configs(tmp_path / master, (master, moments), dtype)
        tier = tier.replace(runtime=dataclasses.replace(tier.runtime, store_memory_gib=cap / 2**30))
        cold_only = place(arch, tier.replace(runtime=dataclasses.replace(tier.runtime, store_memory_gib=1e3)), RayNodes())
        assert cold_only.stores[0].disk_compute_layers == ()
        expected_losses, (expected, counts) = run_in_ram(ram, arch, data)

        losses, state, steps, stats, used, plan, path = run_on_disk(tier, arch, data, checkpoint_after=1)
        assert 0 < len(plan.disk_compute_layers) < BLOCKS, plan
        assert losses == expected_losses, master
        assert steps == counts
        for name, tensor in expected.items():
            assert torch.equal(state[name], tensor), (master, name)
        assert used <= cap  # the store's RAM, windows included, within the cap
        assert stats["compute_file_bytes"] > 0 and not list((tmp_path / master / "tier").iterdir())
        read, written = plan.disk_step_bytes()
        # the counters' last whole step: an update's writes and the next step's gradients' (host/disk.py, step_bytes)
        assert plan.disk_update_bytes() < stats["step_written_bytes"] <= written
        # the plan counts the reads where the disk binds; this step is the CPU's, whose forward may ask for
        # a copy after its buffer is taken (one more read of each copy), and whose landing may find the
        # backward's buffer taken (one more read of what it does not overwrite: a bf16 master's copy)
        assert plan.disk_update_bytes() < stats["step_read_bytes"] <= read + 2 * plan.disk_send_bytes

        if master == "bf16":  # resume from step 1's checkpoint: the rest of the run exactly
            resumes_exactly(tier, arch, path, data, expected_losses, expected)

def test_two_workers_with_layers_fully_on_disk_train_as_two_in_ram(local_ray, tmp_path):
    """Two data-parallel workers, each streaming the layers fully on disk through its own window and
    link from the store on their node: a layer's update sent by its owner is a version the other asks
    the store for. Bit for bit the same two workers with every layer in RAM (6-byte mode)."""
    arch = PRESETS["tiny-llama"].replace(num_layers=BLOCKS)
    data = random_micro_batches(arch, 3, 4, batch=2, seq=12, seed=2)
    ram, tier = configs(tmp_path, ("bf16", "int8"), "bfloat16")

    def two(config):
        config = config.replace(train=dataclasses.replace(config.train, grad_accum=4),
                                runtime=dataclasses.replace(config.runtime, num_gpus=2, worker_threads=1))
        session = Session(config, arch)
        try:
            fully = session.placement.stores[0].disk_compute_layers
            session.init_weights()
            session.start_executor()
            losses = [session.train_step(step).loss for step in data]
            session.drain("the last updates")
            state, _ = ray.get(session.stores[0].state_tensors.remote())
        finally:
            session.close()
        return fully, losses, state

    _, expected_losses, expected = two(ram)
    fully, losses, state = two(tier.replace(runtime=dataclasses.replace(tier.runtime,
                                                                         store_memory_gib=CAPS["bf16", "int8"] / 2**30)))
    assert fully
    assert losses == expected_losses
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), name


def test_a_disk_that_fills_under_the_link_stops_with_the_last_checkpoint_and_resumes_exactly(
        local_ray, tmp_path, monkeypatch, capsys):
    """The disk under layers fully on disk fills in step 2 of 3: the store's link server finds it
    writing a gradient that landed (or at the update after it). The step fails with the disk's
    error, not a lost link, and the run stops as a full disk stops it (exit 2), with the checkpoint
    of step 1 from the stores; the resume from it ends with the weights of a run that never
    stopped."""
    steps = 3
    raw = tiny_raw(tmp_path / "run", steps=steps,
                   model={"preset": "tiny-llama", "overrides": {"num_layers": BLOCKS}, "compute_dtype": "bfloat16"},
                   optim={"master": "bf16", "moments": "int8"}, executor={"embedding_step": "host"},
                   runtime={"disk_dir": str(tmp_path / "tier"), "store_memory_gib": CAPS["bf16", "int8"] / 2**30},
                   checkpoint={"every": 0, "export_hf": False, "dir": str(tmp_path / "ckpt")})
    whole = {**raw, "train": {**raw["train"], "output_dir": str(tmp_path / "whole")},
             "checkpoint": {**raw["checkpoint"], "dir": str(tmp_path / "whole-ckpt")}}
    path, whole_path = tmp_path / "run.yaml", tmp_path / "whole.yaml"
    path.write_text(json.dumps(raw))
    whole_path.write_text(json.dumps(whole))
    assert place(PRESETS["tiny-llama"].replace(num_layers=BLOCKS), config_from_dict(raw), RayNodes()).stores[0].disk_compute_layers

    def fill_the_disk(store) -> None:
        """In the store actor's process (`__ray_call__`; defined here so that Ray ships it by value):
        once step 1's writes are done, every write of a compute copy's file fails as a full
        disk's does, as tests/host/test_disk_compute.py makes it fail at the store."""
        with store.hot.cond:
            store.hot.tier.flush()
        real, files = os.pwritev, set(store.hot.tier.fds.values())

        def full(fd, buffers, offset):
            if fd in files:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real(fd, buffers, offset)

        os.pwritev = full

    real_step = Session.train_step

    def train_step(self, micro_batches, what="a step"):
        if what == "step 2":
            self.drain("step 1's updates")  # step 1 whole in the stores: the disk fills after it
            ray.get(self.stores[0].__ray_call__.remote(fill_the_disk))
        return real_step(self, micro_batches, what)

    monkeypatch.setattr(Session, "train_step", train_step)
    code = cli.main(["train", str(path)])
    err = capsys.readouterr().err
    monkeypatch.setattr(Session, "train_step", real_step)
    first = tmp_path / "ckpt" / "step-00000001"
    assert code == 2, err
    assert "the disk filled mid-run: No space left on device while writing" in err, err
    assert "runtime.disk_dir" in err and "at ?" not in err and "checkpoint.keep" not in err, err  # the tier's advice
    assert f"The run stopped with the checkpoint of step 1: {first}" in err, err
    assert (first / ckpt.MANIFEST).exists() and not list((tmp_path / "ckpt").glob(".step-*"))
    assert not list((tmp_path / "tier").iterdir())  # the tier's files went with the run

    assert cli.main(["train", str(path), "--resume", str(first)]) == 0, capsys.readouterr().err
    assert cli.main(["train", str(whole_path)]) == 0, capsys.readouterr().err
    assert_same_checkpoints(tmp_path / "whole-ckpt" / f"step-{steps:08d}", tmp_path / "ckpt" / f"step-{steps:08d}")
