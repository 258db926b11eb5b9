"""Shared-memory segments of the stores: private to their user, and those of a run killed with
SIGKILL (no close, no cleanup) removed by the next store that starts on the machine, while a live
run's stay."""

import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch

from megatrain_ray.host.memory import owner_tag, process_state
from megatrain_ray.models.registry import PRESETS
from megatrain_ray.host.store import ShardStore

STORE = textwrap.dedent('''
    """A store holding two layers in shared memory, the first one's state shared with a GPU worker;
    says READY, then waits to be killed."""
    import sys, time, torch
    from megatrain_ray.models.registry import PRESETS
    from megatrain_ray.host.store import ShardStore
    store = ShardStore(PRESETS["tiny-llama"], [0, 1], torch.float32, shm_dir=sys.argv[1], run_id=sys.argv[2])
    store.init_random(0, 0.02)
    store.share_state(0)
    print("READY", flush=True)
    time.sleep(600)
''')


def start_stores(tmp_path: Path, shm: Path, *run_ids: str) -> list[subprocess.Popen]:
    """A store process per run id, started side by side (each spends seconds importing torch)."""
    script = tmp_path / "store.py"
    script.write_text(STORE)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    procs = [subprocess.Popen([sys.executable, str(script), str(shm), run_id], stdout=subprocess.PIPE, text=True,
                              env=env) for run_id in run_ids]
    for proc in procs:
        assert proc.stdout.readline().strip() == "READY"
    return procs


def segments(shm: Path, run_id: str) -> list[Path]:
    return sorted(shm.glob(f"megatrain-{run_id}-*"))


def test_segments_of_a_killed_run_are_removed_by_the_next_and_a_live_run_keeps_its_own(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    killed, live = start_stores(tmp_path, shm, "killed", "live")
    try:
        assert len(segments(shm, "killed")) == len(segments(shm, "live")) == 2 + 3 + 1  # weights, state of layer 0, its held marker
        for path in segments(shm, "killed") + segments(shm, "live"):
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path  # nobody else reads the weights
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=30)
        assert len(segments(shm, "killed")) == 6  # a SIGKILL leaves them behind ...
        # ... and a segment whose pid was reused since (same pid, another start time) is dead too;
        # a file that is not a segment is none of our business.
        pid, start, boot = owner_tag().split(".")
        reused = shm / f"megatrain-reused-{pid}.{int(start) + 1}.{boot}-layer0"
        reused.write_bytes(b"\0" * 64)
        other = shm / "megatrain-notes.txt"
        other.write_text("keep")

        store = ShardStore(PRESETS["tiny-llama"], [2], torch.float32, shm_dir=str(shm), run_id="next")
        assert segments(shm, "killed") == [] and not reused.exists()  # the next run swept them
        assert len(segments(shm, "live")) == 6 and other.exists()  # a live run keeps its own
        assert len(segments(shm, "next")) == 1
        store.share_state(2)
        assert len(segments(shm, "next")) == 5  # and its held marker
        store.close()
        assert segments(shm, "next") == []
    finally:
        for proc in (killed, live):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def wait_for_zombie(pid: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while process_state(pid)[0] != "Z":
        assert time.monotonic() < deadline, f"{pid} did not become a zombie"
        time.sleep(0.01)


def test_the_sweep_does_not_wait_on_timing(tmp_path):
    """What a busy machine leaves behind when the next run starts, judged without waiting: a store
    killed but not yet reaped by its parent (a zombie: its /proc entry, start time and all, is
    still there), and a store still being stopped after its run's driver was killed. Both are
    swept; a store whose driver lives is not. A sweep at close catches a store that dies later."""
    shm = tmp_path / "shm"
    shm.mkdir()
    driver = subprocess.Popen(["sleep", "600"])
    live_driver = subprocess.Popen(["sleep", "600"])
    procs = [driver, live_driver]
    try:
        doomed_run, live_run = f"0123abcd.{owner_tag(driver.pid)}", f"4567cdef.{owner_tag(live_driver.pid)}"
        zombie, doomed, live, later = start_stores(tmp_path, shm, "zombie", doomed_run, live_run, "later")
        procs += [zombie, doomed, live, later]
        zombie.send_signal(signal.SIGKILL)  # not waited for: a zombie until this test reaps it
        wait_for_zombie(zombie.pid)
        driver.kill()
        driver.wait()
        assert doomed.poll() is None  # its store still runs

        store = ShardStore(PRESETS["tiny-llama"], [2], torch.float32, shm_dir=str(shm), run_id="next")
        assert segments(shm, "zombie") == [] and segments(shm, doomed_run) == []
        assert len(segments(shm, live_run)) == len(segments(shm, "later")) == 6

        later.send_signal(signal.SIGKILL)  # killed while `store` runs, gone before it closes
        wait_for_zombie(later.pid)
        store.close()
        assert segments(shm, "later") == [] and segments(shm, "next") == [] and len(segments(shm, live_run)) == 6
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def test_fresh_moments_take_no_memory_until_written_and_the_embedding_state_is_shared_from_the_start(tmp_path):
    """A new store's AdamW moments are zero pages the kernel gives at their first write: allocating
    them takes no memory, fault_in_moments takes it (and they read zero either way). A layer whose
    state a GPU worker steps is in shared memory from the allocation, which share_state then only names."""
    from megatrain_ray.host.memory import resident_bytes

    arch = PRESETS["tiny-llama"].replace(num_layers=2, hidden_size=512, intermediate_size=2048, num_heads=8,
                                         num_kv_heads=4, head_dim=64)
    before = resident_bytes()
    store = ShardStore(arch, [1, 2], torch.float32, shm_dir=str(tmp_path), run_id="fresh", shared_state=(1,))
    try:
        moments = sum(t.numel() * t.element_size() for s in store.layers.values() for t in (s.exp_avg, s.exp_avg_sq))
        assert moments > 60 * 2**20
        assert resident_bytes() - before < 0.1 * moments
        shared, own = store.layers[1], store.layers[2]
        shared.exp_avg.fill_(0.25)  # as a GPU worker's step of the layer would have written it
        own_moments = sum(t.numel() * t.element_size() for t in (own.exp_avg, own.exp_avg_sq))
        before = resident_bytes()
        store.fault_in_moments()
        assert resident_bytes() - before > 0.9 * own_moments
        assert torch.all(shared.exp_avg == 0.25), "a layer a worker steps is never zeroed by the store"
        shared.exp_avg.zero_()
        assert all(not t.any() for s in store.layers.values() for t in (s.exp_avg, s.exp_avg_sq))
        paths = store.share_state(1)
        assert Path(paths["exp_avg"]).stat().st_size == shared.exp_avg.numel() * 4
        mapped = torch.from_file(paths["master"], shared=True, size=shared.master.numel(), dtype=torch.float32)
        shared.master.fill_(0.5)
        assert torch.equal(mapped, shared.master)  # the same pages: nothing was copied
        assert store.shared_states() == {1: paths}
    finally:
        store.close()
