"""A run with train.objective: grpo, on the driver: its config, its prompts (read before Ray
starts), and its steps for the training loop (runtime/training.py), which checkpoints, logs and
stops them as it does the next-token steps.

The rollout's copy of the policy lives in an actor on the GPU node (runtime/actors.py,
RolloutActor), on grpo.rollout_device, sharing rank 0's GPU (or, with grpo.rollout_gpu=own, on a
GPU of its own, one policy version behind) and reading the stores' weights there;
the rewards are computed here; the updates run on the run's GPU workers and stores like any step.
A step's position in the data is the prompts taken so far and the sampler's generator, so a
resumed run samples what the uninterrupted one would have."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from megatrain_ray.config import Config, ConfigError
from megatrain_ray.host.memory import dtype_of, element_size
from megatrain_ray.models.arch import ModelArch
from megatrain_ray.planning.plan import AUTO_OFFLOAD_MARGIN, leanest_plan, with_auto_settings
from megatrain_ray.rl.prompts import Prompt, PromptOrder, Tokens, read_prompts
from megatrain_ray.rl.rewards import Rewards
from megatrain_ray.rl.rollout import (GiB, Sampling, num_decoder_layers, resident_layers_within, rollout_bytes,
                                      rollout_device)
from megatrain_ray.rl.step import GrpoStep, Sampled


def grpo_run_config(config: Config, arch: ModelArch, say=print) -> Config:
    """The config a GRPO run trains with: a step's micro-batches are its completions
    (grpo.prompts_per_step x grpo.group_size) in rows of train.micro_batch_size, whatever
    train.grad_accum says; with several updates per rollout the LR schedule spans every update
    (unless optim.schedule_steps says otherwise); where this machine has a GPU (the GPU node, in a
    local run: the rollout's actor shares it), the GPU shared between the rollout and the step
    (`share_gpu`: grpo.rollout_resident_layers and executor.gpu_memory_gib, unless set)."""
    g, t, o = config.grpo, config.train, config.optim
    accum = g.prompts_per_step * g.group_size // t.micro_batch_size
    if g.updates_per_rollout > 1 and o.schedule_steps is None:
        o = dataclasses.replace(o, schedule_steps=t.steps * g.updates_per_rollout)
    config = config.replace(train=dataclasses.replace(t, grad_accum=accum), optim=o)
    device = rollout_device(g.rollout_device)
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        if g.rollout_gpu == "own":
            check_own_gpu(config, arch, total, say)
        else:
            config = plan_shared_gpu(config, arch, total, say)
    return config


def check_own_gpu(config: Config, arch: ModelArch, total: int, say=print) -> None:
    """A rollout on a GPU of its own (grpo.rollout_gpu=own) holds its whole copy there: a
    ConfigError where the copy and the KV cache do not fit (the updates rewrite the stores' weights
    while it samples, so no layer can stream from them)."""
    g = config.grpo
    room = rollout_bytes(arch, g.prompts_per_step * g.group_size, config.data.seq_len,
                         element_size(dtype_of(g.rollout_dtype)))
    if room > total:
        raise ConfigError(
            f"grpo.rollout_gpu=own: the rollout's copy in {g.rollout_dtype} with the KV cache of "
            f"{g.prompts_per_step * g.group_size} completions of {config.data.seq_len} tokens takes about "
            f"{room / GiB:.1f} GiB, more than its {total / GiB:.0f} GiB GPU: fewer grpo.prompts_per_step or "
            f"grpo.group_size, a shorter data.seq_len, or grpo.rollout_gpu=shared (which streams the layers that do "
            f"not fit)")
    say(f"the rollout samples on a GPU of its own in about {room / GiB:.1f} GiB, one policy version behind the step")


@dataclass(frozen=True)
class GpuShare:
    """How the rollout and the training step share one GPU."""

    resident_layers: int | None  # the rollout's decoder layers on the GPU (None: all; -1: not even the KV cache fits)
    rollout_bytes: int  # the rollout's copy, its two slots where it streams, the KV cache, the sampler
    trainer_bytes: int  # what the step is planned within


def share_gpu(config: Config, arch: ModelArch, total: int) -> GpuShare:
    """The one decision of the GPU's split: the step keeps what its leanest plan at the default
    chunk sizes needs (at least 4 GiB: `trainer_need`; executor.gpu_memory_gib where set); the
    rollout keeps every decoder layer resident where they fit in the rest beside the KV cache, else
    as many as fit, streaming the others (grpo.rollout_resident_layers where set); the step then
    gets all the rollout leaves (where executor.gpu_memory_gib is not set)."""
    g = config.grpo
    rows, d = g.prompts_per_step * g.group_size, element_size(dtype_of(g.rollout_dtype))
    cap = config.executor.gpu_memory_gib
    resident = g.rollout_resident_layers
    if resident is None:
        resident = resident_layers_within(arch, rows, config.data.seq_len, d, total - trainer_need(config, arch))
        if resident == -1 and cap is not None:  # the user shares the GPU: the fewest resident
            resident = 0
    elif resident >= num_decoder_layers(arch):
        resident = None
    room = rollout_bytes(arch, rows, config.data.seq_len, d, max(0, resident) if resident is not None else None)
    return GpuShare(resident, room, int(cap * GiB) if cap is not None else total - room)


def trainer_need(config: Config, arch: ModelArch) -> int:
    cap = config.executor.gpu_memory_gib
    if cap is not None:
        return int(cap * GiB)
    return max(4 * GiB, int(leanest_plan(arch, with_auto_settings(config)).total / AUTO_OFFLOAD_MARGIN))


def plan_shared_gpu(config: Config, arch: ModelArch, total: int, say=print) -> Config:
    """`config` with the split of a GPU of `total` bytes (`share_gpu`) in it, said; a ConfigError
    where the step would be left less than 4 GiB, even with every decoder layer of the rollout
    streamed (unless executor.gpu_memory_gib says how to share)."""
    g = config.grpo
    share = share_gpu(config, arch, total)
    left = share.trainer_bytes / GiB
    blocks = num_decoder_layers(arch)
    resident = blocks if share.resident_layers is None else max(0, share.resident_layers)
    if config.executor.gpu_memory_gib is None and (share.resident_layers == -1 or left < 4):
        raise ConfigError(
            f"the rollout's copy of the model in {g.rollout_dtype}, {resident} of its {blocks} decoder layers on the "
            f"GPU (the others streamed), with the KV cache of {g.prompts_per_step * g.group_size} completions of "
            f"{config.data.seq_len} tokens takes about {share.rollout_bytes / GiB:.1f} GiB of the {total / GiB:.0f} GiB "
            f"GPU, leaving the training step {max(0.0, (total - share.rollout_bytes) / GiB):.1f} GiB (its leanest plan "
            f"at the default chunk sizes takes {trainer_need(config, arch) / GiB:.1f}, and 4 at the least): fewer grpo.prompts_per_step or grpo.group_size, a shorter "
            f"data.seq_len, fewer grpo.rollout_resident_layers, or set executor.gpu_memory_gib to share the GPU yourself")
    streamed = ""
    if share.resident_layers is not None:
        streamed = (f", {resident} of its {blocks} decoder layers resident and the other {blocks - resident} streamed "
                    f"from host memory at every decode step")
    say(f"the rollout's copy samples on the GPU in about {share.rollout_bytes / GiB:.1f} GiB{streamed}: the step is "
        f"planned within the other {left:.1f} GiB (executor.gpu_memory_gib)")
    return config.replace(grpo=dataclasses.replace(g, rollout_resident_layers=share.resident_layers),
                          executor=dataclasses.replace(config.executor, gpu_memory_gib=round(left, 2)))


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
    """Where a GRPO run is after a step: prompts taken, the sampler's generator state and, with a
    rollout one version behind, the next step's completions, already sampled (rl/step.py, Sampled)."""

    prompts: int
    sampler: str
    pending: dict | None = None

    def to_dict(self) -> dict:
        out = {"prompts": self.prompts, "sampler": self.sampler}
        return {**out, "pending": self.pending} if self.pending is not None else out


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

    def sample_scored(self, prompts: list, group_size: int, sampling: Sampling):
        return self.session.wait(self.actor.sample_scored.remote(prompts, group_size, sampling),
                                 "sampling the completions")

    def start_sampling(self, prompts: list, group_size: int, sampling: Sampling):
        """The actor samples while the step trains; the call returned waits for it."""
        ref = self.actor.sample_scored.remote(prompts, group_size, sampling)
        return lambda: self.session.wait(ref, "sampling the next step's completions")

    def sampler_state(self) -> str:
        return self.session.wait(self.actor.sampler_state.remote(), "the sampler's state")

    def set_sampler_state(self, state: str) -> None:
        self.session.wait(self.actor.set_sampler_state.remote(state), "the sampler's state")


class GrpoSteps:
    """The training loop's steps of a GRPO run: each call samples, rewards and updates (rl/step.py)
    and returns the last update's result, the position after the step and the step's metrics.
    With grpo.rollout_gpu=own the rollout samples the next step's prompts while a step trains
    (`GrpoStep.ahead`), and the position keeps those completions: a resumed run trains on them."""

    def __init__(self, session, config: Config, data: GrpoData, position: dict | None):
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
