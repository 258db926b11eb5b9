"""The streaming trainer in one process: stores, executor and the source that joins them.

Tests use it directly; the Ray GPU actor (runtime/actors.py) hosts the same executor with sources that
reach stores in other processes. Nothing else in the library imports this file.
"""

from __future__ import annotations

import dataclasses

import torch

from megatrain_ray.config import Config
from megatrain_ray.streaming.device_step import DeviceStepSource, HostLayerState
from megatrain_ray.streaming.executor import StreamingExecutor, pick_device
from megatrain_ray.streaming.step_result import EvalResult, StepResult
from megatrain_ray.host.memory import dtype_of
from megatrain_ray.host.precision import format_of
from megatrain_ray.models.arch import ModelArch
from megatrain_ray.models.registry import model_layouts
from megatrain_ray.host.adamw import LrSchedule
from megatrain_ray.planning.plan import choose_kept, embedding_step_on_device
from megatrain_ray.runtime.placement import split_by_capacity
from megatrain_ray.host.sources import LocalSource
from megatrain_ray.host.store import ShardStore


class LocalTrainer:
    def __init__(self, config: Config, arch: ModelArch, num_stores: int = 1, trace: list | None = None):
        self.config = config
        self.arch = arch
        dtype = dtype_of(config.model.compute_dtype)
        layers = split_by_capacity([layout.numel for layout in model_layouts(arch)], [1.0] * num_stores)
        fmt = format_of(config.optim)
        self.stores = [ShardStore(arch, ids, dtype, state_format=fmt, seed=config.train.seed) for ids in layers]
        for store in self.stores:
            store.init_random(config.train.seed, config.model.init_std)
        local = LocalSource(self.stores)
        ex = config.executor
        device = pick_device(ex.device)
        self.source = local
        if embedding_step_on_device(ex.embedding_step, device, 1, in_reach=True, exact_state=fmt.exact):
            self.source = DeviceStepSource(local, {0: host_state(local.owner[0], 0)}, device, dtype,
                                           lambda layer, count: local.owner[layer].set_update_count(layer, count))
        self.lr_schedule = LrSchedule(config.optim, config.train.steps)
        offload = ex.offload_activations == "on"  # in one process, auto parks nothing
        free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
        as_run = config.replace(executor=dataclasses.replace(ex, offload_activations="on" if offload else "off"))
        self.executor = StreamingExecutor(
            arch, self.source, device, dtype, ex.num_slots, ex.loss_chunk_tokens, trace, ex.compile,
            ex.mlp_chunk_tokens, offload_activations=offload, keep_graphs=choose_kept(arch, as_run, free),
        )

    def train_step(self, micro_batches: list[dict]) -> StepResult:
        return self.executor.train_step(micro_batches, self.lr_schedule.next)

    def eval_loss(self, micro_batches: list[dict]) -> EvalResult:
        return self.executor.eval_loss(micro_batches)

    def layer_weights(self) -> list[torch.Tensor]:
        self.source.drain()
        return [store.master(i) for store in self.stores for i in store.layers]

    def close(self) -> None:
        self.source.close()


def host_state(store: ShardStore, layer: int) -> HostLayerState:
    """A store's buffers of one layer, for its step on the executor's device."""
    state = store.layers[layer]
    return HostLayerState(state.master, state.exp_avg, state.exp_avg_sq, state.compute, state.layout.segments(),
                          state.updates)
