"""One step's decisions, made once before anything is allocated, for every worker of the run.

`plan_step` decides, from the facts the workers report of their devices and from the placement,
everything the step is: the working set a token it plans with, where the embedding's AdamW step
runs, whether the boundary activations are parked in host memory, how many of the last blocks keep
their forward graphs, whether the blocks compile, each worker's window of pinned slots for the
layers on other nodes, the GPU node's headroom beside the stores and the windows, a step's
micro-batches and the LR schedule's length (the objective's: objective.py), and a GRPO rollout's
share of the GPU (planning/gpu_share.py); it refuses a step that cannot fit. The config stays as
the user wrote it: what the plan decides is in the plan, which the workers and the loop obey. Every
caller plans through it once: the session of a run (runtime/session.py) and the in-process trainer
(runtime/local.py) before their workers assemble (runtime/worker.py), `megatrain-ray plan` and
`plan --cluster` (api.py, planning/whatif.py), and the benchmark's sweep. What they print of it,
`plan.describe` renders without deciding anything.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from megatrain_ray.config import Config
from megatrain_ray.host.memory import dtype_of, host_headroom
from megatrain_ray.host.muon import muon_slots
from megatrain_ray.host.precision import format_of
from megatrain_ray.models.arch import ModelArch
from megatrain_ray.models.registry import family, model_layouts
from megatrain_ray.objective import objective_of
from megatrain_ray.planning.gpu_share import GpuShare, gpu_share
from megatrain_ray.planning.placement import Placement, with_window
from megatrain_ray.planning.decisions import (check_gpu_fit, check_host_fit, check_parked_fit, choose_host_gradients,
                                              device_budget, embedding_step_on_device, fit_auto_settings, fits_leanest,
                                              gpu_memory, host_memory, with_auto_settings)
from megatrain_ray.planning.memory import (GiB, GpuPlan, LOSS_CHUNK_TOKENS, MLP_CHUNK_TOKENS, NUM_SLOTS, PlanError,
                                           host_gradient_bytes, host_gradient_layers, host_parking,
                                           micro_batches_per_gpu)
from megatrain_ray.planning.probe import measure_working_set
from megatrain_ray.rl.loss import PolicyLoss, TokenLoss


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
    total_bytes: int | None = None  # the device's memory (None: not read; its free memory stands for it)


def device_facts(device: torch.device, measured_working_set: float = 0.0) -> DeviceFacts:
    """This process's device as the plan needs it; on a GPU, CUDA has started by now."""
    if device.type != "cuda":
        return DeviceFacts("cpu", "cpu", None, host_headroom())
    free, total = torch.cuda.mem_get_info(device)
    return DeviceFacts("cuda", torch.cuda.get_device_name(device), free, host_headroom(), measured_working_set, total)


def measured_working_set(device: torch.device, arch: ModelArch, config: Config, say=print) -> float:
    """The largest layer kind's working set a token, measured on `device` at the run's micro-batch
    shape where the plan needs one (planning/probe.py: a model run through transformers' modules, on
    a GPU), else 0 (the family's estimate); `say` tells which figure the plan will use."""
    if device.type != "cuda":
        return 0.0
    units, text = measure_working_set(arch, config.train.micro_batch_size, config.data.seq_len,
                                      dtype_of(config.model.compute_dtype), device)
    if units:
        say(text)
    return units


