"""What a person watching a run sees: the start-up's phases as they begin, then one line per step.

On a terminal the step line is redrawn in place (carriage return, the line, then "erase to the
end of the line", so a shorter line leaves nothing of the longer one before it) and cut to the
terminal's width; elsewhere (a file, a pipe, `ray job logs`) every step is a plain line. The line
holds step/total, percent, loss, the last validation loss (with "(step N)" when an earlier step
measured it), grad norm, learning rate, tokens/s over the last steps (one step's own rate jumps
with the host's load), elapsed time and the time left: the median time between the last steps'
ends (the first step, which compiles, left out; so is one that waited for the host AdamW kernel's
build, or a validation or a checkpoint), "?" until STEADY_AFTER of them are known.
"""

from __future__ import annotations

import shutil
import statistics
import sys
import time
from collections import deque
from typing import TextIO

from megatrain_ray.rl.rollout import CopyTiming
from megatrain_ray.streaming.step_result import EvalResult, StepResult

ERASE_TO_END = "\x1b[K"
RATE_WINDOW = 10  # steps that tokens/s and the time left are taken over
STEADY_AFTER = 3  # times between steps' ends before the time left is said


def clock(seconds: float) -> str:
    """1:02:03, 2:03, 0:04."""
    s = int(round(seconds))
    h, m = divmod(s // 60, 60)
    return f"{h}:{m:02d}:{s % 60:02d}" if h else f"{m}:{s % 60:02d}"


class StartupPhases:
    """The start-up's phases as plain lines when each begins, with the seconds since the first."""

    def __init__(self, stream: TextIO | None = None):
        self.stream = stream or sys.stdout
        self.t0 = time.monotonic()

    def __call__(self, text: str) -> None:
        print(f"[{time.monotonic() - self.t0:6.1f} s] {text}", file=self.stream, flush=True)


def rl_parts(m: dict) -> list[str]:
    """A GRPO step's part of the line (rl/step.py, step_metrics)."""
    return [f"reward {m['reward_mean']:.3f}±{m['reward_std']:.3f}", f"len {m['completion_length']:.0f}",
            f"clip {m['clip_fraction']:.3f}", f"kl {m['kl']:.4f}", f"entropy {m['entropy']:.2f}",
            f"rollout {m['rollout_tokens_per_s']:,.0f} tok/s", *copies_part(m),
            f"train {m['train_tokens_per_s']:,.0f} tok/s"]


def copies_part(m: dict) -> list[str]:
    """Each rollout copy's sampling (seconds, tokens, ms a decode step, its loop's CPU share) and,
    with several, the share of the longest one during which they all sampled: copies that overlap
    fully say 100%."""
    copies = [CopyTiming(**c) for c in m.get("rollout_copies") or []]
    each = ", ".join(f"{c.seconds:.1f} s {c.tokens:,} tok {c.ms_per_decode_step:.0f} ms/step cpu {100 * c.cpu_share:.0f}%"
                     for c in copies)
    together = f" overlap {100 * m['rollout_overlap']:.0f}%" if len(copies) > 1 else ""
    return [f"copies [{each}]{together}"] if copies else []


class ProgressLine:
    """The step line; see the module docstring."""

    def __init__(self, total_steps: int, start_step: int = 0, stream: TextIO | None = None, live: bool | None = None):
        self.stream = stream or sys.stdout
        self.live = self.stream.isatty() if live is None else live
        self.total, self.start_step = total_steps, start_step
        self.t0 = time.monotonic()
        self.last_end: float | None = None  # when this session's last step ended
        self.between: deque[float] = deque(maxlen=RATE_WINDOW)  # seconds between the last steps' ends
        self.recent: deque[tuple[int, float]] = deque(maxlen=RATE_WINDOW)  # (tokens, seconds)
        self.last_eval: tuple[int, float] | None = None
        self.drawn = False

    def text(self, step: int, r: StepResult, evaluation: EvalResult | None = None, rl: dict | None = None) -> str:
        now = time.monotonic()
        if self.last_end is not None:
            self.between.append(now - self.last_end)
        self.last_end = now
        self.recent.append((r.tokens, r.seconds))
        if evaluation is not None:
            self.last_eval = (step, evaluation.loss)
        tokens, seconds = map(sum, zip(*self.recent))
        parts = [f"step {step}/{self.total} ({100 * step / self.total:.0f}%)", f"loss {r.loss:.4f}"]
        if self.last_eval is not None:
            at = "" if self.last_eval[0] == step else f" (step {self.last_eval[0]})"
            parts.append(f"val_loss {self.last_eval[1]:.4f}{at}")
        if rl is not None:
            parts += rl_parts(rl)
        parts.append(f"grad_norm {r.grad_norm:.3f}")
        if r.lr is not None:
            parts.append(f"lr {r.lr:.2e}")
        if rl is None:  # a GRPO step tells its rollout's and its updates' rates apart
            parts.append(f"{tokens / seconds if seconds else 0:,.0f} tok/s")
        parts.append(f"elapsed {clock(now - self.t0)}")
        parts.append(f"ETA {self.eta(step)}")
        line = " | ".join(parts)
        if not r.finite:
            line += " (non-finite: update skipped)"
        return line

    def eta(self, step: int) -> str:
        if len(self.between) < STEADY_AFTER:
            return "?"
        return clock(statistics.median(self.between) * (self.total - step))

    def show(self, step: int, r: StepResult, evaluation: EvalResult | None = None, rl: dict | None = None) -> str:
        line = self.text(step, r, evaluation, rl)
        if self.live:
            width = shutil.get_terminal_size((200, 24)).columns - 1
            self.stream.write("\r" + line[:width] + ERASE_TO_END)
            self.drawn = True
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
        return line

    def close(self) -> None:
        """Leave the live line as it is, on a line of its own."""
        if self.live and self.drawn:
            self.stream.write("\n")
            self.stream.flush()
            self.drawn = False
