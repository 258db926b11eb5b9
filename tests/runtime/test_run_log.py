"""The run's own log file (runtime/run_log.py), in process."""

import pytest

from megatrain_ray.runtime.run_log import run_output


def test_an_error_that_escapes_the_run_leaves_its_traceback_in_the_log(tmp_path):
    path = tmp_path / "train.log"
    with pytest.raises(RuntimeError, match="the connection went"):
        with run_output() as log:
            log.attach(path)
            print("step 1/9 | loss 1.0")
            raise RuntimeError("the connection went")
    text = path.read_text()
    assert text.startswith("step 1/9 | loss 1.0\nTraceback (most recent call last):\n")
    assert text.endswith("RuntimeError: the connection went\n")


def test_a_line_is_in_the_file_as_soon_as_it_is_said(tmp_path):
    """Before the log is closed or flushed: a hard exit of the process (os._exit) keeps it."""
    path = tmp_path / "train.log"
    with run_output() as log:
        log.attach(path)
        print("step 1/9", end="")
        assert path.read_text() == ""
        print(" | loss 1.0")
        assert path.read_text() == "step 1/9 | loss 1.0\n"


def test_an_exit_that_a_library_makes_mid_run_leaves_its_traceback_in_the_log(tmp_path):
    """As Ray's handler of a SIGTERM in a process that started a Ray of its own: sys.exit(1)."""
    path = tmp_path / "train.log"
    with pytest.raises(SystemExit):
        with run_output() as log:
            log.attach(path)
            raise SystemExit(1)
    assert path.read_text().startswith("Traceback (most recent call last):\n")
    assert path.read_text().endswith("SystemExit: 1\n")
