"""The README's path on one fresh machine, in its order, with Ray's token authentication on: a
local run, then `ray start --head` and `ray job submit`, then a head with RAM nodes
(cluster/local-cluster.sh) that `megatrain-ray train` joins by address.

Under `ray job submit --working-dir .` a run's outputs go where the user finds them, not into
Ray's temporary copy of the working directory: a relative train.output_dir lands under
~/megatrain-ray/ on the node that runs the job, the job prints that path, and a relative data
path that Ray did not upload (git-ignored) is refused with what Ray uploads. All of it beside a
local `megatrain-ray train` that runs its own embedded Ray on the same machine.

"Fresh machine": the test's own HOME (no token yet: the local run makes it, never in the user's
~/.ray), its own Ray temp dir (no cluster to join), RAY_AUTH_MODE unset as a user has it; only the
host AdamW kernel's build cache is shared with the other tests. Every Ray process started under
that temp dir is ended by pid at the end (never `ray stop`, which would end every Ray on the
machine)."""

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from helpers.ray_processes import end_processes_under, listening_addresses, on_loopback, pids_under
from helpers.files import steps_of
from helpers.runs import kernel_cache

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
               MEGATRAIN_CLUSTER_DIR=str(ray_tmp / "lc"), RAY="", **kernel_cache())
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


def submit(dashboard: str, work: Path, entrypoint: list[str], env: dict) -> subprocess.CompletedProcess:
    """`ray job submit --working-dir .`; again while the head's job agent has not registered yet (Ray
    answers 'No available agent' for a while after `ray start`, longer on a busy machine, before any
    job exists)."""
    argv = [str(BIN / "ray"), "job", "submit", "--address", dashboard, "--working-dir", ".", "--", *entrypoint]
    deadline = time.monotonic() + 180
    while True:
        done = subprocess.run(argv, env=env, cwd=work, capture_output=True, text=True, timeout=420)
        if "No available agent" not in done.stdout + done.stderr or time.monotonic() > deadline:
            return done
        time.sleep(3)


def start_local_run_beside(work: Path, out_dir: Path, env: dict) -> subprocess.Popen:
    """A local run in a terminal beside the cluster, with its own embedded Ray (a cluster is not
    its to join), running until it is signalled. At the lowest CPU priority, which its Ray's
    processes inherit: its steps, one after another, take what the cluster leaves of the cores."""
    light = ["--set", "data.seq_len=16", "--set", "train.micro_batch_size=1", "--set", "train.grad_accum=1",
             "--set", "runtime.num_cpus=1"]  # small steps: the machine stays free for the cluster
    return subprocess.Popen([str(BIN / "megatrain-ray"), "train", "tiny.yaml", "--set", "train.steps=100000",
                             "--set", f"train.output_dir={out_dir}", "--set", "checkpoint.every=0", *light],
                            env={**env, "RAY_ADDRESS": "local"}, cwd=work, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, preexec_fn=lambda: os.nice(19))


def wait_for(path: Path, local: subprocess.Popen) -> None:
    """Until `path` exists, while the local run runs."""
    deadline = time.monotonic() + 300
    while not path.exists() and local.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert local.poll() is None and path.exists(), local.stdout.read()[-3000:] if local.poll() is not None else path


