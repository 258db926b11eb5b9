"""The run's metrics: one JSON line per step in metrics.jsonl, a progress line for people
(runtime/progress.py), and the same numbers to the trackers that are switched on (TensorBoard,
W&B: runtime/trackers.py)."""

from __future__ import annotations

import dataclasses
import json
import signal
import time
from pathlib import Path
from typing import Sequence

from megatrain_ray.streaming.step_result import EvalResult, StepResult
from megatrain_ray.runtime.output_dir import trim_metrics
from megatrain_ray.runtime.progress import ProgressLine
from megatrain_ray.runtime.trackers import Tracker, scalars_of


class MetricsLog:
    """One JSON line per step to metrics.jsonl (the step's result, its learning rate, tokens/s, the
    validation loss on the steps that validate, and the bad rows skipped so far, by reason, once any
    are), and one where a signal stopped the run; a live line on a terminal, plain lines otherwise."""

    def __init__(self, path: Path, total_steps: int, trackers: Sequence[Tracker] = (), start_step: int = 0,
                 data_summary: dict | None = None):
        path.parent.mkdir(parents=True, exist_ok=True)
        trim_metrics(path, start_step)  # rows of steps this run is about to train again
        self.path = path
        self.file = open(path, "a")
        self.progress = ProgressLine(total_steps, start_step)
        self.trackers = list(trackers)
        self.data_summary = data_summary  # into this log's first row (data/summary.py)
        self.rewards: list[dict[str, float]] = []  # a GRPO step's mean rewards, the total's as "reward"

    def step(self, step: int, r: StepResult, evaluation: EvalResult | None = None,
             bad_rows: dict[str, int] | None = None, extra: dict | None = None) -> dict:
        """`bad_rows`: the bad rows skipped so far by reason (data/bad_rows.py), in the row when any;
        `extra`: what the step's kind adds (a GRPO step's rewards and rates: rl/step.py)."""
        record = {"step": step, "time": time.time(), **dataclasses.asdict(r),
                  "tokens_per_s": r.tokens / r.seconds if r.seconds else 0.0}
        if bad_rows:
            record["bad_rows"] = dict(bad_rows)
        if self.data_summary is not None:
            record["data"], self.data_summary = self.data_summary, None
        if extra:
            record.update(extra)
            if "reward_mean" in extra:
                self.rewards.append({"reward": extra["reward_mean"], **extra.get("rewards", {})})
        if evaluation is not None:
            record.update(eval_loss=evaluation.loss, eval_target_tokens=evaluation.target_tokens,
                          eval_seconds=evaluation.seconds)
        try:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        except OSError as e:  # a full disk: name the file (CLI: a file-system error, exit 2)
            e.filename = e.filename or str(self.path)
            raise
        for tracker in self.trackers:
            tracker.log(step, scalars_of(record))
        self.progress.show(step, r, evaluation, extra)
        return record

    def reward_trend(self) -> dict | None:
        """A GRPO run's rewards from its first steps to its last: each reward's mean over the first
        `steps` steps this session trained and over the last `steps`, the total's as "reward" (a
        tenth of the steps, 1 to 10: one step's mean over a few groups is noisy); None without."""
        if not self.rewards:
            return None
        steps = max(1, min(10, len(self.rewards) // 10))
        mean = lambda rows, name: sum(r[name] for r in rows) / len(rows)
        return {"steps": steps, **{name: [mean(self.rewards[:steps], name), mean(self.rewards[-steps:], name)]
                                   for name in self.rewards[0]}}

    def stopped(self, signum: int, step: int, checkpoint: Path | None) -> None:
        """The row of a run stopped by a signal after `step` (runtime/signals.py): no "step" key, it
        is no step's."""
        self.progress.close()
        record = {"stopped": signal.Signals(signum).name, "after_step": step, "time": time.time(),
                  "checkpoint": None if checkpoint is None else str(checkpoint)}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.progress.close()
        self.file.close()
        for tracker in self.trackers:
            tracker.close()
