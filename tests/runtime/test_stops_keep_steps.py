"""A run that stops mid-way for bad data keeps its finished steps: with checkpoint.every=0 it
writes the checkpoint of its last finished step, the CLI prints the command that continues from
it (exit 2), and --resume from it trains the remaining steps. Through the CLI in this process,
joined to the test session's Ray head."""

import json
import shlex
from pathlib import Path

from helpers.runs import tiny_raw
from megatrain_ray import cli
from megatrain_ray.data import summary

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
