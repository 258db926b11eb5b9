"""The README's image-text recipe, literally: the lines of the first bash block under `## Image-text
fine-tuning`, in order, in one `bash` in an empty directory holding the project's examples/ (as a
clone's top holds it), which must end with exit status 0. `python` and `megatrain-ray` are this
interpreter's (its bin/ first on the PATH); a fresh HOME (the host AdamW kernel's build cache shared
with the other tests) and no cluster to join: `megatrain-ray train` starts its own Ray, as on a
user's machine. No download and no torchvision.

Then what the commands made is checked: the row whose image is missing was skipped and named, the
loss fell, and the export, loaded by transformers through the example's own code, names the colour
of every image, the README's (the answer it printed last) among them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from megatrain_ray.config import load_config  # noqa: E402
from helpers.examples import example_module  # noqa: E402
from helpers.readme import shell_lines  # noqa: E402
from helpers.runs import kernel_cache  # noqa: E402

REPO = Path(__file__).parents[2]
BIN = Path(sys.executable).parent  # python and megatrain-ray


def test_the_readme_image_text_recipe_runs_as_written(tmp_path):
    lines = shell_lines((REPO / "README.md").read_text(), "Image-text fine-tuning")
    assert [line.split()[:2] for line in lines] == [
        ["python", "examples/make_tiny_image_text_model.py"], ["megatrain-ray", "train"],
        ["python", "examples/generate_image_text.py"]], lines
    (tmp_path / "examples").symlink_to(REPO / "examples")
    (tmp_path / "home").mkdir()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("RAY_")}, **kernel_cache(),
           "HOME": str(tmp_path / "home"), "RAY_ADDRESS": "local", "RAY_USAGE_STATS_ENABLED": "0",
           "PATH": os.pathsep.join([str(BIN), os.environ.get("PATH", "")]),
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(["bash", "-c", "\n".join(["set -ex", *lines])], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"exit {done.returncode}:\n{(done.stdout + done.stderr)[-6000:]}"

    # The rows the maker wrote: the last one's image missing, and only that one; the run skipped it and said where.
    made = Path(lines[0].split("#")[0].split()[-1])
    rows = [json.loads(line) for line in (tmp_path / made / "rows.jsonl").read_text().splitlines()]
    missing = [(n, image) for n, row in enumerate(rows, 1) for image in row["images"]
               if not (tmp_path / made / image).exists()]
    assert missing == [(len(rows), missing[0][1])] and all(row["messages"] for row in rows), missing
    assert f"bad row: {tmp_path / made / 'rows.jsonl'} row {len(rows)} (line {len(rows)}, counting from 1): cannot read " \
           f"image {missing[0][1]}" in done.stdout, done.stdout[-3000:]
    assert f"{len(rows) - 1} trainable rows" in done.stdout

    # The run's steps, the loss falling; the answer the README's command printed, from the run's export.
    config = load_config(REPO / lines[1].split("#")[0].split()[-1])
    output = tmp_path / config.train.output_dir
    metrics = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, config.train.steps + 1))
    assert metrics[-1]["loss"] < metrics[0]["loss"] / 10, [m["loss"] for m in metrics]
    export, image = lines[2].split("#")[0].split()[2:4]
    assert Path(export) == output.relative_to(tmp_path) / "checkpoints" / f"step-{config.train.steps:08d}" / "hf"
    assert done.stdout.splitlines()[-1] == Path(image).stem  # red.png: "red"

    # Every colour's image, asked as the rows ask, is answered with its colour.
    answer = example_module("generate_image_text").answer
    images = sorted((tmp_path / made / "images").glob("*.png"))
    assert len(images) > 2
    assert {p.stem: answer(str(tmp_path / export), str(p), "name the colour") for p in images} == \
           {p.stem: p.stem for p in images}
