"""How a GRPO run's rollout and the training step share the GPU memory of the workers' node: a
decision of the step plan (planning/step_plan.py), made from the GPU the workers report
(`DeviceFacts.total_bytes`), never from the driver's.

On rank 0's GPU (grpo.rollout_gpu: shared) the step keeps what its leanest plan at the default
chunk sizes needs (at least 4 GiB: `trainer_need`; executor.gpu_memory_gib where set); the rollout
keeps every decoder layer resident where they fit in the rest beside the KV cache, else as many as
fit, streaming the others through two slots (grpo.rollout_resident_layers where set); the step is
then planned within all the rollout leaves. On a GPU of its own (grpo.rollout_gpu: own) the rollout
holds its whole copy there, or the run is refused.

Several copies may sample, each a contiguous share of a step's prompts (`samplers`): by default one
on each worker's GPU (their step is planned within what a copy leaves on every one of them), or
grpo.rollout_gpus of them; each copy's KV cache holds its share's rows only."""

from __future__ import annotations

from dataclasses import dataclass

from megatrain_ray.config import Config
from megatrain_ray.models.arch import ModelArch
from megatrain_ray.objective import Objective
from megatrain_ray.planning.decisions import AUTO_OFFLOAD_MARGIN, leanest_plan, with_auto_settings
from megatrain_ray.planning.memory import GiB, PlanError
from megatrain_ray.rl.rollout import num_decoder_layers, resident_layers_within

LEAST_TRAINER_BYTES = 4 * GiB  # the least GPU memory a step is left beside the rollout's copy


@dataclass(frozen=True)
class GpuShare:
    """What the rollout takes of the GPU and what the step is planned within."""

    resident_layers: int | None = None  # the rollout's decoder layers on its GPU (None: all)
    rollout_bytes: int = 0  # its copy, its two slots where it streams, the KV cache, the sampler (0: none)
    trainer_cap: int | None = None  # the bytes the step is planned within on a shared GPU (None: no cap of its own)
    own_gpu: bool = False  # the rollout holds a GPU of its own
    blocks: int = 0  # the model's decoder layers
    samplers: int = 1  # the rollout's copies, each sampling its share of a step's prompts (0: none samples)

    def describe(self) -> str:
        """The split, as the run's start line tells it ("" where nothing is shared)."""
        if not self.rollout_bytes:
            return ""
        if self.own_gpu:
            where = "a GPU of its own" if self.samplers == 1 else f"{self.samplers} GPUs of its own, the prompts split"
            return f"the rollout samples on {where} in about {self.rollout_bytes / GiB:.1f} GiB each, one policy " \
                   f"version behind the step"
        blocks = self.blocks
        streamed = "" if self.resident_layers is None else (
            f", {self.resident_layers} of its {blocks} decoder layers resident and the other "
            f"{blocks - self.resident_layers} streamed from host memory at every decode step")
        where = "the GPU" if self.samplers == 1 else f"each of {self.samplers} GPUs, the prompts split,"
        return f"the rollout's copy samples on {where} in about {self.rollout_bytes / GiB:.1f} GiB{streamed}: the " \
               f"step is planned within the other {self.trainer_cap / GiB:.1f} GiB"


def gpu_share(arch: ModelArch, config: Config, objective: Objective, kind: str, total: int | None,
              workers: int = 1) -> GpuShare:
    """The rollout's share of a GPU of `total` bytes (the `workers`' device, `kind`); nothing where no
    rollout samples on a GPU (one that samples elsewhere keeps grpo.rollout_resident_layers)."""
    copies = samplers(config, objective, kind, workers)
    if not objective.samples_on(kind) or total is None:
        return GpuShare(config.grpo.rollout_resident_layers if objective.samples else None, samplers=copies)
    if config.grpo.rollout_gpu == "own":
        return own_gpu(arch, config, objective, total, copies)
    return shared_gpu(arch, config, objective, total, copies)


def samplers(config: Config, objective: Objective, kind: str, workers: int) -> int:
    """The rollout's copies: grpo.rollout_gpus, else one on a GPU of its own (grpo.rollout_gpu=own),
    else one on each worker's GPU, one a prompt at the most (without GPUs: processes, one a worker);
    none where nothing samples. A PlanError where a shared copy would have no worker's GPU."""
    g = config.grpo
    if not objective.samples:
        return 0
    if g.rollout_gpus is None:
        return 1 if g.rollout_gpu == "own" else min(workers, g.prompts_per_step)
    if g.rollout_gpu == "shared" and objective.samples_on(kind) and g.rollout_gpus > workers:
        raise PlanError(
            f"grpo.rollout_gpus={g.rollout_gpus} copies of the rollout would share the GPUs of {workers} GPU "
            f"worker(s), one a GPU: set grpo.rollout_gpus to {workers} or fewer (null: one on each worker's GPU), "
            f"or grpo.rollout_gpu=own to give the copies GPUs of their own")
    return g.rollout_gpus


