"""Under `ray job submit --working-dir .` a run's outputs go where the user finds them, not into
Ray's temporary copy of the working directory: a relative train.output_dir lands under
~/megatrain-ray/ on the node that runs the job, the job prints that path, and a relative data
path that Ray did not upload (git-ignored) is refused with what Ray uploads. All of it beside a
local `megatrain-ray train` that runs its own embedded Ray on the same machine.

A real `ray start --head` cluster with the dashboard and token authentication, in a temp dir and
HOME of the test's own, ended by pid."""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from helpers.ray_processes import end_processes_under, free_port

BIN = Path(sys.executable).parent
REPO = Path(__file__).parents[2]
SMALL = ["--set", "train.steps=2", "--set", "checkpoint.every=0", "--set", "checkpoint.export_hf=false"]


@pytest.fixture
def head(tmp_path):
    ray_tmp = Path(tempfile.mkdtemp(prefix="mr-", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(HOME=str(home), RAY_TMPDIR=str(ray_tmp), RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="token",
               PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}", PYTHONPATH=str(REPO))
    dash = free_port()
    subprocess.run([str(BIN / "ray"), "get-auth-token", "--generate"], env=env, check=True, capture_output=True,
                   timeout=120)  # as the README's first job says
    try:
        subprocess.run([str(BIN / "ray"), "start", "--head", f"--port={free_port()}", "--node-ip-address=127.0.0.1",
                        "--num-cpus=2", "--object-store-memory=100000000", "--include-dashboard=true",
                        "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", "--disable-usage-stats",
                        # not the default 52365, which another Ray on the machine may hold (README)
                        f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}"],
                       env=env, check=True, capture_output=True, timeout=180)
        yield env, f"http://127.0.0.1:{dash}"
    finally:
        end_processes_under(ray_tmp)
        shutil.rmtree(ray_tmp, ignore_errors=True)


def submit(dashboard: str, work: Path, entrypoint: list[str], env: dict) -> subprocess.CompletedProcess:
    """`ray job submit`, again while the head's job agent has not registered (README: Troubleshooting)."""
    argv = [str(BIN / "ray"), "job", "submit", "--address", dashboard, "--working-dir", ".", "--", *entrypoint]
    deadline = time.monotonic() + 180
    while True:
        done = subprocess.run(argv, env=env, cwd=work, capture_output=True, text=True, timeout=420)
        if "No available agent" not in done.stdout + done.stderr or time.monotonic() > deadline:
            return done
        time.sleep(3)


def test_a_jobs_outputs_land_in_the_run_home_beside_a_local_run(head, tmp_path):
    env, dashboard = head
    work = tmp_path / "project"
    (work / "data").mkdir(parents=True)
    shutil.copy(REPO / "examples" / "tiny.yaml", work / "tiny.yaml")
    (work / ".gitignore").write_text("runs/\ndata/\n")
    (work / "data" / "train.jsonl").write_text(json.dumps({"input_ids": list(range(20))}) + "\n")

    # A local run in a terminal beside it, with its own embedded Ray (the cluster is not its to join).
    local_out = tmp_path / "local-run"
    light = ["--set", "data.seq_len=16", "--set", "train.micro_batch_size=1", "--set", "train.grad_accum=1",
             "--set", "runtime.num_cpus=1"]  # small steps: the machine stays free for the cluster
    local = subprocess.Popen([str(BIN / "megatrain-ray"), "train", "tiny.yaml", "--set", "train.steps=100000",
                              "--set", f"train.output_dir={local_out}", "--set", "checkpoint.every=0", *light],
                             env={**env, "RAY_ADDRESS": "local"}, cwd=work, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while not (local_out / "metrics.jsonl").exists() and local.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert local.poll() is None, local.stdout.read()[-3000:]

        done = submit(dashboard, work, ["megatrain-ray", "train", "tiny.yaml", *SMALL], env)
        out = done.stdout + done.stderr
        assert done.returncode == 0 and "succeeded" in out.lower(), out[-4000:]
        runs = Path(env["HOME"]) / "megatrain-ray" / "runs" / "tiny"
        assert f"output directory: {runs} on " in out and f"outputs in {runs} on " in out
        rows = [json.loads(line)["step"] for line in (runs / "metrics.jsonl").read_text().splitlines()]
        assert rows == [1, 2] and (runs / "checkpoints" / "step-00000002" / "MANIFEST.json").exists()
        assert not (work / "runs").exists()  # nothing written beside the user's own files either

        # A relative input that Ray did not upload (git-ignored): refused, with what Ray uploads.
        done = submit(dashboard, work, ["megatrain-ray", "train", "tiny.yaml", *SMALL, "--set",
                                        "data.source=data/train.jsonl", "--set", "train.output_dir=runs/data"], env)
        out = done.stdout + done.stderr
        assert done.returncode != 0 and "data.source 'data/train.jsonl' is not in the job's working directory" in out
        assert ".gitignore" in out and "absolute" in out and "Traceback" not in out
    finally:
        local.send_signal(signal.SIGTERM)  # it stops at a step with a checkpoint
        local.communicate(timeout=300)
    assert local.returncode == 143
