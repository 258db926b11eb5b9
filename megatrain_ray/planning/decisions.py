"""The step's memory decisions, made once by the step plan (planning/step_plan.py): the executor
settings left on auto (chunks, weight slots) fitted to the GPU, whether the boundary activations
are parked in host memory, how many blocks keep their forward graphs, where the embedding steps,
whether the vocabulary layers' gradients are summed in host memory, and the refusals, with what to
change, of a step the GPU, the host or the GPU node's parking cannot hold.
"""

from __future__ import annotations

import dataclasses
import math

from megatrain_ray.config import Config
from megatrain_ray.models.arch import ModelArch
from megatrain_ray.planning.memory import (BOUNDARY, FEWEST_SLOTS, GiB, GpuPlan, HOST_PARK_RESERVE, KEPT, PlanError,
                                           SMALLEST_LOSS_CHUNK, SMALLEST_MLP_CHUNK, TRAINED_VISION, format_gpu_plan,
                                           gpu_plan, host_gradient_layers, kept_graph_bytes, loss_chunk_setting,
                                           mlp_chunk_setting, mlp_chunk_tokens, num_blocks, num_slots_setting,
                                           parked_bytes)

AUTO_OFFLOAD_MARGIN = 0.85  # offload before the prediction comes close to the free memory


def with_auto_settings(config: Config) -> Config:
    """`config` with the settings left on auto at their defaults."""
    return config.replace(executor=dataclasses.replace(config.executor, loss_chunk_tokens=loss_chunk_setting(config),
                                                       mlp_chunk_tokens=mlp_chunk_setting(config),
                                                       num_slots=num_slots_setting(config)))


def check_parked_fit(arch: ModelArch, config: Config, headroom_bytes: int, where: str, offload: bool = True,
                     summed_bytes: int = 0) -> None:
    """Parked activations (where `offload`) and gradients summed in host memory (`summed_bytes`:
    host_gradient_bytes) come on top of the stores' state: refuse before the node runs out.

    `headroom_bytes`: what the node can still give before Ray's memory monitor kills workers.
    """
    need = (parked_bytes(arch, config) if offload else 0) + summed_bytes + HOST_PARK_RESERVE
    what = " and " .join(w for w, on in (("parking the boundary activations", offload),
                                         ("summing the vocabulary layers' gradients", summed_bytes)) if on)
    if need > headroom_bytes:
        raise PlanError(
            f"{what} in host memory needs {need / GiB:.1f} GiB on {where}, which can "
            f"give {headroom_bytes / GiB:.1f} GiB beside the stores before Ray's memory monitor steps in. Fewer "
            f"micro-batches per step (train.grad_accum) or tokens per micro-batch (train.micro_batch_size, "
            f"data.seq_len), or RAM nodes to hold the model (runtime.store_on_gpu_node: false)"
        )


def choose_host_gradients(arch: ModelArch, config: Config, budget: int, num_gpus: int = 1,
                          embedding_on_device: bool = False, measured: float = 0.0) -> Config:
    """`config` with executor.host_gradients decided: as set, or (null) on only where the step does not
    fit the GPU's `budget` even with the smallest chunks and slots (fit_auto_settings) and summing the
    vocabulary layers' gradients in host memory spares the device their fp32 accumulator (its cost:
    each micro-batch's and loss chunk's share crosses to the host, where the CPU adds it). A setting of
    true that no layer can follow (a tied head, several GPUs) is refused."""
    setting = config.executor.host_gradients
    on = config.replace(executor=dataclasses.replace(config.executor, host_gradients=True))
    if setting and not host_gradient_layers(arch, on, num_gpus, embedding_on_device):
        raise PlanError("executor.host_gradients is true but no layer's gradient can be summed in host memory here: "
                        "that takes one GPU worker (runtime.num_gpus: 1) and an untied LM head; set it to null or false")
    if setting is None:
        off = config.replace(executor=dataclasses.replace(config.executor, host_gradients=False))
        setting = bool(host_gradient_layers(arch, on, num_gpus, embedding_on_device)) and not fits_leanest(
            arch, fit_auto_settings(arch, off, budget, num_gpus, embedding_on_device, measured), budget, num_gpus,
            embedding_on_device, measured)
    return config.replace(executor=dataclasses.replace(config.executor, host_gradients=setting))


