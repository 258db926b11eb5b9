"""Stopping a run on SIGINT (Ctrl-C), SIGTERM (`ray job stop`, a spot preemption, `kill`) or SIGHUP
(the terminal, tmux window or ssh session the run was started in closing).

The first signal asks the training loop to stop at the next step boundary: it writes a checkpoint
of that step (unless it has just written one) and raises RunInterrupted, which the CLI turns into
the resume command and exit status 128 + the signal's number (130, 143, 129), without a traceback. A
second signal stops at once: the handler raises a KeyboardInterrupt where the driver is (Ray's
waits turn any other exception from a handler into nothing, and a KeyboardInterrupt into a fresh
one), which `stopping_at_once` names as StoppedAtOnce; the session's actors are still closed on the
way out, so their shared memory is released. While they close (`StopRequest.held`), a signal is
only noted: an interrupted close would leave that memory behind.

Python runs a handler once for all the deliveries of a signal that came before it could run it,
which in the driver's waits on Ray is up to half a second: two presses of Ctrl-C there would be
one. So the handler counts deliveries from the wakeup pipe (`signal.set_wakeup_fd`), where the
interpreter writes a byte for each one as it arrives.

A terminal's signals reach its whole foreground process group: a reader of the run's output (`| tee
log`) dies of the same Ctrl-C, and a closing terminal hangs up every process of the group, the
processes of an embedded Ray among them. So what the handler says goes through a write that a dead
reader cannot make fail (`tell`; runtime/run_log.py keeps the rest of the run's output), SIGPIPE
stays ignored (a write to a pipe without a reader is an error, never the end of the process), and
the embedded Ray's processes start with SIGHUP blocked (`hangup_kept_from_children`), as Ray starts
them with SIGINT blocked: the stores outlive the hang-up and write the checkpoint.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
WAKEUP_BYTE_WAIT_S = 0.05  # a signal's byte, written by the interpreter microseconds after it marks the signal


def tell(text: str) -> None:
    """`text` on stderr, where a write that fails (its reader gone, a closed terminal) is let go."""
    try:
        print(text, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


@contextmanager
def hangup_kept_from_children():
    """Processes started within (an embedded Ray's GCS, raylet and agents, and the workers they start)
    inherit SIGHUP blocked, and never see a hang-up; this thread takes one that comes meanwhile once
    the block ends. Only in the main thread, where the handlers are."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


class RunInterrupted(Exception):
    """The run stopped at a step boundary on a signal; `checkpoint` continues it (None: nothing to continue)."""

    def __init__(self, signum: int, step: int, checkpoint: Path | None):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        where = (f"checkpoint {checkpoint}" if checkpoint is not None
                 else "no checkpoint (it stopped before its first step)")
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}; {where}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class StoppedAtOnce(Exception):
    """A second signal: the run stopped where it was, without a checkpoint of the current step."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"stopped at once by a second {signal.Signals(signum).name}, without a checkpoint "
                         f"of the step under way")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class StopRequest:
    """Holds the first signal received while installed; see the module docstring. Installed only in
    the main thread (Python delivers signals there); elsewhere it never fires and the default
    handlers stay."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.second: int | None = None
        self._holding = False
        self._previous: dict[int, object] = {}
        self._wakeup: tuple[int, int, int] | None = None  # the pipe's read and write ends, the wakeup fd before

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def install(self) -> None:
        """(Again) make this the handler: `ray.init` sets its own SIGTERM handler, so call it after."""
        if threading.current_thread() is not threading.main_thread():
            return
        if self._wakeup is None:
            read, write = os.pipe()
            os.set_blocking(read, False)
            os.set_blocking(write, False)
            self._wakeup = (read, write, signal.set_wakeup_fd(write, warn_on_full_buffer=False))
        for signum in SIGNALS:
            previous = signal.signal(signum, self._handle)
            self._previous.setdefault(signum, previous)
        # as Python starts: a write to a pipe without a reader fails, and does not end the process
        self._previous.setdefault(signal.SIGPIPE, signal.signal(signal.SIGPIPE, signal.SIG_IGN))

    def restore(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()
        if self._wakeup is not None:
            read, write, before = self._wakeup
            signal.set_wakeup_fd(before)
            os.close(read)
            os.close(write)
            self._wakeup = None

    @contextmanager
    def held(self):
        """Within it a second signal is noted, not raised: for the release of the run's actors,
        which is part of stopping at once, and bounded."""
        holding, self._holding = self._holding, True
        try:
            yield
        finally:
            self._holding = holding

    def _deliveries(self, signum: int) -> list[int]:
        """The signals delivered since the handler last ran, in order (see the module docstring). A
        call that finds no byte waits for it briefly: the interpreter marks a signal before it writes
        the byte, so a signal taken on another thread may be handled first; if none comes, an earlier
        call read and counted it (two signals, two calls of the handler, the first of which read both)."""
        if self._wakeup is None:
            return [signum]
        data = self._read_wakeup()
        if not data and select.select([self._wakeup[0]], [], [], WAKEUP_BYTE_WAIT_S)[0]:
            data = self._read_wakeup()
        return [s for s in data if s in SIGNALS]

    def _read_wakeup(self) -> bytes:
        try:
            return os.read(self._wakeup[0], 1024)
        except BlockingIOError:
            return b""

    def _handle(self, signum: int, frame) -> None:
        for delivered in self._deliveries(signum):
            self._press(delivered)

    def _press(self, signum: int) -> None:
        if self.signum is not None:
            self.second = signum
            if self._holding:
                tell(f"\n{signal.Signals(signum).name}: stopping as soon as the run's actors have released their memory")
                return
            raise KeyboardInterrupt
        self.signum = signum
        name = signal.Signals(signum).name
        tell(f"\n{name}: stopping after the step under way, with a checkpoint; {name} again stops at once")

    def __enter__(self) -> "StopRequest":
        self.install()
        return self

    def __exit__(self, kind, value, traceback) -> None:
        self.restore()
        if kind is not None and issubclass(kind, KeyboardInterrupt) and self.second is not None:
            raise StoppedAtOnce(self.second) from None
