"""The progress line's fields, as a person reads them (the whole line on a terminal is checked by
tests/entry/test_run_lifecycle.py)."""

import io

from megatrain_ray.runtime.progress import ProgressLine
from megatrain_ray.streaming.step_result import EvalResult, StepResult


def step_result(loss: float) -> StepResult:
    return StepResult(loss=loss, grad_norm=0.5, tokens=64, target_tokens=60, finite=True, seconds=0.1, h2d_bytes=0,
                      d2h_bytes=0, h2d_gbps=0.0, d2h_gbps=0.0, prefetch_wait_s=0.0, compute_s=0.1, weight_copies=0,
                      peak_device_bytes=0, lr=1e-3)


def test_an_earlier_validation_loss_names_its_step():
    line = ProgressLine(6, stream=io.StringIO(), live=False)
    texts = [line.text(step, step_result(5.0 - step / 10), EvalResult(4.6089 * 60, 60, 64, 0.1) if step == 4 else None)
             for step in range(1, 7)]
    assert all("val_loss" not in t for t in texts[:3])
    assert "| val_loss 4.6089 |" in texts[3]  # measured at this step
    assert "| val_loss 4.6089 (step 4) |" in texts[4] and "| val_loss 4.6089 (step 4) |" in texts[5]


def test_a_grpo_step_shows_its_rewards_and_both_rates():
    rl = {"reward_mean": 0.4375, "reward_std": 0.25, "completion_length": 31.6, "clip_fraction": 0.012, "kl": 0.0031,
          "entropy": 2.345, "rollout_tokens_per_s": 1234.5, "train_tokens_per_s": 5678.9}
    text = ProgressLine(6, stream=io.StringIO(), live=False).text(1, step_result(0.1), None, rl)
    assert ("| reward 0.438±0.250 | len 32 | clip 0.012 | kl 0.0031 | entropy 2.35 | rollout 1,234 tok/s | "
            "train 5,679 tok/s | grad_norm") in text
    assert text.count("tok/s") == 2  # the update's rate once, as train


def test_the_time_left_waits_for_steady_steps_and_ignores_a_slow_one(monkeypatch):
    """Steps 1 s apart but for a step that waited 100 s (the host AdamW kernel's build) and a 20 s
    checkpoint: no ETA until three gaps between steps are known, then the median gap times the steps
    left, untouched by the slow ones."""
    from megatrain_ray.runtime import progress

    ends = iter([0.0, 100.0, 101.0, 102.0, 103.0, 123.0, 124.0])  # steps 1..7 end
    line = ProgressLine(100, stream=io.StringIO(), live=False)
    etas = []
    for step in range(1, 8):
        now = next(ends)
        monkeypatch.setattr(progress.time, "monotonic", lambda: now)
        etas.append(line.text(step, step_result(1.0)).rsplit("ETA ", 1)[1])
    left = [progress.clock(1.0 * (100 - step)) for step in range(1, 8)]
    assert etas[:3] == ["?", "?", "?"] and etas[3:] == left[3:], etas


def test_a_grpo_step_shows_each_rollout_copys_sampling_and_their_overlap():
    copy = {"start": 100.0, "end": 108.0, "tokens": 16384, "prefill_seconds": 0.32, "decode_steps": 511, "cpu_seconds": 7.6}
    rl = {"reward_mean": 0.5, "reward_std": 0.1, "completion_length": 512, "clip_fraction": 0.0, "kl": 0.0,
          "entropy": 2.0, "rollout_tokens_per_s": 3900.0, "train_tokens_per_s": 5678.9, "rollout_overlap": 0.75,
          "rollout_copies": [copy, {**copy, "start": 102.0, "end": 110.4}]}
    text = ProgressLine(6, stream=io.StringIO(), live=False).text(1, step_result(0.1), None, rl)
    assert ("| rollout 3,900 tok/s | copies [8.0 s 16,384 tok 15 ms/step cpu 95%, 8.4 s 16,384 tok 16 ms/step cpu 90%] overlap 75% | "
            "train 5,679 tok/s |") in text
    one = ProgressLine(6, stream=io.StringIO(), live=False).text(1, step_result(0.1), None, {**rl, "rollout_copies": [copy]})
    assert "| copies [8.0 s 16,384 tok 15 ms/step cpu 95%] | train" in one  # one copy: no overlap to say