def embedding_step_on_device(setting: str, device: str, workers: int, in_reach: bool,
                             exact_state: bool = True, frozen_part: bool = False) -> bool:
    """executor.embedding_step: `device` wherever it can run, `auto` on a GPU, `host` never. It can
    run where the process of the worker that owns the embedding's gradient reaches its store memory
    (in process, or shared memory on its node: not over the network); with several data-parallel
    workers that owner steps it and sends the new weights to the others (`workers` changes nothing).
    Lean optimizer state (optim.master/optim.moments: `exact_state` False) steps on the host only:
    the device step moves and updates fp32 state (config validation refuses `device` with it). An
    embedding layer with a frozen part (an image-text model's vision tower), whose moments the store
    does not hold, steps on the host too."""
    if frozen_part and setting == "device":
        raise PlanError("executor.embedding_step is 'device' but the embedding layer holds a frozen vision tower, "
                        "which has no optimizer state to step there; set it to auto or host, or "
                        "model.train_vision: true")
    if setting == "host" or (setting == "auto" and (device != "cuda" or not exact_state or frozen_part)):
        return False
    if setting == "device" and not in_reach:
        raise PlanError("executor.embedding_step is 'device' but the embedding's step cannot run on the device "
                        "with its store on another node; set it to auto or host")
    return in_reach


def choose_offload(arch: ModelArch, config: Config, free_bytes: int, num_gpus: int = 1,
                   embedding_on_device: bool = False, measured: float = 0.0) -> bool:
    """executor.offload_activations: on, off, or (auto) only when the step does not fit otherwise."""
    mode = config.executor.offload_activations
    if mode != "auto":
        return mode == "on"
    wanted = min(config.executor.keep_graphs or 0, num_blocks(arch))  # an auto count fills what is left later
    plan = gpu_plan(arch, config, num_gpus=num_gpus, kept=wanted, embedding_on_device=embedding_on_device,
                    measured=measured)
    return plan.total > AUTO_OFFLOAD_MARGIN * free_bytes