def own_gpu(arch: ModelArch, config: Config, objective: Objective, total: int, copies: int = 1) -> GpuShare:
    """The whole copy on each of the rollout's own GPUs (the updates rewrite the stores' weights while
    it samples, so no layer can stream from them): a PlanError where it does not fit."""
    g, room = config.grpo, objective.rollout_bytes(arch, None, copies)
    if room > total:
        raise PlanError(
            f"grpo.rollout_gpu=own: the rollout's copy in {g.rollout_dtype} with the KV cache of "
            f"{objective.rows_per_copy(copies)} completions of {config.data.seq_len} tokens takes about "
            f"{room / GiB:.1f} GiB, more than its {total / GiB:.0f} GiB GPU: fewer grpo.prompts_per_step or "
            f"grpo.group_size, more grpo.rollout_gpus, a shorter data.seq_len, or grpo.rollout_gpu=shared (which "
            f"streams the layers that do not fit)")
    return GpuShare(None, room, None, own_gpu=True, blocks=num_decoder_layers(arch), samplers=copies)


def shared_gpu(arch: ModelArch, config: Config, objective: Objective, total: int, copies: int = 1) -> GpuShare:
    """The split of each sampling worker's GPU between a rollout copy and the step; a PlanError
    where the step would be left less than 4 GiB even with every decoder layer of the rollout
    streamed (unless executor.gpu_memory_gib says how to share)."""
    share = split_shared(arch, config, objective, total, copies)
    if config.executor.gpu_memory_gib is None and (share.resident_layers == -1 or share.trainer_cap < LEAST_TRAINER_BYTES):
        g, blocks = config.grpo, num_decoder_layers(arch)
        resident = blocks if share.resident_layers is None else max(0, share.resident_layers)
        raise PlanError(
            f"the rollout's copy of the model in {g.rollout_dtype}, {resident} of its {blocks} decoder layers on the GPU (the "
            f"others streamed), with the KV cache of {objective.rows_per_copy(copies)} completions of {config.data.seq_len} "
            f"tokens takes about {share.rollout_bytes / GiB:.1f} GiB of the {total / GiB:.0f} GiB GPU, leaving the "
            f"training step {max(0.0, (total - share.rollout_bytes) / GiB):.1f} GiB (its leanest plan at the default "
            f"chunk sizes takes {trainer_need(arch, config) / GiB:.1f}, and 4 at the least): fewer "
            f"grpo.prompts_per_step or grpo.group_size, a shorter data.seq_len, fewer grpo.rollout_resident_layers, "
            f"or set executor.gpu_memory_gib to share the GPU yourself")
    return share


def split_shared(arch: ModelArch, config: Config, objective: Objective, total: int, copies: int = 1) -> GpuShare:
    """The one decision of a shared GPU's split, each of the `copies` sampling its share of the rows
    (resident layers -1: not even the KV cache fits beside the step's need)."""
    cap, resident = config.executor.gpu_memory_gib, config.grpo.rollout_resident_layers
    if resident is None:
        resident = resident_layers_within(arch, objective.rows_per_copy(copies), config.data.seq_len,
                                          objective.rollout_dtype_bytes, total - trainer_need(arch, config))
        if resident == -1 and cap is not None:  # the user shares the GPU: the fewest resident
            resident = 0
    elif resident >= num_decoder_layers(arch):
        resident = None
    room = objective.rollout_bytes(arch, max(0, resident) if resident is not None else None, copies)
    return GpuShare(resident, room, int(cap * GiB) if cap is not None else total - room, blocks=num_decoder_layers(arch),
                    samplers=copies)


def trainer_need(arch: ModelArch, config: Config) -> int:
    """The GPU memory the step keeps beside a rollout: executor.gpu_memory_gib, else its leanest
    plan at the default chunk sizes over the margin, 4 GiB at the least. `config`: as the planner
    reads it (a step's micro-batches the objective's)."""
    cap = config.executor.gpu_memory_gib
    if cap is not None:
        return int(cap * GiB)
    return max(LEAST_TRAINER_BYTES, int(leanest_plan(arch, with_auto_settings(config)).total / AUTO_OFFLOAD_MARGIN))
