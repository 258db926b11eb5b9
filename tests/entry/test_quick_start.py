"""The README's Quick start, literally: the first bash block under its heading, each command in
order, on a fresh machine (its own HOME, no cluster to join; the host AdamW kernel's build cache
shared with the other tests), each with exit status 0."""

import os
import shlex
import subprocess
import sys
from pathlib import Path

from helpers.runs import kernel_cache

BIN = Path(sys.executable).parent
REPO = Path(__file__).parents[2]


def quick_start_commands(readme: str) -> list[str]:
    """The command lines of the first ```bash block after the '## Quick start' heading, without comments."""
    after = readme[readme.index("\n## Quick start"):]
    block = after[after.index("```bash\n") + len("```bash\n"):]
    block = block[:block.index("```")]
    return [shlex.join(words) for line in block.splitlines() if (words := shlex.split(line, comments=True))]


def test_the_readme_quick_start_runs_in_order(tmp_path):
    commands = quick_start_commands((REPO / "README.md").read_text())
    assert commands and all(c.startswith("megatrain-ray ") for c in commands), commands
    (tmp_path / "examples").symlink_to(REPO / "examples")
    (tmp_path / "home").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(HOME=str(tmp_path / "home"), PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}", PYTHONPATH=str(REPO),
               RAY_ADDRESS="local",  # a fresh machine has no cluster to join (other tests' may run here)
               RAY_USAGE_STATS_ENABLED="0", **kernel_cache())
    for command in commands:
        done = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, f"{command} exited {done.returncode}:\n{(done.stdout + done.stderr)[-4000:]}"
