"""A checkpoint reuses the disk tier's files (files/shard.py, link_tier_files; host/disk.py, DiskTier.link):
on the tier's file system they are hard-linked into it, not copied, and the tier never writes a linked
file in place again (a fresh file takes its name first), so the checkpoint keeps its bytes while the run
goes on: a resume from it after more steps is bit for bit the run that never stopped, and its Hugging
Face export is the weights it was written with. A run killed while
linking leaves no checkpoint that a resume takes; one killed while the next step writes leaves the
checkpoint whole. On another file system the state is copied, into the same checkpoint as read."""

import errno
import json
import os
import shutil
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from megatrain_ray.files import checkpoint as ckpt
from megatrain_ray.files import shard
from megatrain_ray.files.export import checkpoint_layers
from megatrain_ray.files.hf import export_hf
from megatrain_ray.host.adamw import AdamWStep
from megatrain_ray.host.disk import DiskTierError
from megatrain_ray.host.precision import StateFormat
from test_disk_compute import store_of
from test_disk_tier import ARCH, LAYERS, every_tensor, saved_state, train

FULLY = (2, 3)  # layer 1 has its optimizer state on disk, 2 and 3 their compute copies too
HERE = Path(__file__).parent


def tier_store(fmt: StateFormat, directory: Path):
    return store_of(fmt, directory, disk_layers=LAYERS[1:], fully=FULLY)


def checkpoint(store, root: Path, step: int) -> Path:
    staging = ckpt.new_staging_dir(root, step)
    entry = shard.save_shard(store, str(staging), "shard-000.safetensors")
    return ckpt.commit(staging, root, step, [entry], {"step": step}, keep=5)


def tier_inodes(store) -> set[int]:
    return {os.stat(p).st_ino for tier in (store.disk, store.hot.tier) for p in tier.paths.values()}


def linked_files(path: Path) -> list[Path]:
    manifest, _ = ckpt.read_manifest(path, verify=False)
    return [path / f["file"] for f in manifest["shards"][0].get(ckpt.LINKED, ())]


def shard_keys_linked(path: Path, layer: int) -> list[str]:
    meta = json.loads(safe_open(str(path / "shard-000.safetensors"), framework="pt").metadata()[ckpt.LINKED])
    return [part[0] for f in meta.get(str(layer), ()) for part in f["parts"]]


def allocated(path: Path) -> int:
    return os.stat(path).st_blocks * 512


@pytest.mark.parametrize("master,moments", [("fp32", "fp32"), ("bf16", "int8")])
def test_a_checkpoint_links_the_tiers_files_and_a_resume_after_more_steps_is_bit_for_bit(master, moments, tmp_path):
    fmt = StateFormat(master, moments)
    run = tier_store(fmt, tmp_path / "tier")
    train(run, 2)
    path = checkpoint(run, tmp_path / "ckpt", 2)
    masters = {i: t.float().clone() for i in LAYERS for key, t in shard.layer_tensors(run, i, copy=True).items()
               if key.endswith(".master")}
    linked = linked_files(path)
    assert len(linked) == 3 + (len(FULLY) if master == "bf16" else 0)  # a bf16 master's file: the compute copy's
    assert all(os.stat(f).st_nlink == 2 and os.stat(f).st_ino in tier_inodes(run) for f in linked)  # no copy
    state = saved_state(path / "shard-000.safetensors")
    in_links = sum(state[f"{i}.{key}"].nbytes for i in LAYERS for key in shard_keys_linked(path, i))
    own = sum(allocated(f) for f in path.iterdir() if f not in linked)
    assert in_links > 0 and own <= sum(t.nbytes for t in state.values()) - in_links + 64 * 1024  # none copied
    if master == "bf16":  # the spent gradient's half of a compute file is freed, not kept by the checkpoint
        hot = [f for f in linked if f.name.endswith("diskcompute")]
        assert all(allocated(f) <= os.stat(f).st_size // 2 + 4096 for f in hot)

    train(run, 2)  # the run goes on: each linked file is replaced under the tier's name before its next write
    assert all(os.stat(f).st_nlink == 1 for f in linked) and not tier_inodes(run) & {os.stat(f).st_ino for f in linked}
    manifest, _ = ckpt.read_manifest(path, verify=True)  # the checkpoint's bytes as it was written
    exported = load_file(export_hf(tmp_path / "hf", ARCH, checkpoint_layers(path, manifest)) / "model.safetensors")
    expected = load_file(export_hf(tmp_path / "hf-expected", ARCH, masters.items()) / "model.safetensors")
    assert exported.keys() == expected.keys() and all(torch.equal(exported[k], expected[k]) for k in exported)
    resumed = tier_store(fmt, tmp_path / "tier2")
    shard.load_layers(resumed, ckpt.shard_files_by_layer(path, manifest))
    train(resumed, 2)
    a, b = every_tensor(run), every_tensor(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert resumed.update_counts() == run.update_counts()
    for store in (run, resumed):
        store.close()
    assert all(f.exists() for f in linked)  # the run's end removes its files; the checkpoint keeps its own


def test_on_another_file_system_the_state_is_copied_into_the_same_checkpoint(tmp_path):
    if not Path("/dev/shm").is_dir() or os.stat("/dev/shm").st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs /dev/shm on a file system of its own")
    fmt = StateFormat("bf16", "int8")
    store = tier_store(fmt, tmp_path / "tier")
    train(store, 2)
    elsewhere = Path("/dev/shm") / f"megatrain-test-{uuid.uuid4().hex[:8]}"
    try:
        copied = checkpoint(store, elsewhere, 2)
        linked = checkpoint(store, tmp_path / "ckpt", 2)
        assert not linked_files(copied) and linked_files(linked)
        a, b = saved_state(copied / "shard-000.safetensors"), saved_state(linked / "shard-000.safetensors")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    finally:
        shutil.rmtree(elsewhere, ignore_errors=True)
        store.close()


def run_killed(tmp_path: Path, kill: str) -> subprocess.CompletedProcess:
    """A store with the tier trains 2 steps and checkpoints them (step 2); then `kill`'s code runs,
    which kills the process (exit 9) in what comes next."""
    code = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(HERE)!r})
        from pathlib import Path
        from megatrain_ray.host.precision import StateFormat
        from test_disk_checkpoint import checkpoint, tier_store, train
        store = tier_store(StateFormat("bf16", "int8"), Path({str(tmp_path / "tier")!r}))
        train(store, 2)
        root = Path({str(tmp_path / "ckpt")!r})
        checkpoint(store, root, 2)
    """) + textwrap.dedent(kill)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ)


def expected_state(tmp_path: Path) -> dict[str, torch.Tensor]:
    """The state of step 2's checkpoint, as a store that trained the same 2 steps and copied it reads it."""
    store = tier_store(StateFormat("bf16", "int8"), tmp_path / "again")
    train(store, 2)
    store.disk.link = store.hot.link = lambda *_: False  # copied, not linked
    path = checkpoint(store, tmp_path / "copied", 2)
    store.close()
    return saved_state(path / "shard-000.safetensors")


