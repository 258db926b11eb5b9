"""A run's life through the CLI, as a user meets it: an output directory that holds a run is never
reused unasked (exit 2, the first run untouched; --resume of a finished run writes nothing;
--overwrite starts again), file-system mistakes are one paragraph before Ray starts, and SIGTERM /
SIGINT stop at a step boundary with a checkpoint of that step (exit 143 / 130, no traceback,
nothing left in shared memory) from which the printed resume command continues exactly as the
run that was never stopped (fp32 on the CPU: bit for bit). The run that is never stopped runs on a
pseudo-terminal: its progress line, replayed as a terminal draws it, holds its fields and nothing
of the line it overwrote; the others write to pipes: plain lines.

The runs join the test session's Ray head, so each costs a driver's connection instead of a Ray
start."""

import argparse
import errno
import fcntl
import hashlib
import json
import os
import pty
import re
import select
import struct
import termios
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import ray
import torch

from helpers.files import steps_of
from helpers.runs import command_here, tensors_of, tiny_raw
from megatrain_ray import cli
from megatrain_ray.runtime.signals import StopRequest, StoppedAtOnce
from megatrain_ray.runtime.training import release

BIN = Path(sys.executable).parent
REPO = Path(__file__).parents[2]
STEPS = 8  # validated every 4 steps: two validations, and a step between them that shows the last


@pytest.fixture(scope="module")
def head(ray_head) -> dict[str, str]:
    """The environment of a `megatrain-ray` that joins the test session's Ray head (see conftest's
    joining_env: that head runs without token authentication)."""
    return {**os.environ, "RAY_ADDRESS": ray_head, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(REPO)}


