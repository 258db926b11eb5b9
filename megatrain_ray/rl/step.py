"""One GRPO step: sample each prompt's completions from the current policy, reward them, make the
group-normalised advantages and the step's micro-batches, add the reference's and (with several
updates per rollout) the old policy's log-probabilities, then update the policy through the
streamed layer-major step, whose head computes the policy loss (streaming/executor.py).

The policy is whatever trains: the run's Session (runtime/session.py) or the in-process trainer
(runtime/local.py); both give the three methods of `Policy`."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Iterable, Protocol

import numpy as np
import torch

from megatrain_ray.config import GrpoConfig
from megatrain_ray.rl.batch import policy_micro_batches, with_logprobs
from megatrain_ray.rl.loss import group_advantages
from megatrain_ray.rl.prompts import Prompt, Tokens
from megatrain_ray.rl.rewards import RewardBatch, Rewards
from megatrain_ray.rl.rollout import Rollout, Sampling


class Policy(Protocol):
    def rollout_weights(self) -> Iterable[tuple[int, torch.Tensor]]:
        """(layer, flat weights) for every layer, once every update so far has landed."""

    def token_logprobs(self, micro_batches: list[dict]) -> list[np.ndarray]:
        """Each label's log-probability under the current weights, through the streamed forward."""

    def reference_logprobs(self, micro_batches: list[dict]) -> list[np.ndarray]:
        """The same under the reference policy's weights (model.path), streamed from host memory."""

    def train_step(self, micro_batches: list[dict]) -> Any:
        """One optimizer update on the micro-batches (a StepResult)."""


@dataclass
class GrpoStep:
    settings: GrpoConfig
    rows_per_micro_batch: int
    rollout: Rollout  # or what gives its methods (runtime/grpo.py: the rollout's actor)
    rewards: Rewards
    tokens: Tokens

    def sampling(self) -> Sampling:
        g = self.settings
        return Sampling(g.max_new_tokens, g.temperature, g.top_p, self.tokens.eos_id)

    def __call__(self, policy: Policy, prompts: list[Prompt]) -> tuple[list, dict[str, Any]]:
        """The step's updates' results and its metrics."""
        g, t0 = self.settings, time.perf_counter()
        self.rollout.refresh(policy)
        refresh_s = time.perf_counter() - t0
        completions, rollout_s = self.rollout.sample([p.ids for p in prompts], g.group_size, self.sampling())
        rows = [p for p in prompts for _ in range(g.group_size)]
        totals, each = self.rewards(reward_batch(rows, completions, self.tokens))
        advantages = group_advantages(torch.tensor(totals), g.group_size, g.scale_rewards).tolist()
        mbs = policy_micro_batches([p.ids for p in rows], completions, advantages, g.loss_normalizer,
                                   g.max_new_tokens, self.rows_per_micro_batch)
        if g.kl_coef:
            mbs = with_logprobs(mbs, "ref_logprobs", policy.reference_logprobs(mbs))
        if g.updates_per_rollout > 1:
            mbs = with_logprobs(mbs, "old_logprobs", policy.token_logprobs(mbs))
        results = [policy.train_step(mbs) for _ in range(g.updates_per_rollout)]
        metrics = step_metrics(totals, each, completions, results, rollout_s, time.perf_counter() - t0)
        return results, {**metrics, "refresh_seconds": refresh_s}


def reward_batch(rows: list[Prompt], completions: list[np.ndarray], tokens: Tokens) -> RewardBatch:
    columns = sorted({k for p in rows for k in p.columns})
    return RewardBatch([p.text for p in rows], [tokens.completion_text(c.tolist()) for c in completions],
                       [c.tolist() for c in completions], {k: [p.columns.get(k) for p in rows] for k in columns})


def step_metrics(totals: list[float], each: dict[str, list[float]], completions: list[np.ndarray], results: list,
                 rollout_s: float, step_s: float) -> dict[str, Any]:
    """What metrics.jsonl and the progress line say of a GRPO step: rewards (the total's mean and
    std, each reward's mean), completion lengths, the updates' clip fraction, KL and entropy per
    completion token, and the rollout's and the training's tokens per second (besides the seconds
    of the rollout, the updates, the whole step and, from the caller, the weights' refresh)."""
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
    }
