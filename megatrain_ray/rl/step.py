"""One GRPO step: sample each prompt's completions from the current policy, reward them, make the
group-normalised advantages and the step's micro-batches, add the reference's and (with several
updates per rollout) the old policy's log-probabilities, then update the policy through the
streamed layer-major step, whose head computes the policy loss (streaming/executor.py).

The policy is whatever trains: the run's Session (runtime/session.py) or the in-process trainer
(runtime/local.py); both give the three methods of `Policy`.

A run's training loop (runtime/training.py) takes `GrpoSteps` where it took a batch of tokens
(objective.py, Grpo.steps): the rollout's actor (runtime/actors.py, RolloutActor) on the GPU node,
reached through the session, samples; the rewards are computed on the driver; the updates run on
the run's GPU workers and stores like any step. A step's position in the data is the prompts taken
so far and the sampler's generator, so a resumed run samples what the uninterrupted one would have."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Iterable, Protocol

import numpy as np
import torch

from megatrain_ray.config import Config, GrpoConfig
from megatrain_ray.rl.batch import placed_logprobs, policy_micro_batches, with_logprobs
from megatrain_ray.rl.loss import group_advantages
from megatrain_ray.rl.prompts import Prompt, PromptOrder, Tokens
from megatrain_ray.rl.rewards import RewardBatch, Rewards
from megatrain_ray.rl.rollout import CopyTiming, Rollout, Sampling, overlap, prompt_parts


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


@dataclass(frozen=True)
class GrpoPosition:
    """Where a GRPO run is after a step: prompts taken, the sampler's generator state and, with a
    rollout one version behind, the next step's completions, already sampled (rl/step.py, Sampled)."""

    prompts: int
    sampler: str
    pending: dict | None = None

    def to_dict(self) -> dict:
        out = {"prompts": self.prompts, "sampler": self.sampler}
        return {**out, "pending": self.pending} if self.pending is not None else out


class RemoteRollout:
    """The rollout's actors as the step's rollout (rl/step.py): one copy of the policy each (on a GPU
    each where the step plan says so: planning/gpu_share.py, `samplers`), a step's prompts split
    between them in order (`prompt_parts`), every copy drawing the step's random numbers and taking
    its rows', so the completions are one copy's. Each call waits through the session (its watchdog
    turns a lost node into a ClusterFault)."""

    def __init__(self, session):
        """`session`: what holds the actors (`rollouts`), waits (`wait`) and loads them (`refresh_rollouts`)."""
        self.session = session
        self.actors = list(session.rollouts)
        where = session.wait([a.describe.remote() for a in self.actors], "starting the rollout")
        copies = f" (and {len(where) - 1} more copies like it, the prompts split between them)" if len(where) > 1 else ""
        print(f"rollout device: {where[0]}{copies}", flush=True)

    def refresh(self, policy) -> None:
        self.session.refresh_rollouts()

    def _calls(self, prompts: list, group_size: int, sampling: Sampling, scored: bool) -> list:
        return [actor.sample_scored.remote(prompts[start:end], group_size, sampling, scored, (start, len(prompts)))
                for actor, (start, end) in zip(self.actors, prompt_parts(len(prompts), len(self.actors)))
                if end > start]

    def sample_scored(self, prompts: list, group_size: int, sampling: Sampling, scored: bool = True):
        """As Rollout.sample_scored: the copies' completions in order, and each copy's timing."""
        return joined(self.session.wait(self._calls(prompts, group_size, sampling, scored), "sampling the completions"))

    def start_sampling(self, prompts: list, group_size: int, sampling: Sampling):
        """The actors sample while the step trains; the call returned waits for them."""
        refs = self._calls(prompts, group_size, sampling, True)
        return lambda: joined(self.session.wait(refs, "sampling the next step's completions"))

    def sampler_state(self) -> str:
        """The copies' generators are in one state (each draws every step's numbers): the first's."""
        return self.session.wait(self.actors[0].sampler_state.remote(), "the sampler's state")

    def set_sampler_state(self, state: str) -> None:
        self.session.wait([a.set_sampler_state.remote(state) for a in self.actors], "the sampler's state")


def joined(parts: list[tuple]) -> tuple[list[np.ndarray], list[np.ndarray] | None, list[CopyTiming]]:
    """The copies' (completions, log-probabilities, timings) as one, in order."""
    completions = [c for part in parts for c in part[0]]
    logprobs = None if parts[0][1] is None else [lp for part in parts for lp in part[1]]
    return completions, logprobs, [t for part in parts for t in part[2]]


class GrpoSteps:
    """The training loop's steps of a GRPO run: each call samples, rewards and updates (rl/step.py)
    and returns the last update's result, the position after the step and the step's metrics.
    With grpo.rollout_gpu=own the rollout samples the next step's prompts while a step trains
    (`GrpoStep.ahead`), and the position keeps those completions: a resumed run trains on them."""

    def __init__(self, session, config: Config, data, position: dict | None):
        """`data`: the prompts, the rewards and the tokenizer (objective.py, GrpoData)."""
        g = config.grpo
        self.session = session
        rollout = RemoteRollout(session)
        if position:
            rollout.set_sampler_state(position["sampler"])
        taken = (position or {}).get("prompts", 0)
        self.order = PromptOrder(data.prompts, config.train.seed, config.data.shuffle, taken)
        self.step = GrpoStep(g, config.train.micro_batch_size, rollout, data.rewards, data.tokens)
        self.pending: Sampled | None = None
        if position and position.get("pending"):  # its prompts: the last ones taken
            prompts = PromptOrder(data.prompts, config.train.seed, config.data.shuffle,
                                  taken - g.prompts_per_step).take(g.prompts_per_step)
            self.pending = Sampled.from_dict(prompts, position["pending"])

    def __call__(self, step: int) -> tuple[Any, GrpoPosition, dict]:
        n = self.step.settings.prompts_per_step
        if self.step.settings.rollout_gpu == "own":
            prompts = None if self.pending is not None else self.order.take(n)
            results, metrics, self.pending = self.step.ahead(self.session, self.pending, prompts, self.order.take(n))
        else:
            results, metrics = self.step(self.session, self.order.take(n))
        pending = self.pending.to_dict() if self.pending is not None else None
        return results[-1], GrpoPosition(self.order.position, self.step.rollout.sampler_state(), pending), metrics
