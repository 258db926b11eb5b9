"""The README's Install and Quick start, literally: the lines of the first bash block under each
heading, in order, in one fresh `bash` (its own HOME, a PATH without megatrain-ray, no cluster to
join; the host AdamW kernel's build cache shared with the other tests), which must end with exit
status 0. Then the run they made is checked: the resumed steps kept the LR schedule of the first
40 (the resume said so).

What the install runs here, and what it does not: `python3 -m venv .venv` makes the venv (without
its own pip) with a `.pth` that puts this interpreter's site-packages behind the venv's own, and a
`.venv/bin/pip` that runs that pip; pip is given no index (PIP_NO_INDEX) and no isolated build
environment (PIP_NO_BUILD_ISOLATION=0). So `pip install torch==2.13.0` finds it installed, and
`pip install -e ".[test]"` resolves every requirement against what is installed, builds and
installs this project (a copy of it) into the venv with its `megatrain-ray` script, and downloads
nothing: the test checks the lines, their order and that `megatrain-ray` is on the PATH after
them, not PyPI (CI's own install, .ci/run, does that). About 15 s more than the Quick start alone.

The plan the Quick start's `megatrain-ray plan` prints is checked here too (the planner's own
tests are in tests/planning/).
"""

import json
import os
import shutil
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from helpers.readme import shell_lines
from helpers.runs import kernel_cache

REPO = Path(__file__).parents[2]
STEPS, MORE = 40, 60  # examples/tiny.yaml's steps, and the Quick start's resume's


def venv_shim(directory: Path) -> Path:
    """A `python3` that is this interpreter, except that `python3 -m venv DIR` makes a venv that sees
    this interpreter's packages (see the module docstring)."""
    directory.mkdir()
    shim = directory / "python3"
    shim.write_text(f"""#!/usr/bin/env bash
if [[ "$1 $2" == "-m venv" ]]; then
  "{sys.executable}" -m venv --without-pip "${{@:3}}" || exit
  dir="${{@: -1}}"
  echo "{sysconfig.get_paths()['purelib']}" > "$(echo "$dir"/lib/python*/site-packages)/outer-site-packages.pth"
  printf '#!/bin/sh\\nexec "$(dirname "$0")/python" -m pip "$@"\\n' > "$dir/bin/pip"
  chmod +x "$dir/bin/pip"
  exit
fi
exec "{sys.executable}" "$@"
""")
    shim.chmod(0o755)
    return directory


def fresh_shell_env(tmp_path: Path) -> dict[str, str]:
    """A new user's shell: a fresh HOME, no Ray settings, no megatrain-ray on the PATH."""
    path = [d for d in os.environ.get("PATH", "").split(os.pathsep) if d and not (Path(d) / "megatrain-ray").exists()]
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RAY_", "PIP_")) and k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HOME=str(tmp_path / "home"), PATH=os.pathsep.join([str(venv_shim(tmp_path / "shim")), *path]),
               RAY_ADDRESS="local",  # a fresh machine has no cluster to join (other tests' may run here)
               RAY_USAGE_STATS_ENABLED="0", PIP_NO_INDEX="1", PIP_NO_BUILD_ISOLATION="0", **kernel_cache())
    return env


def project_copy(directory: Path) -> Path:
    """What a clone holds that the Install and Quick start read: the package, pyproject, README, examples."""
    directory.mkdir()
    shutil.copytree(REPO / "megatrain_ray", directory / "megatrain_ray", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, directory / name)
    (directory / "examples").symlink_to(REPO / "examples")
    return directory


def test_the_readme_install_and_quick_start_run_in_order_in_a_fresh_shell(tmp_path):
    import subprocess

    readme = (REPO / "README.md").read_text()
    install, quick_start = shell_lines(readme, "Install"), shell_lines(readme, "Quick start")
    assert install and not any("pytest" in line for line in install), install  # the suite does not run itself
    assert quick_start and all(line.startswith("megatrain-ray ") for line in quick_start), quick_start
    (tmp_path / "home").mkdir()
    work = project_copy(tmp_path / "clone")
    script = "\n".join(["set -ex", "if command -v megatrain-ray; then exit 99; fi  # not on the PATH before",
                        *install, *quick_start])
    done = subprocess.run(["bash", "-c", script], cwd=work, env=fresh_shell_env(tmp_path), capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, f"exit {done.returncode}:\n{(done.stdout + done.stderr)[-6000:]}"
    assert (work / ".venv" / "bin" / "megatrain-ray").exists()

    # `megatrain-ray plan` printed the plan, ending in its verdict, before the run's first line.
    plan = done.stdout[:done.stdout.index("\nfits\n")]
    assert "host bytes/param" in plan and "device memory, predicted peak" in plan
    if not torch.cuda.is_available():  # no GPU's figure on a machine without one
        assert "no GPU here: no step time is predicted" in plan
        assert "predicted step" not in plan and "tokens/s" not in plan and "busy" not in plan
        assert "GPU node" not in plan and "GPU memory" not in plan  # nor its memory or kept graphs

    # The resume to step 60 kept the schedule of the first 40 steps (its LR at the floor), and said so.
    assert f"LR schedule: kept from the checkpoint's run (warmup + cosine over {STEPS} steps)" in done.stdout
    rows = [json.loads(line) for line in (work / "runs" / "tiny" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, MORE + 1))
    floor = 3e-3 * 0.1  # examples/tiny.yaml's optim.lr x the default optim.min_lr_ratio
    assert rows[STEPS - 1]["lr"] > floor and all(r["lr"] == pytest.approx(floor) for r in rows[STEPS:])


def test_what_the_quick_start_writes_is_ignored_by_git():
    """The run's directory and the export's are not the project's files: a later `ray job submit
    --working-dir .` or `git add .` leaves them out."""
    import subprocess

    lines = shell_lines((REPO / "README.md").read_text(), "Quick start")
    export = next(line.split()[3] for line in lines if line.startswith("megatrain-ray export"))
    written = ["runs/tiny", export]
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    done = subprocess.run(["git", "-C", str(REPO), "check-ignore", "--no-index", *written], capture_output=True,
                          text=True)
    assert done.stdout.split() == written, done.stdout + done.stderr