def test_a_run_killed_while_it_links_leaves_no_checkpoint_that_a_resume_takes(tmp_path):
    out = run_killed(tmp_path, """
        real, made = os.link, []
        def link(src, dst):
            real(src, dst)
            made.append(dst)
            if len(made) == 2:
                os._exit(9)  # killed between two links: no shard, no manifest
        os.link = link
        train(store, 2)
        checkpoint(store, root, 4)
    """)
    assert out.returncode == 9, out.stderr
    root = tmp_path / "ckpt"
    first = root / "step-00000002"
    assert ckpt.list_checkpoints(root) == [first] and ckpt.resolve("latest", root) == first
    (half,) = root.glob(".step-00000004.tmp-*")
    assert len(list(half.iterdir())) == 2 and not (half / ckpt.MANIFEST).exists()
    with pytest.raises(ckpt.CheckpointError, match="not a complete checkpoint"):
        ckpt.resolve(str(half), root)
    ckpt.read_manifest(first, verify=True)
    got, expected = saved_state(first / "shard-000.safetensors"), expected_state(tmp_path)
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)


def test_a_run_killed_while_the_next_step_writes_leaves_the_checkpoint_whole(tmp_path):
    out = run_killed(tmp_path, """
        real, writes = os.pwritev, []
        def pwritev(fd, buffers, offset):
            writes.append(offset)
            if len(writes) == 2:
                os._exit(9)  # killed mid-step: one piece of the step's writes done
            return real(fd, buffers, offset)
        os.pwritev = pwritev
        train(store, 2)
    """)
    assert out.returncode == 9, out.stderr
    path = tmp_path / "ckpt" / "step-00000002"
    assert linked_files(path)  # it reused the tier's files
    ckpt.read_manifest(path, verify=True)  # every file's hash as its manifest says
    got, expected = saved_state(path / "shard-000.safetensors"), expected_state(tmp_path)
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)


def test_a_fresh_file_that_finds_no_room_stops_the_next_update_and_leaves_the_checkpoint_whole(tmp_path, monkeypatch):
    """The step after a linked checkpoint needs fresh files; a full disk refuses one: the layer's new
    state stays in its buffer (readable for a checkpoint, copied then), the next update raises the
    disk's error, and the checkpoint's file is neither replaced nor written."""
    fmt = StateFormat("fp32", "fp32")
    run = tier_store(fmt, tmp_path / "tier")
    train(run, 2)
    path = checkpoint(run, tmp_path / "ckpt", 2)

    def full(fd, offset, size):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    hp = AdamWStep(3, 3e-3, 1.0, (0.9, 0.95), 1e-8, 0.1)
    with run.landing_gradient(1) as grad:
        grad.fill_(0.5)
    run.step_layer(1, hp)
    with pytest.raises(DiskTierError, match="No space left on device while allocating"):
        run.step_layer(2, hp)
    assert os.stat(run.disk.paths[1]).st_ino in {os.stat(f).st_ino for f in linked_files(path)}  # not replaced
    ckpt.read_manifest(path, verify=True)  # nor written
    updated = shard.layer_tensors(run, 1, copy=True)  # the new state, from its buffer
    saved, _ = ckpt.read_layer_state(str(path / "shard-000.safetensors"), 1)
    assert not torch.equal(updated["layers.1.master"], saved["master"])
    assert not run.disk.link(1, tmp_path / "refused")  # a checkpoint copies it
    run.close()
