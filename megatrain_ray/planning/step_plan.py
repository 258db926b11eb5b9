"""One step's decisions, made once before anything is allocated, for every worker of the run.

`plan_step` decides where the embedding's AdamW step runs, whether the boundary activations are
parked in host memory, how many of the last blocks keep their forward graphs, and refuses a step
that cannot fit. The driver calls it once per run (runtime/session.py) and hands the plan to the
GPU workers, which build what it says and decide nothing; the in-process trainer
(runtime/local.py) calls it the same way. Its inputs are the config, the placement's answers
(workers, the window, whether the embedding's store is in reach) and `DeviceFacts`: the one thing
only a worker can read, its device and the device memory free once its CUDA context exists.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from megatrain_ray.config import Config
from megatrain_ray.host.memory import host_headroom
from megatrain_ray.host.precision import format_of
from megatrain_ray.models.arch import ModelArch
from megatrain_ray.planning.plan import (GpuPlan, check_gpu_fit, check_host_fit, check_parked_fit,
                                         embedding_step_on_device, micro_batches_per_gpu)


@dataclass(frozen=True)
class DeviceFacts:
    """What a worker reads of its device (planning needs nothing else from it)."""

    kind: str  # "cuda" or "cpu"
    name: str  # for messages: the GPU's model, or "cpu"
    free_bytes: int | None  # free device memory with the worker's CUDA context made (None on the CPU)
    host_headroom: int  # what its node can still give before Ray's memory monitor steps in (host/memory.py)
    # the largest layer kind's working set a token, in compute-dtype elements, measured on this
    # device at the run's micro-batch shape (planning/probe.py); 0: the family's estimate
    measured_working_set: float = 0.0


def device_facts(device: torch.device, measured_working_set: float = 0.0) -> DeviceFacts:
    """This process's device as the plan needs it; on a GPU, CUDA has started by now."""
    if device.type != "cuda":
        return DeviceFacts("cpu", "cpu", None, host_headroom())
    return DeviceFacts("cuda", torch.cuda.get_device_name(device), torch.cuda.mem_get_info(device)[0], host_headroom(),
                       measured_working_set)


@dataclass(frozen=True)
class StepPlan:
    """What every worker builds: the same for all of them (data parallel over a step's micro-batches)."""

    device: str  # "cuda" or "cpu"
    workers: int  # data-parallel workers sharing each step
    micro_batches_per_worker: int  # each worker's share of a step's micro-batches
    offload: bool  # boundary activations parked in pinned host memory (on a GPU only)
    kept: int  # the last blocks that keep their forward graphs for backward
    embedding_on_device: bool  # the embedding's AdamW step runs on the worker's device
    window_slots: int = 0  # pinned slots per layer size for layers on other nodes (0: none there)
    memory: GpuPlan = dataclasses.field(default_factory=GpuPlan, compare=False)  # each worker's peak by use

    def describe(self) -> str:
        """The decisions as the run's start line tells them."""
        parts = []
        if self.kept:
            parts.append(f"the last {self.kept} blocks keep their forward graphs")
        if self.embedding_on_device:
            parts.append("the embedding's AdamW step runs here")
        return "".join(f"; {p}" for p in parts)


def plan_step(arch: ModelArch, config: Config, facts: DeviceFacts, headroom: int, workers: int = 1,
              embedding_in_reach: bool = True, window_slots: int = 0, where: str = "the GPU") -> StepPlan:
    """The step's plan, or a PlanError saying what to change.

    `headroom`: what the executor's node can give beside the stores and the windows for remote
    layers (facts.host_headroom less what they will take): where activations are parked from a
    GPU, or where a CPU executor keeps what a GPU would hold. `embedding_in_reach`: the embedding's
    store memory is reachable from the workers' process (in process, or shared memory on their
    node). `where`: the device, for messages."""
    on_device = embedding_step_on_device(config.executor.embedding_step, torch.device(facts.kind), workers,
                                         embedding_in_reach, format_of(config.optim).exact)
    decided = embedding_step_decided(config, on_device)
    if facts.kind == "cuda":
        memory = check_gpu_fit(arch, decided, facts.free_bytes, where, workers)
        if memory.offload:  # every worker parks on the GPU node
            check_parked_fit(arch, decided, headroom, "the GPU node")
    else:  # the executor's tensors live beside the stores' state; nothing is parked
        memory = check_host_fit(arch, decided, headroom, "the executor's node", workers)
    return StepPlan(facts.kind, workers, micro_batches_per_gpu(config, workers), memory.offload, memory.kept,
                    on_device, window_slots, memory)


def embedding_step_decided(config: Config, on_device: bool) -> Config:
    """The config with executor.embedding_step as decided, so that the memory plan counts the
    embedding's device step exactly where it runs."""
    return config.replace(executor=dataclasses.replace(config.executor, embedding_step="device" if on_device else "host"))
