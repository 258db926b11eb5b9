"""A worker assembled from its step plan, in one place: its way to every layer (with the embedding's
AdamW step on the device where the plan has it), its executor, its learning-rate schedule and its
data-parallel process group. The Ray GPU worker (runtime/actors.py), the in-process trainer
(runtime/local.py) and the benchmark's rebuild for a new step shape (bench/telemetry.py) all assemble
through `assemble_worker`; none of them wires these pieces itself."""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from megatrain_ray.config import Config
from megatrain_ray.host.adamw import LrSchedule
from megatrain_ray.host.memory import dtype_of
from megatrain_ray.host.sources import FrozenSource, LayerSource
from megatrain_ray.models.arch import ModelArch
from megatrain_ray.models.registry import model_layouts
from megatrain_ray.planning.step_plan import StepPlan
from megatrain_ray.streaming.data_parallel import Group
from megatrain_ray.streaming.device_step import DeviceStepSource
from megatrain_ray.streaming.executor import StreamingExecutor
from megatrain_ray.streaming.muon_step import MuonStepSource
from megatrain_ray.streaming.hooks import NO_HOOKS, StepHooks
from megatrain_ray.streaming.step_result import EvalResult, StepResult


@dataclass(frozen=True)
class Rendezvous:
    """Where the data-parallel workers meet: rank 0's address and port (unused by a worker alone)."""

    rank: int = 0
    world: int = 1
    address: str = ""
    port: int = 0


@dataclass
class Worker:
    """What a worker steps with; `layers` is its way to the stores before the embedding's step is
    wrapped around it (kept for a rebuild on the same stores).

    Its methods are the policy's operations on one worker, written once for the two trainers that
    hold a worker (runtime/local.py in process, runtime/actors.py's GpuWorker in a Ray actor); the
    run's Session fans them out over its workers. Together they give rl/step.py's `Policy`."""

    layers: LayerSource
    source: LayerSource
    executor: StreamingExecutor
    lr_schedule: LrSchedule
    group: Group
    read_reference: Callable[[], FrozenSource]  # model.path's weights, for a GRPO run's KL
    seconds: dict[str, float] = field(default_factory=dict)  # what its assembly took, part by part
    reference: FrozenSource | None = None  # read at first use

    def train_step(self, micro_batches: list[dict], step_target_tokens: int | None = None) -> StepResult:
        """One optimizer step on this worker's micro-batches, the LR from its schedule."""
        return self.executor.train_step(micro_batches, self.lr_schedule.next, step_target_tokens)

    def eval_loss(self, micro_batches: list[dict]) -> EvalResult:
        return self.executor.eval_loss(micro_batches)

    def token_logprobs(self, micro_batches: list[dict]) -> list:
        """Each label's log-probability under the current weights."""
        return self.executor.token_logprobs(micro_batches)

    def reference_logprobs(self, micro_batches: list[dict]) -> list:
        """The same under the reference policy (model.path), streamed through this worker's slots
        from its one copy in host memory (`reference_source`)."""
        if self.reference is None:
            self.reference = self.read_reference()
        return self.executor.token_logprobs(micro_batches, self.reference)


def assemble_worker(arch: ModelArch, config: Config, plan: StepPlan, layers: LayerSource, device: torch.device,
                    meet: Rendezvous = Rendezvous(), group: Group | None = None, updates_done: int = 0,
                    hooks: StepHooks = NO_HOOKS) -> Worker:
    """The worker the plan describes. `layers` reaches every layer's store (in process, shared memory
    or the network); where the plan steps the embedding on the device, the source that owns layer 0
    shares that layer's state with the process of the worker that owns its gradient (`shared_state`,
    `report_updates`). `group`: an
    existing process group to keep (a rebuild), else one joined at `meet`. `updates_done`: the LR
    schedule's position."""
    if plan.device != device.type:
        raise ValueError(f"the step was planned for {plan.device} but this worker's device is {device}")
    hold_to_cap(plan, device)
    seconds: dict[str, float] = {}
    with timed(seconds, "the process group"):
        group = group or join_group(arch, config, device, meet)
    source = layers
    if plan.embedding_on_device:
        with timed(seconds, "the embedding's state on the device"):
            source = with_embedding_step(layers, arch, config, device, group)
    if plan.muon_on_device:
        source = with_muon_step(source, layers, arch, plan, device, group)
    with timed(seconds, "the executor"):
        executor = build_executor(arch, config, plan, source, device, group, hooks)
    return Worker(layers, source, executor, LrSchedule(config.optim, plan.schedule_steps, updates_done), group,
                  functools.partial(reference_source, arch, config, device), seconds)


