"""The run's own log file, and a stdout and stderr that a gone reader cannot make fail.

While a run's output is taken (`run_output`), everything it prints to stdout and stderr also goes
to `train.log` in its output directory (appended to on a resume; what was printed before the
directory was known is written first): plain lines, without colour codes or a terminal's redraws
(a carriage return starts a new line there). A write to the stream itself that fails (the reader of
`| tee log` dead of the same Ctrl-C, a broken pipe, a closed terminal) drops that stream for the rest
of the run, which goes on into the log file: the stop it is making still saves its checkpoint. The
stream's descriptor then points at /dev/null, so that what writes to it past Python's streams (Ray's
logger, the interpreter's last flush) cannot fail either. The file is line-buffered, so that a hard
exit (Ray's, on a lost connection) keeps what was said before it, and an error that escapes the
command leaves its traceback there as well as on stderr.

Nesting is free: the CLI takes the output for the whole command (its last words, the resume command,
go into the log too), and `run_training` within it finds it taken and attaches the file.
"""

from __future__ import annotations

import io
import os
import re
import sys
import threading
import traceback
from contextlib import contextmanager
from pathlib import Path

LOG_NAME = "train.log"
ESCAPE_CODE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")  # colours, erase-to-end-of-line
LINE_BREAKS = re.compile(r"(\r\n|\r|\n)")


def plain(text: str) -> str:
    """`text` without terminal escape codes."""
    return ESCAPE_CODE.sub("", text)


class RunLog:
    """The log file's side: holds what comes before `attach`, then appends to the file."""

    def __init__(self) -> None:
        self.lock = threading.RLock()  # a signal's handler may print while the main thread does
        self.held: list[str] | None = []
        self.file: io.TextIOBase | None = None
        self.path: Path | None = None
        self.at_line_start = True

    def attach(self, path: Path) -> None:
        with self.lock:
            if self.file is not None:
                return
            # line-buffered: what was said before a hard exit (a lost Ray connection's) is in the file
            self.file, self.path = open(path, "a", buffering=1), path
            held, self.held = self.held or [], None
            for text in held:
                self.file.write(text)
            self.file.flush()

    def write(self, text: str) -> None:
        with self.lock:
            lines = self._lines(plain(text))
            if self.file is not None:
                try:
                    self.file.write(lines)
                except (OSError, ValueError):  # a full disk: metrics.jsonl and the checkpoints say it first
                    pass
            elif self.held is not None:
                self.held.append(lines)

    def _lines(self, text: str) -> str:
        """A carriage return (a live line redrawn) as a line break where the line holds text."""
        out = []
        for piece in LINE_BREAKS.split(text):
            if piece == "\r":
                if not self.at_line_start:
                    out.append("\n")
                    self.at_line_start = True
            elif piece in ("\n", "\r\n"):
                out.append("\n")
                self.at_line_start = True
            elif piece:
                out.append(piece)
                self.at_line_start = False
        return "".join(out)

    def flush(self) -> None:
        with self.lock:
            if self.file is not None:
                try:
                    self.file.flush()
                except (OSError, ValueError):
                    pass

    def close(self) -> None:
        with self.lock:
            if self.file is not None:
                if not self.at_line_start:
                    self.write("\n")
                self.flush()
                self.file.close()
                self.file = None
            self.held = None


class LoggedStream(io.TextIOBase):
    """stdout or stderr as the run writes it: to the stream while it takes writes, and to the log."""

    def __init__(self, stream, log: RunLog):
        self.stream, self.log = stream, log

    def write(self, text: str) -> int:
        self.log.write(text)
        if self.stream is not None:
            try:
                self.stream.write(text)
            except (OSError, ValueError):
                self._drop()
        return len(text)

    def flush(self) -> None:
        self.log.flush()
        if self.stream is not None:
            try:
                self.stream.flush()
            except (OSError, ValueError):
                self._drop()

    def _drop(self) -> None:
        """The reader is gone: its descriptor to /dev/null, and no more writes to it."""
        stream, self.stream = self.stream, None
        try:
            fd = stream.fileno()
        except (OSError, ValueError):  # not a file (a test's capture)
            return
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, fd)
        finally:
            os.close(null)

    def isatty(self) -> bool:
        try:
            return self.stream is not None and self.stream.isatty()
        except (OSError, ValueError):
            return False

    def fileno(self) -> int:
        if self.stream is None:
            raise io.UnsupportedOperation("the stream's reader is gone")
        return self.stream.fileno()

    def writable(self) -> bool:
        return True

    @property
    def encoding(self) -> str:
        return getattr(self.stream, "encoding", None) or "utf-8"


@contextmanager
def run_output():
    """stdout and stderr into the run's log (see the module docstring); yields the RunLog to
    `attach` the file to. Within a taken output it yields that one's log and changes nothing."""
    if isinstance(sys.stdout, LoggedStream):
        yield sys.stdout.log
        return
    log = RunLog()
    out, err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = LoggedStream(out, log), LoggedStream(err, log)
    try:
        yield log
    except BaseException as e:  # its traceback goes where the user looks afterwards, the log too
        if not isinstance(e, SystemExit) or e.code not in (0, None):  # a library's exit (Ray's on a SIGTERM) too
            log.write("".join(traceback.format_exception(e)))
        raise
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        sys.stdout, sys.stderr = out, err
        log.close()
