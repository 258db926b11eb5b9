"""A run with train.objective: grpo, on the driver: its config, its prompts (read before Ray
starts), and its steps for the training loop (runtime/training.py), which checkpoints, logs and
stops them as it does the next-token steps.

The rollout's copy of the policy lives in an actor on the GPU node (runtime/actors.py,
RolloutActor), on grpo.rollout_device, sharing rank 0's GPU and reading the stores' weights there;
the rewards are computed here; the updates run on the run's GPU workers and stores like any step.
A step's position in the data is the prompts taken so far and the sampler's generator, so a
resumed run samples what the uninterrupted one would have."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from megatrain_ray.config import Config, ConfigError
from megatrain_ray.host.memory import dtype_of
from megatrain_ray.models.arch import ModelArch
from megatrain_ray.rl.prompts import Prompt, PromptOrder, Tokens, read_prompts
from megatrain_ray.rl.rewards import Rewards
from megatrain_ray.rl.rollout import GiB, Sampling, rollout_bytes, rollout_device
from megatrain_ray.rl.step import GrpoStep


def grpo_run_config(config: Config, arch: ModelArch, say=print) -> Config:
    """The config a GRPO run trains with: a step's micro-batches are its completions
    (grpo.prompts_per_step x grpo.group_size) in rows of train.micro_batch_size, whatever
    train.grad_accum says; with several updates per rollout the LR schedule spans every update
    (unless optim.schedule_steps says otherwise); where this machine has a GPU (the GPU node, in a
    local run: the rollout's actor shares it), the step is planned within what the rollout's copy
    leaves (executor.gpu_memory_gib, unless set)."""
    g, t, o = config.grpo, config.train, config.optim
    accum = g.prompts_per_step * g.group_size // t.micro_batch_size
    if g.updates_per_rollout > 1 and o.schedule_steps is None:
        o = dataclasses.replace(o, schedule_steps=t.steps * g.updates_per_rollout)
    config = config.replace(train=dataclasses.replace(t, grad_accum=accum), optim=o)
    device = rollout_device(g.rollout_device)
    if device.type == "cuda" and config.executor.gpu_memory_gib is None:
        config = config.replace(executor=dataclasses.replace(config.executor,
                                                             gpu_memory_gib=trainer_share(config, arch, device, say)))
    return config


def trainer_share(config: Config, arch: ModelArch, device: torch.device, say=print) -> float:
    """GiB of the GPU the step may plan with beside the rollout's copy (rl/rollout.py, rollout_bytes)."""
    g = config.grpo
    room = rollout_bytes(arch, g.prompts_per_step * g.group_size, config.data.seq_len,
                         torch.tensor([], dtype=dtype_of(g.rollout_dtype)).element_size())
    total = torch.cuda.get_device_properties(device).total_memory
    left = (total - room) / GiB
    if left < 4:
        raise ConfigError(
            f"the rollout's copy of the model in {g.rollout_dtype} with the KV cache of "
            f"{g.prompts_per_step * g.group_size} completions of {config.data.seq_len} tokens takes about "
            f"{room / GiB:.1f} GiB of the {total / GiB:.0f} GiB GPU, leaving the training step {max(0.0, left):.1f} GiB; "
            f"a model whose copy does not fit beside the step cannot roll out yet: fewer grpo.prompts_per_step or "
            f"grpo.group_size, a shorter data.seq_len, or set executor.gpu_memory_gib to share the GPU yourself")
    say(f"the rollout's copy samples on {device} in about {room / GiB:.1f} GiB: the step is planned within the other "
        f"{left:.1f} GiB (executor.gpu_memory_gib)")
    return round(left, 2)


@dataclass(frozen=True)
class GrpoData:
    tokens: Tokens
    prompts: list[Prompt]
    rewards: Rewards


def grpo_data(config: Config, arch: ModelArch) -> GrpoData:
    """The tokenizer, every prompt and the rewards, checked: a DataError or a RewardError before the
    cluster starts."""
    g = config.grpo
    tokens = Tokens(config)
    prompts = read_prompts(config, tokens, arch.vocab_size)
    rewards = Rewards(g.rewards, g.answer_column, g.format_pattern)
    print(f"prompts: {len(prompts)} from {config.data.source}; {g.group_size} completions each, "
          f"{g.prompts_per_step} prompts a step; rewards: "
          f"{', '.join(f'{name} x {weight:g}' for name, weight in g.rewards.items())}", flush=True)
    return GrpoData(tokens, prompts, rewards)


@dataclass(frozen=True)
class GrpoPosition:
    """Where a GRPO run is after a step: prompts taken, and the sampler's generator state."""

    prompts: int
    sampler: str

    def to_dict(self) -> dict:
        return {"prompts": self.prompts, "sampler": self.sampler}


class RemoteRollout:
    """The rollout's actor as the step's rollout (rl/step.py): each call waits through the session
    (its watchdog turns a lost node into a ClusterFault)."""

    def __init__(self, session):
        self.session = session
        self.actor = session.rollout
        print(f"rollout device: {session.wait(self.actor.describe.remote(), 'starting the rollout')}", flush=True)

    def refresh(self, policy) -> None:
        self.session.refresh_rollout(self.actor)

    def sample(self, prompts: list, group_size: int, sampling: Sampling):
        return self.session.wait(self.actor.sample.remote(prompts, group_size, sampling), "sampling the completions")

    def sampler_state(self) -> str:
        return self.session.wait(self.actor.sampler_state.remote(), "the sampler's state")

    def set_sampler_state(self, state: str) -> None:
        self.session.wait(self.actor.set_sampler_state.remote(state), "the sampler's state")


class GrpoSteps:
    """The training loop's steps of a GRPO run: each call samples, rewards and updates (rl/step.py)
    and returns the last update's result, the position after the step and the step's metrics."""

    def __init__(self, session, config: Config, data: GrpoData, position: dict | None):
        g = config.grpo
        self.session = session
        rollout = RemoteRollout(session)
        if position:
            rollout.set_sampler_state(position["sampler"])
        self.order = PromptOrder(data.prompts, config.train.seed, config.data.shuffle, (position or {}).get("prompts", 0))
        self.step = GrpoStep(g, config.train.micro_batch_size, rollout, data.rewards, data.tokens)

    def __call__(self, step: int) -> tuple[Any, GrpoPosition, dict]:
        results, metrics = self.step(self.session, self.order.take(self.step.settings.prompts_per_step))
        return results[-1], GrpoPosition(self.order.position, self.step.rollout.sampler_state()), metrics