def status_without_token(dashboard: str) -> int:
    try:
        with urllib.request.urlopen(f"{dashboard}/api/jobs/", timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code


def test_local_run_then_head_and_job_submit_then_ram_nodes_with_token_auth(machine, tmp_path):
    env, work = machine, tmp_path / "job"
    (work / "data").mkdir(parents=True)
    shutil.copy(REPO / "examples" / "tiny.yaml", work / "tiny.yaml")
    (work / ".gitignore").write_text("runs/\ndata/\n")
    (work / "data" / "train.jsonl").write_text(json.dumps({"input_ids": list(range(20))}) + "\n")
    train = [str(BIN / "megatrain-ray"), "train", "tiny.yaml", *SMALL]

    # 1. A local run, in a shell with RAY_AUTH_MODE=token as the README says (Ray >= 2.59 does the
    #    same for an embedded Ray by itself): the embedded Ray makes the token. It keeps running
    #    beside the cluster of steps 2 and 3 until a SIGTERM stops it at a step, with its checkpoint.
    shell = {**env, "RAY_AUTH_MODE": "token"}
    local_out = tmp_path / "local"
    local = start_local_run_beside(work, local_out, shell)
    try:
        token = Path(env["HOME"]) / ".ray" / "auth_token"
        wait_for(token, local)  # the embedded Ray's start made it; the head starts while the run starts

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
        wait_for(local_out / "metrics.jsonl", local)  # the local run has made a step: it runs beside the head
        assert stat.S_IMODE(token.stat().st_mode) == 0o600  # no other user reads the token

        # 3. `ray job submit --working-dir .` from that shell (Ray's job client sends the token only
        #    with the variable), beside the local run. A relative output_dir (the default) lands in
        #    the run home, ~/megatrain-ray/, and the job prints it. Beside it, a job with a relative
        #    input that Ray did not upload (git-ignored): refused, with what Ray uploads. The two
        #    submitted at once: each waits seconds on the job API's one-second polls.
        with ThreadPoolExecutor(2) as both:
            trained = both.submit(submit, dashboard, work, [*train], shell)
            refused = both.submit(submit, dashboard, work, [*train, "--set", "data.source=data/train.jsonl",
                                                            "--set", "train.output_dir=runs/data"], shell)
            trained, refused = trained.result(), refused.result()
        out = trained.stdout + trained.stderr
        assert trained.returncode == 0 and "succeeded" in out.lower(), out[-4000:]
        runs = Path(env["HOME"]) / "megatrain-ray" / "runs" / "tiny"
        assert f"output directory: {runs} on " in out and f"outputs in {runs} on " in out
        assert steps_of(runs) == [1, 2]
        assert (runs / "checkpoints" / "step-00000002" / "MANIFEST.json").exists()
        assert not (work / "runs").exists()  # nothing written beside the user's own files either

        out = refused.stdout + refused.stderr
        assert refused.returncode != 0 and "data.source 'data/train.jsonl' is not in the job's working directory" in out
        assert ".gitignore" in out and "absolute" in out and "Traceback" not in out
    finally:
        local.send_signal(signal.SIGTERM)
        shown = local.communicate(timeout=300)[0]
    assert local.returncode == 143, shown[-3000:]
    k = steps_of(local_out)[-1]
    assert steps_of(local_out) == list(range(1, k + 1)) and f"after step {k}" in shown
    assert (local_out / "checkpoints" / f"step-{k:08d}" / "MANIFEST.json").exists()

    end_processes_under(Path(env["RAY_TMPDIR"]) / "ray", grace=0.5)  # the head: its GCS ignores SIGTERM

    # 4. A head and a RAM node on this machine (cluster/local-cluster.sh), and `megatrain-ray train`
    #    joining it by address from a shell without RAY_AUTH_MODE: token authentication is on for
    #    every node all the same, and the driver finds the token and uses it. The driver takes
    #    cluster.env's RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, as the script says: its node IP 127.0.0.1.
    script, state = str(REPO / "cluster" / "local-cluster.sh"), Path(env["MEGATRAIN_CLUSTER_DIR"])
    cluster_env = {**env, "RAY": str(BIN / "ray")}
    out = run([script, "start", "1", "--num-cpus", "2", "--object-store-memory", "100000000"], cluster_env, work)
    assert "token authentication on" in out, out
    assert stat.S_IMODE(state.stat().st_mode) == 0o700  # its logs and settings: no other user's
    settings = dict(line.split("=", 1) for line in (state / "cluster.env").read_text().splitlines())
    assert settings["RAY_AUTH_MODE"] == "token"
    assert status_without_token(settings["RAY_DASHBOARD"]) == 401
    joining = {key: settings[key] for key in ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}
    out = run([*train, "--set", f"train.output_dir={tmp_path / 'ram-nodes'}"], {**env, **joining}, work)
    assert "RAM node" in out and steps_of(tmp_path / "ram-nodes") == [1, 2], out[-3000:]

    # Every server of the two nodes (the GCS, the raylets, the dashboard, the agents, the workers the
    # run left) listens on the loopback only, as the script's header says.
    listening = listening_addresses(pids_under(state))
    assert settings["RAY_ADDRESS"].replace("127.0.0.1", "[::ffff:127.0.0.1]") in listening \
        or settings["RAY_ADDRESS"] in listening, listening  # the GCS
    assert len(listening) >= 10 and [a for a in listening if not on_loopback(a)] == [], listening
    run([script, "stop"], cluster_env, work, timeout=180)


def test_the_local_clusters_directory_is_each_users_own(tmp_path):
    """cluster/local-cluster.sh keeps its state in /tmp/megatrain-cluster-USER unless
    MEGATRAIN_CLUSTER_DIR names another: two users of one machine do not share (nor stop) one."""
    import pwd

    script = str(REPO / "cluster" / "local-cluster.sh")
    env = {k: v for k, v in os.environ.items() if k != "MEGATRAIN_CLUSTER_DIR"}
    env.update(RAY=str(BIN / "ray"))
    users = Path(f"/tmp/megatrain-cluster-{pwd.getpwuid(os.getuid()).pw_name}")
    for chosen, where in (({}, users), ({"MEGATRAIN_CLUSTER_DIR": str(tmp_path / "lc")}, tmp_path / "lc")):
        done = subprocess.run([script, "status"], env={**env, **chosen}, capture_output=True, text=True, timeout=60)
        said = done.stdout + done.stderr  # "not running (no cluster in DIR)", or a running one's DIR/cluster.env
        assert f"no cluster in {where})" in said or f"{where}/cluster.env" in said, said
