"""A run with the disk tier (runtime.disk_dir), its stores Ray actors: the plan puts the optimizer
state of the layers RAM cannot hold (runtime.store_memory_gib) on disk, the run's steps are the
in-process trainer's (all in RAM) bit for bit, a resume from its checkpoint (which links the tier's
files: files/shard.py) after the run went on continues exactly, and the tier's files are gone when the
run ends. A file system that fills mid-run (a real one, a small
tmpfs) stops the run with a clear message and the last checkpoint that fits, which resumes exactly.

One end-to-end run, in the 6-byte mode (bf16 master, int8 moments, bf16 compute): every state mode
steps bit for bit on disk as in RAM at the store (tests/host/test_disk_tier.py), and the exact mode
(fp32 master and moments on disk) runs through Ray bit for bit in
tests/runtime/test_multinode.py::test_ram_nodes_with_a_disk_tier_train_like_one_node."""

import dataclasses
import json
import shlex
import subprocess
from pathlib import Path

import pytest
import ray
import torch

from megatrain_ray import cli
from megatrain_ray.config import config_from_dict
from megatrain_ray.files import checkpoint as ckpt
from megatrain_ray.files import shard
from megatrain_ray.host.disk import disk_bytes
from megatrain_ray.host.precision import format_of
from megatrain_ray.models.registry import PRESETS, model_layouts
from megatrain_ray.runtime.local import LocalTrainer
from megatrain_ray.runtime.cluster import RayNodes
from megatrain_ray.runtime.session import Session, place
from helpers.reference_training import random_micro_batches
from helpers.runs import assert_same_checkpoints, make_config, tiny_raw

BLOCKS = 12  # tiny-llama with 12 blocks: enough layers that the tier's window of 3 saves RAM
STORE_BYTES = {"fp32": 5.5e6, "bf16": 2.4e6}  # of the all-RAM run's 7.6 MB (exact), 2.8 MB (6 bytes): about 8 blocks' state go to disk


def configs(tmp_path, mode: tuple[str, str], dtype: str):
    ram = make_config("tiny-llama", model={"overrides": {"num_layers": BLOCKS}, "compute_dtype": dtype},
                      optim={"master": mode[0], "moments": mode[1]}, embedding_step="host")
    tier = ram.replace(runtime=dataclasses.replace(ram.runtime, disk_dir=str(tmp_path / "tier"),
                                                   store_memory_gib=STORE_BYTES[mode[0]] / 2**30),
                       checkpoint=dataclasses.replace(ram.checkpoint, dir=str(tmp_path / "ckpt")))
    return ram, tier


def run_in_ram(config, arch, data):
    local = LocalTrainer(config, arch)
    try:
        losses = [local.train_step(step).loss for step in data]
        local.source.drain()  # every update applied
        return losses, shard.state_tensors(local.stores[0])
    finally:
        local.close()


def test_a_run_with_its_state_on_disk_is_the_ram_run_bit_for_bit_and_resumes_exactly(local_ray, tmp_path):
    ram, tier = configs(tmp_path, ("bf16", "int8"), "bfloat16")
    arch = PRESETS["tiny-llama"].replace(num_layers=BLOCKS)
    data = random_micro_batches(arch, 3, 2, batch=2, seq=12, seed=1)
    expected_losses, (expected, counts) = run_in_ram(ram, arch, data)

    session = Session(tier, arch)
    try:
        on_disk = session.placement.stores[0].disk_layers
        assert 0 < len(on_disk) < BLOCKS + 2, on_disk  # some layers, the embedding among them (stepped on the host)
        session.init_weights()
        session.start_executor()
        losses = [session.train_step(data[0]).loss]
        path = session.save_checkpoint(1, None)  # beside the tier: its files linked, which the next steps leave alone
        assert json.loads((path / ckpt.MANIFEST).read_text())["shards"][0][ckpt.LINKED]
        losses += [session.train_step(step).loss for step in data[1:]]
        session.drain("the last updates")
        state, steps = ray.get(session.stores[0].state_tensors.remote())
        stats = ray.get(session.stores[0].disk_stats.remote())
    finally:
        session.close()
    assert losses == expected_losses
    assert steps == counts
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), name
    assert stats["read_bytes"] >= 2 * stats["file_bytes"] > 0  # the updates did read their state from disk
    assert not list((tmp_path / "tier").iterdir())  # the run's files are gone with it

    resumes_exactly(tier, arch, path, data, expected_losses, expected)


def resumes_exactly(config, arch, path, data, expected_losses, expected) -> None:
    """A run resumed from step 1's checkpoint at `path` takes the rest of `data`'s steps as the
    whole run did: its losses and its store's state at the end."""
    resumed = Session(config, arch, updates_done=1)
    try:
        resumed.restore(path)
        resumed.start_executor()
        after = [resumed.train_step(step).loss for step in data[1:]]
        resumed.drain("the last updates")
        state, _ = ray.get(resumed.stores[0].state_tensors.remote())
    finally:
        resumed.close()
    assert after == expected_losses[1:]
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), name


