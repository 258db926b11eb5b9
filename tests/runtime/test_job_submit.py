"""The README's path on one fresh machine, in its order, with Ray's token authentication on: a
local run, then `ray start --head` and `ray job submit`, then a head with RAM nodes
(cluster/local-cluster.sh) that `megatrain-ray train` joins by address.

"Fresh machine": the test's own HOME (no token yet: the local run makes it, never in the user's
~/.ray), its own Ray temp dir (no cluster to join), RAY_AUTH_MODE unset as a user has it. Every Ray
process started under that temp dir is ended by pid at the end (never `ray stop`, which would end
every Ray on the machine)."""

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from helpers.ray_processes import end_processes_under

BIN = Path(sys.executable).parent
REPO = Path(__file__).parents[2]
SMALL = ["--set", "train.steps=2", "--set", "checkpoint.every=0", "--set", "checkpoint.export_hf=false"]


def free_ports(count: int) -> list[int]:
    """`count` distinct free ports, all held while choosing."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


@pytest.fixture
def machine(tmp_path):
    ray_tmp = Path(tempfile.mkdtemp(prefix="mr-", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env.update(HOME=str(home), RAY_TMPDIR=str(ray_tmp), RAY_ADDRESS="", RAY_USAGE_STATS_ENABLED="0",
               PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}", PYTHONPATH=str(REPO),
               MEGATRAIN_CLUSTER_DIR=str(ray_tmp / "lc"), RAY="")
    yield env
    subprocess.run([str(REPO / "cluster" / "local-cluster.sh"), "stop"], env={**env, "RAY": str(BIN / "ray")},
                   capture_output=True, timeout=180)
    end_processes_under(ray_tmp)
    shutil.rmtree(ray_tmp, ignore_errors=True)


def run(argv: list[str], env: dict, cwd: Path, timeout: int = 420) -> str:
    done = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    out = done.stdout + done.stderr
    assert done.returncode == 0, f"{argv} exited {done.returncode}:\n{out[-4000:]}"
    return out


def submit_job(dashboard: str, work: Path, entrypoint: list[str], env: dict) -> str:
    """`ray job submit`; again while the head's job agent has not registered yet (Ray answers
    'No available agent' for a while after `ray start`, longer on a busy machine, before any job exists)."""
    argv = [str(BIN / "ray"), "job", "submit", "--address", dashboard, "--working-dir", str(work), "--", *entrypoint]
    deadline = time.monotonic() + 180
    while True:
        done = subprocess.run(argv, env=env, cwd=work, capture_output=True, text=True, timeout=420)
        out = done.stdout + done.stderr
        if "No available agent" not in out or time.monotonic() > deadline:
            break
        time.sleep(3)
    assert done.returncode == 0, f"{argv} exited {done.returncode}:\n{out[-4000:]}"
    return out


def status_without_token(dashboard: str) -> int:
    try:
        with urllib.request.urlopen(f"{dashboard}/api/jobs/", timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code


def steps_of(out_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def test_local_run_then_head_and_job_submit_then_ram_nodes_with_token_auth(machine, tmp_path):
    env, work = machine, tmp_path / "job"
    work.mkdir()
    shutil.copy(REPO / "examples" / "tiny.yaml", work / "tiny.yaml")
    train = [str(BIN / "megatrain-ray"), "train", "tiny.yaml", *SMALL]

    # 1. A local run, in a shell with RAY_AUTH_MODE=token as the README says (Ray >= 2.59 does the
    #    same for an embedded Ray by itself): the embedded Ray makes the token.
    shell = {**env, "RAY_AUTH_MODE": "token"}
    run([*train, "--set", f"train.output_dir={tmp_path / 'local'}"], shell, work)
    token = Path(env["HOME"]) / ".ray" / "auth_token"
    assert token.exists() and stat.S_IMODE(token.stat().st_mode) == 0o600  # no other user reads it
    assert steps_of(tmp_path / "local") == [1, 2]

    # 2. `ray start --head`: token authentication on for the head.
    #    Every port picked free, as cluster/local-cluster.sh does: Ray's defaults (the job agent's
    #    52365 among them) may be held by another Ray on this machine, and a job agent that cannot
    #    listen leaves `ray job submit` answering "No available agent" for ever.
    port, dash_port, *agent = free_ports(9)
    run([str(BIN / "ray"), "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1", "--num-cpus=2",
         "--object-store-memory=100000000", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
         f"--dashboard-port={dash_port}", f"--node-manager-port={agent[0]}", f"--object-manager-port={agent[1]}",
         f"--dashboard-agent-listen-port={agent[2]}", f"--dashboard-agent-grpc-port={agent[3]}",
         f"--runtime-env-agent-port={agent[4]}", f"--metrics-export-port={agent[5]}",
         f"--ray-client-server-port={agent[6]}", "--disable-usage-stats"], shell, work, timeout=180)
    dashboard = f"http://127.0.0.1:{dash_port}"
    assert status_without_token(dashboard) == 401  # the job API refuses a client without the token

    # 3. `ray job submit` from that shell (Ray's job client sends the token only with the variable).
    out = submit_job(dashboard, work, [*train, "--set", f"train.output_dir={tmp_path / 'job-run'}"], shell)
    assert "succeeded" in out.lower()
    assert steps_of(tmp_path / "job-run") == [1, 2]
    assert (tmp_path / "job-run" / "checkpoints" / "step-00000002" / "MANIFEST.json").exists()

    end_processes_under(Path(env["RAY_TMPDIR"]) / "ray")

    # 4. A head and a RAM node on this machine (cluster/local-cluster.sh), and `megatrain-ray train`
    #    joining it by address from a shell without RAY_AUTH_MODE: token authentication is on for
    #    every node all the same, and the driver finds the token and uses it.
    script = str(REPO / "cluster" / "local-cluster.sh")
    cluster_env = {**env, "RAY": str(BIN / "ray")}
    out = run([script, "start", "1", "--num-cpus", "2", "--object-store-memory", "100000000"], cluster_env, work)
    assert "token authentication on" in out, out
    settings = dict(line.split("=", 1) for line in (Path(env["MEGATRAIN_CLUSTER_DIR"]) / "cluster.env")
                    .read_text().splitlines())
    assert settings["RAY_AUTH_MODE"] == "token"
    assert status_without_token(settings["RAY_DASHBOARD"]) == 401
    out = run([*train, "--set", f"train.output_dir={tmp_path / 'ram-nodes'}"],
              {**env, "RAY_ADDRESS": settings["RAY_ADDRESS"]}, work)
    assert "RAM node" in out and steps_of(tmp_path / "ram-nodes") == [1, 2], out[-3000:]
    run([script, "stop"], cluster_env, work, timeout=180)
