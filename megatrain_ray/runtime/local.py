"""The streaming trainer in one process, for tests and examples: its step planned by the same
function as a Ray run's (planning/step_plan.py) and its worker assembled by the same one
(runtime/worker.py); only the stores live in this process and are reached directly, not through
shared memory or the network. Nothing else in the library imports this file.
"""

from __future__ import annotations

import torch

from megatrain_ray.config import Config
from megatrain_ray.host.memory import dtype_of
from megatrain_ray.host.precision import format_of
from megatrain_ray.host.sources import LocalSource
from megatrain_ray.host.store import ShardStore
from megatrain_ray.models.arch import ModelArch
from megatrain_ray.models.registry import model_layouts
from megatrain_ray.planning.placement import split_by_capacity
from megatrain_ray.planning.step_plan import measured_facts, plan_step
from megatrain_ray.runtime.worker import assemble_worker
from megatrain_ray.streaming.executor import pick_device
from megatrain_ray.streaming.hooks import NO_HOOKS, StepHooks
from megatrain_ray.streaming.step_result import EvalResult, StepResult


class LocalTrainer:
    """`num_stores` stores split the layers as a placement would; `hooks` observe the executor."""

    def __init__(self, config: Config, arch: ModelArch, num_stores: int = 1, hooks: StepHooks = NO_HOOKS):
        self.config = config
        self.arch = arch
        layers = split_by_capacity([layout.numel for layout in model_layouts(arch)], [1.0] * num_stores)
        self.stores = [ShardStore(arch, ids, dtype_of(config.model.compute_dtype), state_format=format_of(config.optim),
                                  seed=config.train.seed, train_vision=config.model.train_vision) for ids in layers]
        for store in self.stores:
            store.init_random(config.train.seed, config.model.init_std)
        device = pick_device(config.executor.device)
        # the stores hold their memory already; no window in one process
        self.plan = plan_step(arch, config, measured_facts(device, arch, config))
        self.worker = assemble_worker(arch, config, self.plan, LocalSource(self.stores), device, hooks=hooks)
        self.source, self.executor, self.lr_schedule = self.worker.source, self.worker.executor, self.worker.lr_schedule

    def train_step(self, micro_batches: list[dict]) -> StepResult:
        return self.worker.train_step(micro_batches)

    def eval_loss(self, micro_batches: list[dict]) -> EvalResult:
        return self.worker.eval_loss(micro_batches)

    def token_logprobs(self, micro_batches: list[dict]) -> list:
        return self.worker.token_logprobs(micro_batches)

    def reference_logprobs(self, micro_batches: list[dict]) -> list:
        return self.worker.reference_logprobs(micro_batches)

    def rollout_weights(self):
        """(layer, weights) for the rollout's copy, once every update has landed (rl/step.py,
        Policy): the stores' compute copies, the embedding's master where it steps on the device."""
        self.source.drain()
        for store in self.stores:
            for i, state in store.layers.items():
                yield i, state.master if i == 0 and self.plan.embedding_on_device else state.compute

    def layer_weights(self) -> list[torch.Tensor]:
        self.source.drain()
        return [store.master(i) for store in self.stores for i in store.layers]

    def close(self) -> None:
        self.source.close()