def measured_facts(device: torch.device, arch: ModelArch, config: Config, say=print) -> DeviceFacts:
    """A worker's facts, with its layers' working set measured on its device (measured_working_set)."""
    return device_facts(device, measured_working_set(device, arch, config, say))


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
    measured_working_set: float = 0.0  # the working set a token planned with (0: the family's estimate)
    loss_chunk_tokens: int = LOSS_CHUNK_TOKENS  # tokens per chunk of the LM-head loss
    mlp_chunk_tokens: int = MLP_CHUNK_TOKENS  # longer micro-batches run their MLP in chunks of this many (0: never)
    num_slots: int = NUM_SLOTS  # weight slots per layer size on the device
    memory_cap: int | None = None  # bytes each worker's allocator may hold (executor.gpu_memory_gib; None: no cap)
    memory: GpuPlan = dataclasses.field(default_factory=GpuPlan, compare=False)  # each worker's peak by use
    free_bytes: int | None = dataclasses.field(default=None, compare=False)  # the device memory planned against
    headroom: int = dataclasses.field(default=0, compare=False)  # the workers' node's, beside stores and windows
    placement: Placement | None = dataclasses.field(default=None, compare=False)  # with its window (None: in process)
    refused: str | None = dataclasses.field(default=None, compare=False)  # why it cannot run (plan_step refuse=False)
    head_loss: TokenLoss | PolicyLoss = TokenLoss()  # the objective's: the token cross-entropy or the policy loss
    micro_batches: int = 1  # a step's, over every worker (train.grad_accum, or a GRPO step's completions' rows)
    schedule_steps: int = 0  # the LR schedule's length (the objective's, or a resumed run's: files/checkpoint.py)
    compile: bool = False  # the blocks and the head's loss run torch.compile'd (streaming/compiled.py)
    rollout: GpuShare = GpuShare()  # a GRPO rollout's share of the GPU (planning/gpu_share.py)
    # layers whose weight gradient is summed in pinned host memory, one micro-batch's or loss chunk's share
    # on the device at a time (streaming/host_gradients.py): the vocabulary-sized ones, where their fp32
    # accumulator on the device does not fit (planning/memory.py, host_gradient_layers)
    host_gradients: tuple[int, ...] = ()
    # Muon blocks whose momentum update and Newton-Schulz iteration run on their owner's device in the
    # update phase (streaming/muon_step.py; `muon_on_device`), the others' on their store's cores
    muon_on_device: tuple[int, ...] = ()

    def describe(self) -> str:
        """The decisions as the run's start line tells them."""
        parts = [self.rollout.describe()] if self.rollout.rollout_bytes else []
        if self.memory_cap is not None and self.rollout.trainer_cap is None:
            parts.append(f"GPU memory capped at {self.memory_cap / GiB:.1f} GiB (executor.gpu_memory_gib)")
        if self.offload:
            parts.append("the boundary activations are parked in host memory")
        if self.kept:
            parts.append(f"the last {self.kept} blocks keep their forward graphs")
        if self.embedding_on_device:
            parts.append("the embedding's AdamW step runs here" if self.workers == 1 else
                         "the embedding's AdamW step runs on one of them, which sends the others its new weights")
        if self.host_gradients:
            parts.append("the vocabulary layers' gradients are summed in host memory")
        if self.muon_on_device:
            parts.append(f"Muon's Newton-Schulz iteration runs on the GPU for {len(self.muon_on_device)} blocks")
        return "".join(f"; {p}" for p in parts)

    def planned_config(self, config: Config) -> Config:
        """The settings as the planner's models read them (`planner_view`) with the chunk sizes and
        weight slots it chose: for its predictions and reports (planning/prediction.py, report.py), never a run's."""
        view = planner_view(config, self.micro_batches, self.compile, self.rollout.trainer_cap)
        return view.replace(executor=dataclasses.replace(view.executor, loss_chunk_tokens=self.loss_chunk_tokens,
                                                         mlp_chunk_tokens=self.mlp_chunk_tokens,
                                                         num_slots=self.num_slots,
                                                         host_gradients=bool(self.host_gradients),
                                                         offload_activations="on" if self.offload else "off"))


def planner_view(config: Config, micro_batches: int, compile_blocks: bool, cap: int | None) -> Config:
    """The planner's own copy of the settings, with what the step plan decided in them (a step's
    micro-batches, whether the blocks compile, the cap a rollout's share leaves the step), which its
    memory and time models (planning/memory.py, prediction.py) read: it never leaves the planner as a run's config."""
    ex = config.executor
    gib = cap / GiB if cap is not None else ex.gpu_memory_gib
    return config.replace(train=dataclasses.replace(config.train, grad_accum=micro_batches),
                          executor=dataclasses.replace(ex, compile=compile_blocks, gpu_memory_gib=gib))


def muon_on_device(arch: ModelArch, config: Config, kind: str, placement: Placement | None) -> tuple[int, ...]:
    """The Muon blocks whose momentum update and orthogonalization run on the workers' GPUs
    (streaming/muon_step.py): with optim.name muon on a GPU, every block with Muon's matrices whose
    store is on the GPU node (its momentum in shared memory there). Newton-Schulz is matrix products:
    about 1.9e13 FLOP a step for a Qwen2.5-7B block, under 0.1 s on a GPU and minutes on a host's
    cores (megatrain_ray/README.md, "Muon"). None on the CPU, where the stores' cores do it, nor for a
    block on another node, whose store does it too."""
    if kind != "cuda" or config.optim.name != "muon":
        return ()
    remote = set(placement.remote_layers()) if placement is not None else set()
    return tuple(layout.index for layout in model_layouts(arch)
                 if muon_slots(layout, "muon") and layout.index not in remote)


def compiles(arch: ModelArch, config: Config, kind: str) -> bool:
    """Whether the blocks run torch.compile'd: executor.compile on a GPU, unless the model's forward
    draws random numbers (dropout: its recompute replays the forward's draws, streaming/rng.py, and
    a compiled forward and recompute need not draw alike)."""
    return kind == "cuda" and config.executor.compile and not family(arch).draws_random(arch)