@pytest.fixture
def shm_dir():
    """The run's shared memory in a directory of its own: what is left there is this run's."""
    path = Path(tempfile.mkdtemp(prefix="mr-test-", dir="/dev/shm"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def write_config(directory: Path, out: Path, shm: Path | None = None) -> Path:
    validation = directory / "validation.jsonl"  # token rows: validation beside synthetic training data
    validation.write_text("".join(json.dumps({"input_ids": [(3 * i + j) % 64 for j in range(16)]}) + "\n"
                                  for i in range(4)))
    raw = tiny_raw(out, steps=STEPS, checkpoint={"every": 0, "keep": 5, "export_hf": False},
                   eval={"source": str(validation), "every": 4, "batches": 1},
                   runtime={"num_cpus": 1, "object_store_memory": 100_000_000,
                            **({"shm_dir": str(shm)} if shm else {})})
    path = directory / f"{out.name}.yaml"
    path.write_text(json.dumps(raw))  # JSON is YAML
    return path


def train_here(args: list[str], env: dict, cwd: Path, monkeypatch, capsys) -> subprocess.CompletedProcess:
    """`megatrain-ray train *args` through the command's entry in this process (cli.main), from `cwd`,
    joining the Ray of `env`: a run whose process is not what is checked, without the seconds a Python
    started for it would spend importing torch and Ray. This process leaves Ray again after it."""
    with monkeypatch.context() as patch:
        patch.chdir(cwd)
        for name in ("RAY_ADDRESS", "RAY_AUTH_MODE"):
            patch.setenv(name, env[name])
        return command_here(["train", *args], capsys)


def digests(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


COLUMNS = 150


def run_on_a_terminal(argv: list[str], env: dict, cwd: Path, timeout: float = 300) -> tuple[int, str]:
    """argv with a pseudo-terminal of COLUMNS columns as its stdout and stderr; (exit status, what it wrote).
    The terminal's own size rules: COLUMNS and LINES in the environment (which a test runner may set)
    would override it."""
    env = {k: v for k, v in env.items() if k not in ("COLUMNS", "LINES")}
    pid, fd = pty.fork()
    if pid == 0:  # the child: exec at once
        os.chdir(cwd)
        os.execve(argv[0], argv, env)
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 40, COLUMNS, 0, 0))
    chunks, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not select.select([fd], [], [], 1.0)[0]:
            continue
        try:
            data = os.read(fd, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    else:
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    os.close(fd)
    return os.waitstatus_to_exitcode(status), b"".join(chunks).decode(errors="replace")


def redraws(raw: str) -> list[tuple[str, str]]:
    """Replay carriage returns, newlines and erase-to-end-of-line as a terminal does; for every line
    drawn after a carriage return: (the text written, what the terminal's line then reads)."""
    out, line, cursor, written = [], [], 0, None
    for token in re.split(r"(\r\n|\n|\r|\x1b\[K|\x1b\[[0-9;]*m)", raw):
        if token in ("\r\n", "\n", "\r"):
            if written is not None:
                out.append((written, "".join(line)))
            written = "" if token == "\r" else None
            if token != "\r":
                line = []
            cursor = 0
        elif token == "\x1b[K":
            del line[cursor:]
        elif token and not token.startswith("\x1b"):
            line[cursor:cursor + len(token)] = token
            cursor += len(token)
            if written is not None:
                written += token
    return out


@pytest.fixture(scope="module")
def whole(head, tmp_path_factory) -> tuple[Path, str]:
    """The run that is never stopped, on a terminal: its output directory and what it showed."""
    work = tmp_path_factory.mktemp("whole")
    out = work / "run"
    code, shown = run_on_a_terminal([str(BIN / "megatrain-ray"), "train", str(write_config(work, out))], head, work)
    assert code == 0, shown[-4000:]
    assert steps_of(out) == list(range(1, STEPS + 1))
    return out, shown


def test_the_progress_line_on_a_terminal(whole):
    out, shown = whole
    drawn = [(written, line) for written, line in redraws(shown) if written.startswith("step ")]
    assert len(drawn) == STEPS
    for written, line in drawn:
        assert line == written and len(line) < COLUMNS  # nothing left of a longer line before it
    number, clock_ = r"\d+\.\d{4}", r"\d+:\d\d"
    field = {"val": rf"val_loss {number}( \(step \d+\))?", "rate": r"[\d,]+ tok/s", "elapsed": rf"elapsed {clock_}",
             "eta": rf"ETA ({clock_}|\?)"}
    pattern = (rf"step (\d+)/{STEPS} \((\d+)%\) \| loss {number}( \| {field['val']})? \| grad_norm \d+\.\d{{3}} \| "
               rf"lr \S+ \| {field['rate']} \| {field['elapsed']} \| {field['eta']}")
    for step, (_, line) in enumerate(drawn, start=1):
        match = re.fullmatch(pattern, line)
        assert match, line
        assert int(match[1]) == step and int(match[2]) == round(100 * step / STEPS)
        if step >= 4:  # validated every 4 steps: the last validation loss stays on the line, with its step
            assert "val_loss" in line and (step % 4 == 0) == (f"(step {step - step % 4})" not in line), line
        if step > 3:
            assert "ETA ?" not in line
    # the start-up's phases, each as it began, before the first step
    before = shown[:shown.index("step 1/")]
    for phase in ("joining the Ray cluster", "placing the model", "starting 1 store", "initialising", "executor"):
        assert phase in before, before[-3000:]
    # the data summary at start and in the first row of metrics.jsonl
    assert "training data: synthetic, 64 rows read" in before and "validation data: 1 file(s), 4 rows read" in before
    first = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert first["data"]["train"]["rows_read"] == 64 and first["data"]["validation"]["rows_trainable"] == 4


def test_a_used_output_dir_is_refused_and_left_untouched(whole, tmp_path, capsys):
    """Both answered before Ray: the command's entry in this process (cli.main), which a Python
    started for it would reach only after seconds of imports."""
    whole, _ = whole
    config = write_config(tmp_path, whole)
    before = digests(whole)
    code = cli.main(["train", str(config)])
    out, err = capsys.readouterr()
    assert code == 2, out + err
    assert "--resume" in err and "--overwrite" in err and str(whole) in err
    assert "Traceback" not in err
    # --resume of the finished run says so and writes nothing
    code = cli.main(["train", str(config), "--resume"])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert "is finished" in out and f"step {STEPS} of {STEPS}" in out
    assert digests(whole) == before
    assert not ray.is_initialized()  # neither joined nor started a Ray


def test_file_system_errors_are_one_paragraph_before_ray(head, tmp_path, capsys, monkeypatch):
    """The first with no cluster to join: the error comes before Ray would start. Both through the
    command's entry in this process (cli.main), as above."""
    monkeypatch.setenv("RAY_ADDRESS", "local")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    config = write_config(tmp_path, blocker / "run")
    code = cli.main(["train", str(config)])
    out, err = capsys.readouterr()
    assert code == 2, out + err
    assert err.startswith("megatrain-ray: file-system error:") and "Traceback" not in err
    assert str(blocker / "run") in err and "Not a directory" in err
    assert "Ray" not in out and not ray.is_initialized()  # nothing started
    # A checkpoint that no disk here holds (about 50 TB: fp32 weights and two moments)
    huge = tmp_path / "huge.yaml"
    raw = json.loads(config.read_text())
    raw["train"]["output_dir"] = str(tmp_path / "huge")
    raw["model"]["overrides"] = {"hidden_size": 16384, "intermediate_size": 65536, "num_layers": 1000,
                                 "num_heads": 128, "num_kv_heads": 8}
    huge.write_text(json.dumps(raw))
    for name in ("RAY_ADDRESS", "RAY_AUTH_MODE"):  # the session's head, which reads the host memory
        monkeypatch.setenv(name, head[name])
    try:
        code = cli.main(["train", str(huge)])
    finally:
        ray.shutdown()
    out, err = capsys.readouterr()
    assert code == 2, out + err  # the host memory refuses it after the warning
    warning = next(line for line in err.splitlines() if line.startswith("warning: "))
    assert "one checkpoint of this model needs" in warning and str(tmp_path / "huge" / "checkpoints") in warning
    assert "Traceback" not in err


def wait_for_step(out: Path, proc: subprocess.Popen, step: int, timeout: float = 300) -> None:
    """Until `proc` has written the row of `step` (rows an earlier run left there are older than it)."""
    started, deadline = time.time(), time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        except (FileNotFoundError, ValueError):  # not yet written, or a row half written
            rows = []
        if any(row.get("step", 0) >= step and row["time"] > started for row in rows):
            return
        time.sleep(0.05)
    raise AssertionError(f"the run did not reach step {step}: {proc.poll()=}")


def stopped_by(signum: int, args: list[str], before: int, out: Path, shm_dir: Path, cwd: Path,
               env: dict) -> tuple[list[str], int]:
    """Run `megatrain-ray train *args` (which starts after step `before`), send `signum` once it has
    written a step of its own, check the stop (its exit status, a checkpoint of the step it stopped
    at, nothing left in shared memory, plain lines on a pipe); the arguments of the resume command
    it printed, and that step."""
    proc = subprocess.Popen([str(BIN / "megatrain-ray"), "train", *args], env=env, cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_step(out, proc, before + 1)
    proc.send_signal(signum)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signum, stdout + stderr
    assert "Traceback" not in stdout + stderr
    k = steps_of(out)[-1]
    assert steps_of(out) == list(range(1, k + 1)) and before < k < STEPS
    checkpoint = out / "checkpoints" / f"step-{k:08d}"
    assert checkpoint.is_dir() and f"after step {k}" in stderr
    assert list(shm_dir.iterdir()) == []  # the stores released their segments
    first = before + 1
    assert "\r" not in stdout  # plain lines
    assert re.search(rf"^step {first}/{STEPS} \({round(100 * first / STEPS)}%\) \| loss", stdout, re.M), stdout
    command = next(line for line in stderr.splitlines() if line.startswith("continue with: "))
    argv = shlex.split(command.removeprefix("continue with: "))
    assert argv[:2] == ["megatrain-ray", "train"] and argv[-2:] == ["--resume", str(checkpoint)]
    return argv[2:], k


def killed_on_a_busy_machine(tmp_path: Path, shm_dir: Path, env: dict) -> subprocess.Popen:
    """A run killed with SIGKILL (no handler runs, nothing closes) after its first step, while a CPU
    burner loads the machine: Ray stops its store only some time later, maybe after the next run
    has started. Returns the burner, still burning."""
    burner = subprocess.Popen([sys.executable, "-c", "import os; os.nice(19)\nwhile True: pass"])
    out = tmp_path / "killed"
    proc = subprocess.Popen([str(BIN / "megatrain-ray"), "train", str(write_config(tmp_path, out, shm_dir)),
                             "--set", "train.steps=1000"], env=env, cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for_step(out, proc, 1)
    assert list(shm_dir.iterdir())  # its store's segments
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    return burner


def test_signals_stop_at_a_step_with_its_checkpoint_and_resume_is_exact(head, whole, tmp_path, shm_dir, monkeypatch,
                                                                       capsys):
    """SIGINT stops the run, SIGTERM the run resumed from that stop, and the run resumed from the
    second stop ends with the weights of the run that was never stopped. The first run starts
    with --overwrite in a copy of that run's directory: it starts again (one run's rows, its own
    checkpoints only), the user's own file kept. Before the last, a run on the same shared
    memory is killed with SIGKILL on a busy machine: the last run leaves nothing there. That last run
    is the command's entry in this process: its exit status and what it leaves are checked, not its
    process's."""
    out = tmp_path / "run"
    shutil.copytree(whole[0], out)
    (out / "notes.txt").write_text("the user's own file")
    args = [str(write_config(tmp_path, out, shm_dir)), "--overwrite"]
    stops, step = [], 0
    for signum in (signal.SIGINT, signal.SIGTERM):
        args, step = stopped_by(signum, args, step, out, shm_dir, tmp_path, head)
        args[-1] = os.path.relpath(args[-1], tmp_path)  # --resume PATH relative to where it runs (not the stores')
        stops.append(f"step-{step:08d}")
        assert sorted(p.name for p in (out / "checkpoints").glob("step-*")) == stops  # checkpoint.every=0
    assert (out / "notes.txt").read_text() == "the user's own file"

    burner = killed_on_a_busy_machine(tmp_path, shm_dir, head)
    try:
        # the next run on that machine: it sweeps what the killed one left
        done = train_here(args, head, tmp_path, monkeypatch, capsys)
    finally:
        burner.kill()
        burner.wait()
    assert done.returncode == 0, done.stdout + done.stderr
    assert steps_of(out) == list(range(1, STEPS + 1))
    final = out / "checkpoints" / f"step-{STEPS:08d}"
    a, b = tensors_of(final), tensors_of(whole[0] / "checkpoints" / f"step-{STEPS:08d}")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert list(shm_dir.iterdir()) == []


def test_a_second_signal_stops_at_once(head, tmp_path, shm_dir):
    """A SIGTERM and a Ctrl-C at once (`kill`, then a press of Ctrl-C): the second stops the run where it
    is, without a checkpoint of the step under way, and its exit status is the second signal's. Two
    different signals, because two of the same sent this close may reach the process as one (the
    kernel merges a signal still pending); the in-process test below covers two of the same that
    Python handles in one run of its handler."""
    out = tmp_path / "run"
    config = write_config(tmp_path, out, shm_dir)
    proc = subprocess.Popen([str(BIN / "megatrain-ray"), "train", str(config), "--set", "train.steps=1000"],
                            env=head, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    wait_for_step(out, proc, 1)
    proc.send_signal(signal.SIGTERM)
    # The Ctrl-C once the SIGTERM is handled: sent while that one is still pending, the kernel hands
    # the two over lowest number first, SIGINT before SIGTERM (seen once in a loaded suite run).
    deadline = time.monotonic() + 60
    while not any("SIGTERM: stopping after the step under way" in line for line in lines):
        assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    stdout = proc.stdout.read()
    proc.wait(timeout=300)
    reader.join(timeout=60)
    stderr = "".join(lines)
    assert proc.returncode == 130, stdout + stderr
    assert "stopped at once by a second SIGINT" in stderr and "Traceback" not in stdout + stderr
    assert not list((out / "checkpoints").glob("step-*"))  # the step under way was not finished
    assert list(shm_dir.iterdir()) == []


def piped_on_a_terminal(args: list[str], env: dict, cwd: Path, out: Path, stop) -> str:
    """`megatrain-ray train *args 2>&1 | tee` as a shell on a terminal runs it: a pseudo-terminal of
    its own whose session's leader is the shell, the pipeline its foreground process group. The
    shell survives Ctrl-C as an interactive one does (a trap, which its children do not inherit);
    the pipeline's group records the run's exit status. `stop(terminal)` once the run has written a
    step of its own: Ctrl-C typed into the terminal, or the terminal closed. Returns the exit status
    the group recorded ("" if none)."""
    status = cwd / f"{out.name}.status"
    command = (f"trap : INT; {{ trap : INT HUP; {shlex.join([str(BIN / 'megatrain-ray'), 'train', *args])}; "
               f"echo $? > {shlex.quote(str(status))}; }} 2>&1 | tee {shlex.quote(str(cwd / f'{out.name}.tee'))}")
    pid, terminal = pty.fork()
    if pid == 0:
        os.chdir(cwd)
        os.execve("/bin/bash", ["bash", "-c", command], env)
    drained = threading.Event()

    def drain():  # what the terminal shows, read so that a full terminal never blocks the run
        while not drained.is_set():
            try:
                if select.select([terminal], [], [], 0.2)[0] and not os.read(terminal, 65536):
                    return
            except OSError:  # EIO: the run's side closed it, or EBADF: this side did
                return

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 300
        while not (out / "metrics.jsonl").is_file() or not (out / "metrics.jsonl").read_text().strip():
            assert time.monotonic() < deadline, "the run wrote no step"
            time.sleep(0.1)
        stop(terminal)
        deadline = time.monotonic() + 300
        while not status.is_file() or not status.read_text().strip():
            assert time.monotonic() < deadline, (out / "train.log").read_text()[-3000:]
            time.sleep(0.2)
    finally:
        drained.set()
        reader.join(timeout=5)
        try:
            os.close(terminal)
        except OSError:
            pass
        os.waitpid(pid, 0)
    return status.read_text().strip()


def hang_up(terminal: int) -> None:
    """The terminal closes (a tmux window, an ssh session): the shell, its session's leader, is hung
    up and ends, and the kernel hangs up the foreground process group: the run, its reader and the
    processes of an embedded Ray."""
    os.close(terminal)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGHUP], ids=["SIGINT", "SIGHUP"])
def test_a_run_piped_on_a_terminal_keeps_its_steps_when_the_terminal_stops_it(head, tmp_path, shm_dir, signum):
    """Ctrl-C reaches the reader of `| tee` too, which dies first, and the run's next writes meet a
    broken pipe; a closed terminal hangs up the run, its reader and an embedded Ray's processes
    (this run starts its own Ray: a joined cluster's processes are not the terminal's). Either way
    the run saves its last finished step, exits 128 + the signal, and says so in metrics.jsonl and in
    its train.log, which holds plain lines."""
    out = tmp_path / "run"
    args = [str(write_config(tmp_path, out, shm_dir)), "--set", "train.steps=1000"]
    env = head
    ray_tmp = Path(tempfile.mkdtemp(prefix="r", dir="/tmp"))  # short: Ray's socket paths live under it
    if signum == signal.SIGHUP:
        args += ["--set", "runtime.address=local"]
        env = {**{k: v for k, v in head.items() if k != "RAY_ADDRESS"}, "RAY_TMPDIR": str(ray_tmp)}
    ctrl_c = lambda terminal: os.write(terminal, b"\x03")
    try:
        status = piped_on_a_terminal(args, env, tmp_path, out, ctrl_c if signum == signal.SIGINT else hang_up)
        # the embedded Ray's session directory went with it (its temp dir here: others' runs are elsewhere)
        assert not list(ray_tmp.glob("ray/session_2*")), list(ray_tmp.glob("ray/*"))
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert status == str(128 + signum), (out / "train.log").read_text()[-3000:]
    teed = (tmp_path / f"{out.name}.tee").read_text()  # what tee wrote to its file before it died
    assert "(GpuWorker pid=" in teed and "\x1b" not in teed, teed[-3000:]  # a worker's line, without colour
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    k = rows[-2]["step"]
    checkpoint = out / "checkpoints" / f"step-{k:08d}"
    assert rows[-1] == {"stopped": signal.Signals(signum).name, "after_step": k, "checkpoint": str(checkpoint),
                        "time": rows[-1]["time"]}
    assert checkpoint.is_dir() and [r["step"] for r in rows[:-1]] == list(range(1, k + 1))
    log = (out / "train.log").read_text()
    assert f"stopped by {signal.Signals(signum).name} after step {k}; checkpoint {checkpoint}" in log
    assert f"continue with: " in log and "Traceback" not in log
    assert re.search(rf"^step {k}/1000 \(\d+%\) \| loss", log, re.M), log[-3000:]
    assert "\x1b" not in log and "\r" not in log
    assert list(shm_dir.iterdir()) == []


def test_a_signal_while_the_program_exits_ends_it_at_once_without_a_traceback():
    """After the command, Python's exit runs the atexit callbacks (Ray's shutdown of an embedded
    cluster takes seconds there): a Ctrl-C then ends the process, with no KeyboardInterrupt traceback."""
    code = ("import atexit, os, signal, sys, time\n"
            "from megatrain_ray import cli\n"
            "def slow_shutdown():  # interrupted, as a Ctrl-C interrupts Ray's\n"
            "    os.kill(os.getpid(), signal.SIGINT)\n"
            "    time.sleep(30)\n"
            "atexit.register(slow_shutdown)\n"
            "sys.argv = ['megatrain-ray', '--version']\n"
            "sys.exit(cli.main())\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 130, done.stdout + done.stderr
    assert done.stdout.startswith("megatrain-ray ") and "Traceback" not in done.stderr, done.stdout + done.stderr
    assert done.stderr.strip() == "megatrain-ray: SIGINT: exiting at once", done.stderr


def test_two_signals_before_the_handler_runs_are_two_presses():
    """In process: both SIGTERMs arrive while the main thread sits in one C call (it blocks the
    signal; a thread beside it takes each delivery), so Python runs the handler once, after the
    call, for both; as the driver's handler may run once for two presses during a wait on Ray."""
    import ctypes

    if threading.current_thread() is not threading.main_thread():  # the handler would not be installed
        pytest.skip("signal handlers are installed in the main thread only")
    start = threading.Event()

    def press_twice():
        start.wait()
        time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    presser = threading.Thread(target=press_twice)  # made before the mask below: it takes the signals
    presser.start()
    with pytest.raises(StoppedAtOnce):
        with StopRequest() as stop:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
            try:
                start.set()
                ctypes.CDLL(None).usleep(1_000_000)  # no Python code runs here, so no handler
            finally:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
            presser.join()
            for _ in range(10):  # the handler runs here, once
                time.sleep(0.01)
            raise AssertionError(f"not stopped at once: {stop.signum=}, {stop.second=}")
    assert stop.signum == stop.second == signal.SIGTERM


class SignalledWhileClosing:
    """Stands in for a session whose actors take a while to close: a second SIGTERM comes meanwhile."""

    closed = False

    def close(self) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)  # the handler runs in here
        self.closed = True


def test_a_second_signal_while_the_actors_close_waits_for_them():
    """In process: the release of the actors (a stopping run's last act) is not cut short by a
    second signal, which a run stopped at once would raise elsewhere."""
    if threading.current_thread() is not threading.main_thread():  # the handler would not be installed
        pytest.skip("signal handlers are installed in the main thread only")
    before = signal.getsignal(signal.SIGTERM)
    session = SignalledWhileClosing()
    with pytest.raises(StoppedAtOnce):
        with StopRequest() as stop:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)
            assert stop.requested and stop.second is None
            release(session, stop)
            held = stop.second
            os.kill(os.getpid(), signal.SIGTERM)  # not held: stops at once
            time.sleep(5)
    assert session.closed and held == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before


def test_the_version_and_a_full_disk_in_one_paragraph(capsys):
    from importlib.metadata import version

    from megatrain_ray import cli
    from megatrain_ray.runtime.output_dir import describe_os_error

    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"megatrain-ray {version('megatrain-ray')}"
    text = describe_os_error(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/data/run/metrics.jsonl"))
    assert "No space left on device (ENOSPC) at /data/run/metrics.jsonl" in text and "checkpoint.keep" in text
    assert "\n" not in text


@pytest.mark.parametrize("argv", [["--version"], ["bench", "--help"]], ids=["version", "bench-help"])
def test_the_version_and_help_answer_without_importing_torch_or_ray(argv):
    """`megatrain-ray --version` or `bench --help` in a fresh interpreter: no torch, no Ray (seconds of imports)."""
    code = (f"import sys\nfrom megatrain_ray import cli\ntry:\n    cli.main({argv!r})\nexcept SystemExit as e:\n"
            "    assert e.code == 0\nprint(sorted({'torch', 'ray'} & set(sys.modules)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[]", done.stdout


@pytest.mark.parametrize("command", ["train", "plan", "export", "config"])
def test_every_command_and_argument_has_a_description(command, capsys):
    """`megatrain-ray COMMAND --help` opens with what the command does and says what each of its
    arguments is."""
    parser = cli.build_parser([command])
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert commands[command].description, command
    for action in commands[command]._actions:
        assert action.help, f"{command}: {action.dest} has no description"
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    assert commands[command].description.split()[0] in capsys.readouterr().out