@contextlib.contextmanager
def timed(seconds: dict[str, float], what: str):
    """Adds the seconds the block took to seconds[what] (a start's split: the GPU worker's build line)."""
    t0 = time.perf_counter()
    yield
    seconds[what] = seconds.get(what, 0.0) + time.perf_counter() - t0


def build_executor(arch: ModelArch, config: Config, plan: StepPlan, source: LayerSource, device: torch.device,
                   group: Group, hooks: StepHooks = NO_HOOKS) -> StreamingExecutor:
    return StreamingExecutor(
        arch, source, device, dtype_of(config.model.compute_dtype), plan.num_slots, plan.loss_chunk_tokens,
        compile_blocks=plan.compile, mlp_chunk_tokens=plan.mlp_chunk_tokens, offload_activations=plan.offload,
        group=group, keep_graphs=plan.kept, hooks=hooks, head_loss=plan.head_loss, host_gradients=plan.host_gradients,
        train_vision=config.model.train_vision,
    )


def reference_source(arch: ModelArch, config: Config, device: torch.device) -> FrozenSource:
    """The reference policy of a GRPO run with a KL (grpo.kl_coef > 0): model.path read once into
    host memory in the compute dtype (pinned where a GPU copies from it), for the executor to
    stream through its slots (StreamingExecutor.token_logprobs with `source`)."""
    from megatrain_ray.files.hf import load_hf_weights

    dtype, pinned = dtype_of(config.model.compute_dtype), device.type == "cuda"
    buffers = [torch.empty(layout.numel, dtype=dtype, pin_memory=pinned) for layout in model_layouts(arch)]
    load_hf_weights(config.model.path, arch, buffers.__getitem__)
    return FrozenSource(buffers)


def hold_to_cap(plan: StepPlan, device: torch.device) -> None:
    """Holds torch's allocator on `device` to the plan's cap (executor.gpu_memory_gib), so that a run
    on a large GPU cannot use more than the small one it stands for: an allocation past it fails as
    it would there. CUDA's own context and NCCL's buffers are outside the allocator. Without a cap
    (or on the CPU, where the cap does not bind) the whole device."""
    if device.type != "cuda":
        return
    index = torch.cuda.current_device() if device.index is None else device.index  # the call wants an index
    total = torch.cuda.get_device_properties(index).total_memory
    fraction = 1.0 if plan.memory_cap is None else min(1.0, plan.memory_cap / total)
    torch.cuda.set_per_process_memory_fraction(fraction, index)


def with_embedding_step(layers: LayerSource, arch: ModelArch, config: Config, device: torch.device,
                        group: Group) -> DeviceStepSource:
    """`layers` with the embedding's AdamW step on a device (streaming/device_step.py): on this one
    where this worker owns the embedding (its store's state as this process reaches it, and the store
    told of its update count), else on its owner's, whose new weights reach this worker over `group`."""
    dtype = dtype_of(config.model.compute_dtype)
    layout = model_layouts(arch, config.model.train_vision)[0]
    if group.owns(0):
        state = layers.shared_state(0, layout.segments())
        return DeviceStepSource(layers, {0: state}, device, dtype, layers.report_updates, group)
    return DeviceStepSource(layers, {}, device, dtype, layers.report_updates, group, shared={0: layout.numel})


def with_muon_step(source: LayerSource, layers: LayerSource, arch: ModelArch, plan: StepPlan,
                   device: torch.device, group: Group) -> MuonStepSource:
    """`source` with the Muon blocks of the plan that this worker owns orthogonalized on its device
    (streaming/muon_step.py), their momenta as this process reaches them."""
    owned = [layer for layer in plan.muon_on_device if group.owns(layer)]
    return MuonStepSource(source, {layer: layers.momentum(layer) for layer in owned}, model_layouts(arch), device)


def join_group(arch: ModelArch, config: Config, device: torch.device, meet: Rendezvous) -> Group:
    numels = [layout.numel for layout in model_layouts(arch)]
    if meet.world == 1:
        return Group.solo(len(numels))
    return Group.join(meet.rank, meet.world, meet.address, meet.port, device, numels,
                      config.train.step_timeout_s or 1800.0)