def plan_step(arch: ModelArch, config: Config, facts: DeviceFacts | list[DeviceFacts],
              placement: Placement | None = None, stores_allocated: bool = True, refuse: bool = True,
              schedule_steps: int | None = None) -> StepPlan:
    """The step's plan for every worker, from the tightest device's facts (and the largest working
    set the workers measured); a PlanError saying what to change where it cannot fit (`refuse`
    False: the plan, with why in `refused`, for a command that reports it).

    `placement`: the run's (None: in one process, every store in reach and no window);
    `stores_allocated`: whether the stores on the GPU machine hold their memory already (else the
    headroom leaves room for them); `schedule_steps`: a resumed run's LR schedule length
    (files/checkpoint.py, schedule_on_resume; None: the objective's)."""
    facts = [facts] if isinstance(facts, DeviceFacts) else list(facts)
    tightest = min(facts, key=lambda f: f.free_bytes or 0)
    objective = objective_of(config)
    compile_blocks = compiles(arch, config, tightest.kind)
    config = planner_view(config, objective.micro_batches, compile_blocks, None)
    share, refused = GpuShare(), None
    workers = placement.num_gpus if placement is not None else 1
    try:
        share = gpu_share(arch, config, objective, tightest.kind, tightest.total_bytes or tightest.free_bytes, workers)
    except PlanError as e:
        if refuse:
            raise
        refused = str(e)
    config = planner_view(config, objective.micro_batches, compile_blocks, share.trainer_cap)
    measured = max(f.measured_working_set for f in facts)
    where = f"the {tightest.name} of node {placement.gpu.ip}" if placement is not None else tightest.name
    embedding = model_layouts(arch, config.model.train_vision)[0]
    on_device = embedding_step_on_device(config.executor.embedding_step, tightest.kind, workers,
                                         placement is None or 0 not in placement.remote_layers(),
                                         format_of(config.optim).exact, embedding.trained_numel < embedding.numel)
    budget = device_budget(tightest.free_bytes, config)
    if tightest.kind == "cuda":
        # auto: the embedding steps here only where that takes nothing else the step would give up for it
        on_device = on_device and (config.executor.embedding_step == "device"
                                   or fits_leanest(arch, with_auto_settings(config), budget, workers, True, measured))
        config = choose_host_gradients(arch, config, budget, workers, on_device, measured)
        config = fit_auto_settings(arch, config, budget, workers, on_device, measured)
        memory = gpu_memory(arch, config, budget, workers, on_device, measured)
    else:  # the executor's tensors live beside the stores' state; nothing is parked
        config = with_auto_settings(choose_host_gradients(arch, config, 0, workers, on_device)
                                    if config.executor.host_gradients else config)
        memory = host_memory(arch, config, workers)
    parked = host_parking(arch, config, memory.offload, workers, on_device)
    placed = with_window(placement, arch, config, parked) if placement is not None else None
    headroom = gpu_node_headroom(tightest.host_headroom, placed, stores_allocated)
    gib = config.executor.gpu_memory_gib
    cap = share.trainer_cap or (int(gib * GiB) if gib is not None else None)
    plan = StepPlan(tightest.kind, workers, micro_batches_per_gpu(config, workers), memory.offload, memory.kept,
                    on_device, placed.window_slots if placed is not None else 0, measured,
                    config.executor.loss_chunk_tokens, config.executor.mlp_chunk_tokens, config.executor.num_slots,
                    cap if tightest.kind == "cuda" else None, memory, budget, headroom, placed,
                    head_loss=objective.head_loss, micro_batches=objective.micro_batches,
                    schedule_steps=schedule_steps or objective.schedule_steps, compile=compile_blocks, rollout=share,
                    host_gradients=host_gradient_layers(arch, config, workers, on_device),
                    muon_on_device=muon_on_device(arch, config, tightest.kind, placement))
    if refused is not None:
        return dataclasses.replace(plan, refused=refused)
    try:
        check_step_fits(arch, config, plan, where)
    except PlanError as e:
        if refuse:
            raise
        return dataclasses.replace(plan, refused=str(e))
    return plan


def gpu_node_headroom(host_headroom: int, placement: Placement | None, stores_allocated: bool) -> int:
    """What the workers' node can give beside the stores on its machine (not yet allocated when a
    run starts) and every worker's window: where activations are parked from a GPU, or where a CPU
    executor keeps what a GPU would hold."""
    if placement is None:
        return max(0, host_headroom)
    stores = 0 if stores_allocated else placement.gpu_machine_state()
    return max(0, host_headroom - placement.window_bytes - stores)


def check_step_fits(arch: ModelArch, config: Config, plan: StepPlan, where: str) -> None:
    if plan.device == "cuda":
        check_gpu_fit(plan.memory, plan.free_bytes, where, capped=plan.memory_cap is not None
                      and plan.memory_cap <= plan.free_bytes)
        summed = host_gradient_bytes(arch, config, plan.workers, plan.embedding_on_device)
        if plan.offload or summed:  # every worker parks on the GPU node
            check_parked_fit(arch, config, plan.headroom, "the GPU node", plan.offload, summed)
    else:
        check_host_fit(plan.memory, plan.headroom, "the executor's node", plan.workers)