def choose_kept(arch: ModelArch, config: Config, free_bytes: int | None, num_gpus: int = 1, offload: bool = False,
                embedding_on_device: bool = False, measured: float = 0.0) -> int:
    """executor.keep_graphs: as set, or (null) as many of the last blocks as the memory the step
    (with `offload` as decided) leaves free holds, under the same margin as offloading; none
    without a GPU (`free_bytes` None)."""
    wanted = config.executor.keep_graphs
    if wanted is not None:
        return min(wanted, num_blocks(arch))
    if free_bytes is None:
        return 0
    rest = AUTO_OFFLOAD_MARGIN * free_bytes - gpu_plan(arch, config, offload, num_gpus,
                                                       embedding_on_device=embedding_on_device, measured=measured).total
    return max(0, min(num_blocks(arch), int(rest // kept_graph_bytes(arch, config, num_gpus, measured))))


def device_budget(free_bytes: int | None, config: Config) -> int | None:
    """The device memory a step is planned against: what the GPU has free, or executor.gpu_memory_gib
    where that is less (the worker's allocator is then held to it: runtime/worker.py)."""
    cap = config.executor.gpu_memory_gib
    if free_bytes is None or cap is None:
        return free_bytes
    return min(free_bytes, int(cap * GiB))


def leanest_plan(arch: ModelArch, config: Config, num_gpus: int = 1, embedding_on_device: bool = False,
                 measured: float = 0.0) -> GpuPlan:
    """The step's memory with what the plan may still give up given up: the activations parked
    (unless executor.offload_activations is off) and no kept graphs (unless executor.keep_graphs
    asks for some)."""
    offload = config.executor.offload_activations != "off"
    kept = min(config.executor.keep_graphs or 0, num_blocks(arch))
    return gpu_plan(arch, config, offload, num_gpus, kept, embedding_on_device, measured)


def fits_leanest(arch: ModelArch, config: Config, budget: int, num_gpus: int = 1,
                 embedding_on_device: bool = False, measured: float = 0.0) -> bool:
    return leanest_plan(arch, config, num_gpus, embedding_on_device, measured).total <= AUTO_OFFLOAD_MARGIN * budget


def fit_auto_settings(arch: ModelArch, config: Config, budget: int, num_gpus: int = 1,
                      embedding_on_device: bool = False, measured: float = 0.0) -> Config:
    """`config` with the settings the user left on auto (null) chosen: their defaults, or, where the
    step does not fit the GPU's `budget` even with its activations parked and no graph kept, the
    loss chunk halved first (down to SMALLEST_LOSS_CHUNK), then the MLP chunk (down to
    SMALLEST_MLP_CHUNK), then one weight slot fewer (down to FEWEST_SLOTS); then the loss chunk
    doubled back as far as what the later ones gave up leaves room for (each loss chunk runs the
    head's whole weight once more, and sends its gradient to the host once more where it is summed
    there). A value the user set stays as set."""
    planned = with_auto_settings(config)
    for knob in ("loss_chunk_tokens", "mlp_chunk_tokens", "num_slots"):
        if getattr(config.executor, knob) is not None:
            continue
        while not fits_leanest(arch, planned, budget, num_gpus, embedding_on_device, measured):
            less = smaller(arch, planned, knob)
            if less is None:
                break
            planned = planned.replace(executor=dataclasses.replace(planned.executor, **{knob: less}))
    if config.executor.loss_chunk_tokens is None:
        while planned.executor.loss_chunk_tokens < loss_chunk_setting(config):
            more = planned.replace(executor=dataclasses.replace(planned.executor,
                                                                loss_chunk_tokens=2 * planned.executor.loss_chunk_tokens))
            if not fits_leanest(arch, more, budget, num_gpus, embedding_on_device, measured):
                break
            planned = more
    return planned


def smaller(arch: ModelArch, config: Config, knob: str) -> int | None:
    """The next smaller value of an executor setting that fit_auto_settings chooses (None: at its least)."""
    mb_tokens = config.train.micro_batch_size * config.data.seq_len
    if knob == "loss_chunk_tokens":
        less = min(loss_chunk_setting(config), mb_tokens) // 2
        return less if less >= SMALLEST_LOSS_CHUNK else None
    if knob == "mlp_chunk_tokens":
        less = mlp_chunk_tokens(arch, mb_tokens, config) // 2
        return less if less >= SMALLEST_MLP_CHUNK else None
    less = num_slots_setting(config) - 1
    return less if less >= FEWEST_SLOTS else None


def gpu_memory(arch: ModelArch, config: Config, free_bytes: int, num_gpus: int = 1,
               embedding_on_device: bool = False, measured: float = 0.0) -> GpuPlan:
    """A GPU's memory for the step (`config` with its auto settings chosen: fit_auto_settings): offloading
    decided, then the kept blocks with it (the step plan's decisions: planning/step_plan.py calls
    it, once); `measured`: the working set a token the workers measured (memory.layer_working_set)."""
    offload = choose_offload(arch, config, free_bytes, num_gpus, embedding_on_device, measured)
    kept = choose_kept(arch, config, free_bytes, num_gpus, offload, embedding_on_device, measured)
    return gpu_plan(arch, config, offload, num_gpus, kept, embedding_on_device, measured)


def check_gpu_fit(plan: GpuPlan, free_bytes: int, where: str, capped: bool = False) -> None:
    """Refuse a step the GPU cannot hold, with what to change; `capped`: `free_bytes` is
    executor.gpu_memory_gib, less than the GPU has free."""
    if plan.total <= free_bytes:
        return
    acts = plan.by_use[BOUNDARY]
    kept = (f", fewer blocks keeping their forward graphs (executor.keep_graphs: {plan.by_use[KEPT] / GiB:.1f} GiB)"
            if plan.by_use[KEPT] else "")
    tower = plan.by_use.get(TRAINED_VISION, 0)
    if tower:
        kept += f", the vision tower frozen (model.train_vision: false; trained, it takes {tower / GiB:.1f} GiB)"
    has = (f"may use {free_bytes / GiB:.1f} GiB of {where} (executor.gpu_memory_gib; it fits under "
           f"{math.ceil(10 * plan.total / GiB) / 10:.1f} GiB as planned here)" if capped
           else f"{where} has {free_bytes / GiB:.1f} GiB free")
    raise PlanError(
        f"the step needs about {plan.total / GiB:.1f} GiB of GPU memory but {has} "
        f"({format_gpu_plan(plan, inline=True)}). Fewer tokens per micro-batch "
        f"(train.micro_batch_size, data.seq_len) or fewer micro-batches per step (train.grad_accum: the boundary "
        f"activations are {acts / GiB:.1f} GiB{', offloaded to host memory already' if plan.offload else ''}){kept}, a "
        f"smaller executor.loss_chunk_tokens, or executor.mlp_chunk_tokens for long sequences"
    )


def host_memory(arch: ModelArch, config: Config, num_gpus: int = 1) -> GpuPlan:
    """A CPU worker's memory for the step: what a GPU would hold (slots, activations, the loss chunk)."""
    return gpu_plan(arch, config, num_gpus=num_gpus, kept=choose_kept(arch, config, None, num_gpus))


def check_host_fit(plan: GpuPlan, headroom_bytes: int, where: str, num_gpus: int = 1) -> None:
    """The executor on the CPU keeps its step's memory in host memory beside the stores: refuse a
    step Ray's memory monitor would kill instead. With several CPU workers on the node, all of theirs."""
    if plan.total * num_gpus <= headroom_bytes:
        return
    raise PlanError(
        f"the step needs about {num_gpus * plan.total / GiB:.1f} GiB of memory for the CPU executor"
        f"{f' ({num_gpus} workers)' if num_gpus > 1 else ''} but {where} can give "
        f"{headroom_bytes / GiB:.1f} GiB beside the stores before Ray's memory monitor steps in "
        f"({format_gpu_plan(plan, inline=True)}). Fewer tokens per micro-batch (train.micro_batch_size, "
        f"data.seq_len) or fewer micro-batches per step (train.grad_accum: the boundary activations are "
        f"{plan.by_use[BOUNDARY] / GiB:.1f} GiB), or a smaller executor.loss_chunk_tokens"
    )
