"""examples/model_table.py, which writes the models guide's table, run as its docstring says on two
types: one that trains (its 3 steps against transformers + AdamW) and one that is refused (the
reason `train` gives). A script that no test runs went stale once (it called a store method that
had moved), and every row it wrote would have said "failed"."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).parents[2]


def test_the_table_script_trains_one_type_and_refuses_another():
    done = subprocess.run([sys.executable, str(REPO / "examples" / "model_table.py"), "llama", "blt"],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = dict(line.split(": ", 1) for line in done.stdout.splitlines() if ": " in line)
    assert rows["llama"].startswith("trains") and "equal to transformers + AdamW" in rows["llama"], done.stdout
    assert rows["blt"].startswith("refused") and "cannot be trained" in rows["blt"], done.stdout
