"""The run's metrics: one JSON line per step in metrics.jsonl, a progress line for people, and the
same numbers to the trackers that are switched on (TensorBoard, W&B: runtime/trackers.py)."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Sequence

from megatrain_ray.streaming.step_result import EvalResult, StepResult
from megatrain_ray.runtime.trackers import Tracker, scalars_of


class MetricsLog:
    """One JSON line per step to metrics.jsonl (the step's result, its learning rate, tokens/s, and
    the validation loss on the steps that validate); a live line on a terminal, plain lines otherwise."""

    def __init__(self, path: Path, total_steps: int, trackers: Sequence[Tracker] = ()):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(path, "a")
        self.total = total_steps
        self.live = sys.stdout.isatty()
        self.trackers = list(trackers)

    def step(self, step: int, r: StepResult, evaluation: EvalResult | None = None) -> dict:
        record = {"step": step, "time": time.time(), **dataclasses.asdict(r),
                  "tokens_per_s": r.tokens / r.seconds if r.seconds else 0.0}
        if evaluation is not None:
            record.update(eval_loss=evaluation.loss, eval_target_tokens=evaluation.target_tokens,
                          eval_seconds=evaluation.seconds)
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        for tracker in self.trackers:
            tracker.log(step, scalars_of(record))
        line = f"step {step}/{self.total} loss {r.loss:.4f}"
        if evaluation is not None:
            line += f" val_loss {evaluation.loss:.4f}"
        line += f" grad_norm {r.grad_norm:.3f}"
        if r.lr is not None:
            line += f" lr {r.lr:.2e}"
        line += f" {record['tokens_per_s']:.0f} tok/s {r.seconds:.2f} s/step h2d {r.h2d_gbps:.1f} GB/s"
        if not r.finite:
            line += " (non-finite: update skipped)"
        print(("\r" + line) if self.live else line, end="" if self.live else "\n", flush=True)
        return record

    def close(self) -> None:
        if self.live:
            print()
        self.file.close()
        for tracker in self.trackers:
            tracker.close()
