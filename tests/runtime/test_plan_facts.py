"""`megatrain-ray plan` with no cluster to join reads this machine directly, through the functions a
Ray task on a node runs, and starts no Ray (runtime/cluster.py: ThisMachine); with one to join, it
joins it. The machine's facts are the ones the embedded Ray a run starts here gives: compared with
the session's Ray head, a node of this machine with the Quick start's 2 CPUs."""

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import ray
import torch

import megatrain_ray
from megatrain_ray.runtime import cluster

REPO = Path(__file__).parents[2]
TINY = REPO / "examples" / "tiny.yaml"  # runtime.num_cpus: 2, as the session's head


def head_node_id(address: str) -> str:
    ray.init(address=address)
    try:
        return ray.get_runtime_context().get_node_id()
    finally:
        ray.shutdown()


def local_then_joined(address: str, monkeypatch, sets: list[str]) -> tuple[str, str]:
    """The plan's text made on this machine with no Ray (RAY_ADDRESS=local, and ray.init refused),
    then with RAY_ADDRESS at the session's head (joined, and left after), free memory read alike:
    the one reading that moves between the two, read in this process by both."""
    monkeypatch.setattr(cluster, "available_memory", lambda: 20 * 2**30)
    monkeypatch.setenv("RAY_ADDRESS", "local")
    with monkeypatch.context() as no_ray:
        no_ray.setattr(ray, "init", lambda *a, **k: pytest.fail("plan started Ray"))
        local = megatrain_ray.plan(TINY, sets=sets)
    assert not ray.is_initialized()
    monkeypatch.setenv("RAY_ADDRESS", address)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # the head runs without token authentication
    joined = megatrain_ray.plan(TINY, sets=sets)
    assert not ray.is_initialized()  # it left the cluster it joined
    assert local.fits and joined.fits
    return local.text, joined.text


@pytest.mark.parametrize("disk", [False, True], ids=["quick-start", "disk-tier"])
def test_the_plan_without_ray_is_the_plan_an_embedded_ray_gives(ray_head, monkeypatch, tmp_path, capsys, disk):
    sets = [f"runtime.disk_dir={tmp_path}", "runtime.store_memory_gib=0.002"] if disk else []
    if torch.cuda.is_available():  # the GPU's free bytes differ by a CUDA context: Ray's are read in a task's process
        sets.append("executor.device=cpu")
    node = head_node_id(ray_head)
    local, joined = local_then_joined(ray_head, monkeypatch, sets)
    assert f"({node[:8]}" in joined  # RAY_ADDRESS at the head: the plan joined it, and names its node
    ids = set(re.findall(r"\(([0-9a-f]{8})[,)]", local))
    assert len(ids) == 1 and node[:8] not in ids  # one node, with a node id of its own, as a fresh Ray's
    assert local.replace(ids.pop(), node[:8]) == joined
    if disk:  # the disk's free bytes, probed under runtime.disk_dir, are in the text
        assert re.search(r"with the disk tier \(\d+ GiB free\)", local), local
    capsys.readouterr()


def test_this_machine_is_the_node_ray_counts(ray_head, tmp_path):
    """Every fact of the node but its id, and its free memory, which moves: as the head counts it."""
    cfg = megatrain_ray.api.to_config(TINY, [f"runtime.disk_dir={tmp_path}"]).runtime
    mine, = cluster.this_machine(cfg).nodes(cfg)
    ray.init(address=ray_head)
    try:
        theirs, = cluster.discover_nodes(cfg)
        headroom = cluster.node_headroom(theirs.node_id)
    finally:
        ray.shutdown()
    assert (mine.ip, mine.gpus, mine.ram_node, mine.cpus) == (theirs.ip, theirs.gpus, theirs.ram_node, theirs.cpus)
    assert (mine.disk_bytes, mine.disk_read_gbs, mine.disk_write_gbs) == (
        theirs.disk_bytes, theirs.disk_read_gbs, theirs.disk_write_gbs)  # probed once per process
    assert mine.free_bytes == pytest.approx(theirs.free_bytes, abs=2**30)
    assert cluster.this_machine(cfg).headroom(mine.node_id) == pytest.approx(headroom, abs=2**30)


def test_the_cli_plan_with_no_cluster_starts_no_ray():
    """No Ray session is made (Ray writes one under RAY_TMPDIR as it starts), and no process waits for one."""
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:  # short: Ray's socket paths must fit 107 bytes
        env = {**os.environ, "RAY_ADDRESS": "local", "RAY_TMPDIR": tmp,
               "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "megatrain_ray.cli", "plan", str(TINY)], env=env,
                              capture_output=True, text=True, timeout=300)
        took = time.perf_counter() - start
        made = list(Path(tmp).iterdir())
    assert done.returncode == 0 and done.stdout.rstrip().endswith("fits"), done.stdout + done.stderr
    assert made == [], made
    assert "Started a local Ray instance" not in done.stderr
    print(f"megatrain-ray plan {TINY.name} without Ray: {took:.1f} s")
