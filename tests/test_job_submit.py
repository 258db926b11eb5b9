"""`ray job submit -- megatrain-ray train` against a real `ray start --head` cluster."""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
# A fresh cluster of our own, without Ray's token auth (which `ray start` turns on by itself when
# ~/.ray/auth_token exists) so the test does not depend on what the machine ran before.
ENV = {**os.environ, "RAY_ADDRESS": "", "RAY_AUTH_MODE": "disabled"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def head_node(tmp_path):
    port, dashboard = free_port(), free_port()
    env = ENV
    start = [
        str(BIN / "ray"), "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1",
        "--num-cpus=2", "--object-store-memory=200000000", "--include-dashboard=true",
        "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}", "--disable-usage-stats",
    ]
    subprocess.run(start, check=True, env=env, capture_output=True, timeout=120)
    yield f"http://127.0.0.1:{dashboard}"
    subprocess.run([str(BIN / "ray"), "stop", "--force"], env=env, capture_output=True, timeout=120)


def test_ray_job_submit_trains_and_leaves_checkpoint_and_metrics(head_node, tmp_path):
    work = tmp_path / "job"
    work.mkdir()
    shutil.copy(Path(__file__).parents[1] / "examples" / "tiny.yaml", work / "tiny.yaml")
    out = tmp_path / "run"
    submit = [
        str(BIN / "ray"), "job", "submit", "--address", head_node, "--working-dir", str(work), "--",
        str(BIN / "megatrain-ray"), "train", "tiny.yaml",
        "--set", "train.steps=6", "--set", "checkpoint.every=0", "--set", f"train.output_dir={out}",
    ]
    done = subprocess.run(submit, capture_output=True, text=True, timeout=600, env=ENV)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "succeeded" in (done.stdout + done.stderr).lower()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 7))
    checkpoints = sorted((out / "checkpoints").glob("step-*"))
    assert checkpoints and (checkpoints[-1] / "MANIFEST.json").exists()
