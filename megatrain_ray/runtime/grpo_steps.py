"""A GRPO run's steps as the training loop takes them (runtime/training.py): the prompts in order,
the rollout's actors (runtime/actors.py, RolloutActor; one copy each, the prompts split between
them) as the rollout of rl/step.py's GrpoStep, and the data position a checkpoint keeps (the prompts
taken, the sampler's generator and, with a rollout one version behind, the completions already
sampled). rl/ holds what a step computes; this file drives it on the run's actors through the
session."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from megatrain_ray.config import Config
from megatrain_ray.rl.prompts import PromptOrder
from megatrain_ray.rl.rollout import CopyTiming, Sampling, prompt_parts
from megatrain_ray.rl.step import GrpoStep, Sampled


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
    """The rollout's actors as a GRPO step's rollout (rl/step.py, GrpoStep): one copy of the policy each (on a GPU
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
    """The training loop's steps of a GRPO run: each call samples, rewards and updates (rl/step.py, GrpoStep)
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
