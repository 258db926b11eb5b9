"""One GRPO step: sample each prompt's completions from the current policy, reward them, make the
group-normalised advantages and the step's micro-batches, add the reference's and (with several
updates per rollout) the old policy's log-probabilities, then update the policy through the
streamed layer-major step, whose head computes the policy loss (streaming/executor.py).

The policy is whatever trains: the run's Session (runtime/session.py) or the in-process trainer
(runtime/local.py); both give the methods of `Policy`. The rollout is a `Rollout` in this process
or, in a run, the rollout's actors (runtime/grpo_steps.py, RemoteRollout), which also drives these
steps for the training loop (GrpoSteps): the prompts in order, the data position a checkpoint keeps.
A step's position in the data is the prompts taken so far and the sampler's generator, so a resumed
run samples what the uninterrupted one would have."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Iterable, Protocol

import numpy as np
import torch

from megatrain_ray.config import GrpoConfig
from megatrain_ray.rl.batch import placed_logprobs, policy_micro_batches, with_logprobs
from megatrain_ray.rl.loss import group_advantages
from megatrain_ray.rl.prompts import Prompt, Tokens
from megatrain_ray.rl.rewards import RewardBatch, Rewards
from megatrain_ray.rl.rollout import CopyTiming, Rollout, Sampling, overlap


class Policy(Protocol):
    def rollout_weights(self) -> Iterable[tuple[int, torch.Tensor]]:
        """(layer, flat weights) for every layer, once every update so far has landed."""

    def token_logprobs(self, micro_batches: list[dict]) -> list[np.ndarray]:
        """Each label's log-probability under the current weights, through the streamed forward."""

    def reference_logprobs(self, micro_batches: list[dict]) -> list[np.ndarray]:
        """The same under the reference policy's weights (model.path), streamed from host memory."""

    def train_step(self, micro_batches: list[dict]) -> Any:
        """One optimizer update on the micro-batches (a StepResult)."""


@dataclass(frozen=True)
class Sampled:
    """A step's completions as the rollout sampled them, with the sampling policy's per-token
    log-probabilities where they are the old policy's (a rollout one version behind)."""

    prompts: list[Prompt]
    completions: list[np.ndarray]
    logprobs: list[np.ndarray] | None
    copies: list[CopyTiming]  # each rollout copy's sampling of its share
    refresh_seconds: float  # the weights' load before it

    @property
    def seconds(self) -> float:
        """The sampling's: its slowest copy's."""
        return max(c.seconds for c in self.copies)

    def to_dict(self) -> dict:
        """The completions of a step to come, for its checkpoint (the prompts are the data position's)."""
        return {"completions": [c.tolist() for c in self.completions],
                "logprobs": [[float(x) for x in lp] for lp in self.logprobs or []],
                "copies": [c.to_dict() for c in self.copies], "refresh_seconds": self.refresh_seconds}

    @classmethod
    def from_dict(cls, prompts: list[Prompt], d: dict) -> "Sampled":
        copies = [CopyTiming(**c) for c in d["copies"]] if "copies" in d else \
            [CopyTiming(0.0, d["seconds"], sum(map(len, d["completions"])), 0.0, 0, 0.0)]  # a checkpoint before the copies' timing
        return cls(prompts, [np.asarray(c, dtype=np.int64) for c in d["completions"]],
                   [np.asarray(lp, dtype=np.float32) for lp in d["logprobs"]] or None, copies, d["refresh_seconds"])


