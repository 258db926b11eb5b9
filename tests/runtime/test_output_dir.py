"""A resumed run's metrics.jsonl: the rows after its checkpoint's step and a row torn by a crash
mid-write go, the rest stays byte for byte."""

import json

from megatrain_ray.runtime.output_dir import trim_metrics


def test_rows_after_the_checkpoint_and_a_torn_row_are_dropped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in range(1, 8)]
    path.write_text("".join(rows) + '{"step": 8, "lo')  # the crash cut the last row
    trim_metrics(path, 5)
    assert path.read_text() == "".join(rows[:5])
    trim_metrics(path, 5)  # nothing more to drop: the file stays as it is
    assert path.read_text() == "".join(rows[:5])