@pytest.fixture
def small_file_system(tmp_path):
    """mount(nbytes): a tmpfs of that size (a real file system that fills), unmounted after the test;
    skipped where this process may not mount one (not root)."""
    mounted = []

    def mount(nbytes: int):
        where = tmp_path / "small-fs"
        where.mkdir()
        size = -(-nbytes // 4096) * 4096
        if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                          capture_output=True).returncode != 0:
            pytest.skip("cannot mount a small tmpfs here (needs root)")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], check=False)


FILL_STEPS = 3


def fill_raw(root: Path) -> dict:
    """The fill tests' run (every checkpoint kept under `root`, its tier there too), uninterrupted."""
    model = {"preset": "tiny-llama", "overrides": {"num_layers": BLOCKS}}
    return tiny_raw(root / "whole", steps=FILL_STEPS, model=model, executor={"embedding_step": "host"},
                    runtime={"store_memory_gib": STORE_BYTES["fp32"] / 2**30, "disk_dir": str(root / "tier")},
                    checkpoint={"every": 1, "keep": 1, "export_hf": False, "dir": str(root / "whole-ckpt")})


@pytest.fixture(scope="module")
def uninterrupted(local_ray, tmp_path_factory) -> Path:
    """The checkpoint of the last step of fill_raw's run, which never stopped, what each fill test's
    resume must end with; run once for both tests (their runs differ only in where they write)."""
    root = tmp_path_factory.mktemp("uninterrupted")
    path = root / "whole.yaml"
    path.write_text(json.dumps(fill_raw(root)))
    assert cli.main(["train", str(path)]) == 0
    return root / "whole-ckpt" / f"step-{FILL_STEPS:08d}"


@pytest.mark.parametrize("together", [False, True], ids=["checkpoints-alone", "tier-and-checkpoints"])
def test_a_disk_that_fills_mid_run_stops_with_the_last_checkpoint_and_resume_is_exact(local_ray, tmp_path, together,
                                                                                       small_file_system, capsys,
                                                                                       uninterrupted):
    """A small file system that fills. With the checkpoints alone on it (checkpoint.keep 1), room for
    one and a half: step 1's checkpoint fits, step 2's does not; the run stops (exit 2) saying so and
    naming step 1's checkpoint, its half-written one removed. With the tier's files there too, room for
    them and half a checkpoint: step 1's checkpoint fits because it links the tier's files
    (files/shard.py), and step 2's writes, which need fresh files beside the ones it keeps, do not (nor
    then its checkpoint, which copies the layer whose write failed); the run stops naming step 1's.
    Either way the resume from step 1 (its checkpoints and tier elsewhere) ends with the weights of a
    run that never stopped."""
    whole = fill_raw(tmp_path)
    runtime = {"store_memory_gib": whole["runtime"]["store_memory_gib"]}
    config = config_from_dict(whole)
    arch = PRESETS["tiny-llama"].replace(num_layers=BLOCKS)
    layouts, fmt = model_layouts(arch), format_of(config.optim)
    tier = sum(disk_bytes(layouts[i], fmt) for s in place(arch, config, RayNodes()).stores for i in s.disk_layers)
    one = ckpt.checkpoint_bytes(config, arch)
    assert tier > 0
    fs = small_file_system(tier + one // 2 if together else one * 3 // 2)
    raw = {**whole, "train": {**whole["train"], "output_dir": str(tmp_path / "run")},
           "runtime": {**runtime, "disk_dir": str(fs / "tier" if together else tmp_path / "run-tier")},
           "checkpoint": {**whole["checkpoint"], "dir": str(fs / "ckpt")}}
    path = tmp_path / "run.yaml"
    path.write_text(json.dumps(raw))

    code = cli.main(["train", str(path)])
    err = capsys.readouterr().err
    first = fs / "ckpt" / "step-00000001"
    assert code == 2, err
    if together:
        assert (f"the disk filled mid-run: No space left on device while allocating" in err
                and f"disk tier's state in {fs / 'tier'}" in err), err
        assert json.loads((first / ckpt.MANIFEST).read_text())["shards"][0][ckpt.LINKED]  # it reused the tier's files
    else:
        assert f"the disk filled mid-run: No space left on device (ENOSPC) at {fs / 'ckpt'}" in err, err
    assert f"no room for the checkpoint of step 2); its last complete checkpoint is {first}" in err, err
    ckpt.read_manifest(first, verify=True)
    assert not list((fs / "ckpt").glob(".step-*"))  # a half-written checkpoint is gone
    assert not list(Path(raw["runtime"]["disk_dir"]).iterdir())  # and the tier's files with the run
    command = next(line for line in err.splitlines() if line.startswith("continue with: "))
    assert shlex.split(command.removeprefix("continue with: "))[-2:] == ["--resume", str(first)]

    assert cli.main(["train", str(path), "--set", f"checkpoint.dir={tmp_path / 'more'}", "--set",  # the full disk is
                     f"runtime.disk_dir={tmp_path / 'resume-tier'}", "--resume", str(first)]) == 0  # left as it was
    assert_same_checkpoints(uninterrupted, tmp_path / "more" / f"step-{FILL_STEPS:08d}")