@dataclass
class GrpoStep:
    settings: GrpoConfig
    rows_per_micro_batch: int
    rollout: Rollout  # or what gives its methods (RemoteRollout: the rollout's actor)
    rewards: Rewards
    tokens: Tokens

    def sampling(self) -> Sampling:
        g = self.settings
        return Sampling(g.max_new_tokens, g.temperature, g.top_p, self.tokens.eos_id)

    def __call__(self, policy: Policy, prompts: list[Prompt]) -> tuple[list, dict[str, Any]]:
        """The step's updates' results and its metrics, on completions the current policy samples."""
        t0 = time.perf_counter()
        return self.update(policy, self.sample(policy, prompts), t0)

    def ahead(self, policy: Policy, pending: Sampled | None, prompts: list[Prompt] | None,
              next_prompts: list[Prompt]) -> tuple[list, dict[str, Any], Sampled]:
        """A step whose rollout runs one policy version behind (grpo.rollout_gpu=own): it trains on
        `pending` (the first step: `prompts`, sampled now) while the rollout, loaded with the
        weights before this step's update, samples `next_prompts`; the rollout's log-probabilities
        are the old policy's. Returns the updates' results, the metrics and the next step's
        completions."""
        t0 = time.perf_counter()
        current = pending or self.sample(policy, prompts, scored=True)
        t1 = time.perf_counter()
        self.rollout.refresh(policy)
        refresh_s = time.perf_counter() - t1
        finish = self.rollout.start_sampling([p.ids for p in next_prompts], self.settings.group_size, self.sampling())
        results, metrics = self.update(policy, current, t0)
        completions, logprobs, copies = finish()
        return results, {**metrics, "step_seconds": time.perf_counter() - t0}, \
            Sampled(next_prompts, completions, logprobs, copies, refresh_s)

    def sample(self, policy: Policy, prompts: list[Prompt], scored: bool = False) -> Sampled:
        """Completions of the prompts from the current policy (with their log-probabilities: `scored`)."""
        t0 = time.perf_counter()
        self.rollout.refresh(policy)
        refresh_s = time.perf_counter() - t0
        ids, g = [p.ids for p in prompts], self.settings
        return Sampled(prompts, *self.rollout.sample_scored(ids, g.group_size, self.sampling(), scored), refresh_s)

    def update(self, policy: Policy, sampled: Sampled, t0: float) -> tuple[list, dict[str, Any]]:
        """Rewards, advantages and the updates on `sampled`; the metrics (the step's seconds from `t0`)."""
        g, completions = self.settings, sampled.completions
        rows = [p for p in sampled.prompts for _ in range(g.group_size)]
        totals, each = self.rewards(reward_batch(rows, completions, self.tokens))
        advantages = group_advantages(torch.tensor(totals), g.group_size, g.scale_rewards).tolist()
        mbs = policy_micro_batches([p.ids for p in rows], completions, advantages, g.loss_normalizer,
                                   g.max_new_tokens, self.rows_per_micro_batch)
        if g.kl_coef:
            mbs = with_logprobs(mbs, "ref_logprobs", policy.reference_logprobs(mbs))
        if sampled.logprobs is not None:
            old = placed_logprobs(mbs, [p.ids for p in rows], sampled.logprobs, self.rows_per_micro_batch)
            mbs = with_logprobs(mbs, "old_logprobs", old)
        elif g.updates_per_rollout > 1:
            mbs = with_logprobs(mbs, "old_logprobs", policy.token_logprobs(mbs))
        results = [policy.train_step(mbs) for _ in range(g.updates_per_rollout)]
        metrics = step_metrics(totals, each, completions, results, sampled.copies, time.perf_counter() - t0)
        return results, {**metrics, "refresh_seconds": sampled.refresh_seconds}


def reward_batch(rows: list[Prompt], completions: list[np.ndarray], tokens: Tokens) -> RewardBatch:
    columns = sorted({k for p in rows for k in p.columns})
    return RewardBatch([p.text for p in rows], [tokens.completion_text(c.tolist()) for c in completions],
                       [c.tolist() for c in completions], {k: [p.columns.get(k) for p in rows] for k in columns})


def step_metrics(totals: list[float], each: dict[str, list[float]], completions: list[np.ndarray], results: list,
                 copies: list[CopyTiming], step_s: float) -> dict[str, Any]:
    """What metrics.jsonl and the progress line say of a GRPO step: rewards (the total's mean and
    std, each reward's mean), completion lengths, the updates' clip fraction, KL and entropy per
    completion token, and the rollout's and the training's tokens per second (besides the seconds
    of the rollout (its slowest copy's), the updates, the whole step and, from the caller, the
    weights' refresh); each rollout copy's seconds, tokens, prompts' forward and decode steps, and
    how much of the longest copy's time they all sampled together (`overlap`)."""
    rollout_s = max(c.seconds for c in copies)
    rewards, lengths = np.asarray(totals, dtype=np.float64), np.asarray([len(c) for c in completions])
    sums = {k: sum(r.policy[k] for r in results) for k in results[0].policy}
    tokens = max(1.0, sums["policy_tokens"])
    train_s = sum(r.seconds for r in results)
    return {
        "reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()),
        "rewards": {name: float(np.mean(v)) for name, v in each.items()},
        "completion_length": float(lengths.mean()), "completion_length_max": int(lengths.max()),
        "clip_fraction": sums["clipped_tokens"] / tokens, "kl": sums["kl_sum"] / tokens,
        "entropy": sums["entropy_sum"] / tokens,
        "rollout_tokens_per_s": float(lengths.sum()) / rollout_s if rollout_s else 0.0,
        "train_tokens_per_s": sum(r.tokens for r in results) / train_s if train_s else 0.0,
        "rollout_seconds": rollout_s, "train_seconds": train_s, "step_seconds": step_s,
        "updates": len(results),
        "rollout_copies": [c.to_dict() for c in copies], "rollout_overlap": overlap(copies),
    }
