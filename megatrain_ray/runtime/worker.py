"""A worker's executor as its step plan says: the one place the streaming executor is built, for the
Ray GPU worker (runtime/actors.py) and the in-process trainer (runtime/local.py) alike."""

from __future__ import annotations

import torch

from megatrain_ray.config import Config
from megatrain_ray.host.memory import dtype_of
from megatrain_ray.host.sources import LayerSource
from megatrain_ray.models.arch import ModelArch
from megatrain_ray.planning.step_plan import StepPlan
from megatrain_ray.streaming.data_parallel import Group
from megatrain_ray.host.sources import HostLayerState
from megatrain_ray.streaming.device_step import DeviceStepSource
from megatrain_ray.streaming.executor import StreamingExecutor
from megatrain_ray.streaming.hooks import NO_HOOKS, StepHooks


def build_executor(arch: ModelArch, config: Config, plan: StepPlan, source: LayerSource, device: torch.device,
                   group: Group | None = None, hooks: StepHooks = NO_HOOKS) -> StreamingExecutor:
    """`source` reaches every layer (with the embedding's device step where the plan has it:
    `with_embedding_step`); `group` joins the data-parallel workers (None: alone)."""
    ex = config.executor
    if plan.device != device.type:
        raise ValueError(f"the step was planned for {plan.device} but this worker's device is {device}")
    return StreamingExecutor(
        arch, source, device, dtype_of(config.model.compute_dtype), ex.num_slots, ex.loss_chunk_tokens,
        compile_blocks=ex.compile, mlp_chunk_tokens=ex.mlp_chunk_tokens, offload_activations=plan.offload,
        group=group, keep_graphs=plan.kept, hooks=hooks,
    )


def with_embedding_step(source: LayerSource, embedding: HostLayerState, report_updates, device: torch.device,
                        config: Config) -> DeviceStepSource:
    """`source` with the embedding's AdamW step on `device` (where the plan has it there):
    `embedding` is its store's state as this process reaches it, `report_updates(layer, count)`
    tells the store its update count (streaming/device_step.py)."""
    return DeviceStepSource(source, {0: embedding}, device, dtype_of(config.model.compute_dtype), report_updates)
