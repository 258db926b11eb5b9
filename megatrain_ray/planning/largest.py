"""The largest model a machine trains: for each optimizer state mode, the largest model preset
whose state its host memory holds and whose step its GPU holds (under executor.gpu_memory_gib), at
the config's step shape, with the step plan's choices for it. Every preset is planned through the
same plan_step as a run's (planning/step_plan.py); `megatrain-ray plan` prints it, for the cluster
Ray is connected to (api.py) and for a described one (planning/whatif.py)."""

from __future__ import annotations

import dataclasses

from megatrain_ray.config import Config, ConfigError
from megatrain_ray.models.arch import ModelArch
from megatrain_ray.models.registry import PRESETS, num_params
from megatrain_ray.objective import objective_of
from megatrain_ray.planning.placement import NAMED_MODES, NodeInfo, mode_text, plan_placement
from megatrain_ray.planning.decisions import device_budget
from megatrain_ray.planning.memory import GiB, PlanError, mlp_chunk_tokens, size
from megatrain_ray.planning.step_plan import DeviceFacts, StepPlan, plan_step


def largest_trainable(config: Config, facts: DeviceFacts, nodes: list[NodeInfo], driver_node: str) -> str:
    """The largest preset per mode on `nodes` with the GPU `facts` describe, as text (the facts'
    measured working set is the config's model's, not a preset's: it is left out)."""
    facts = dataclasses.replace(facts, measured_working_set=0.0)
    t = config.train
    gpu = device_budget(facts.free_bytes, config) / GiB
    lines = [f"the largest model preset it trains per optimizer state mode, host and {gpu:.1f} GiB of GPU memory both "
             f"(micro-batch {t.micro_batch_size} x seq {config.data.seq_len}, {objective_of(config).micro_batches} "
             f"micro-batches a step):"]
    presets = sorted(((name, arch) for name, arch in PRESETS.items() if not name.startswith("tiny-")),
                     key=lambda item: num_params(item[1]), reverse=True)
    for fmt in NAMED_MODES:
        if fmt.master == "bf16" and config.model.compute_dtype != "bfloat16":
            continue  # a bf16 master is the compute copy: bf16 compute only
        if fmt.optimizer == "muon" and config.runtime.disk_dir is not None:
            continue  # the disk tier holds AdamW's moments only
        moded = config.replace(optim=dataclasses.replace(config.optim, master=fmt.master, moments=fmt.moments,
                                                         name=fmt.optimizer))
        found = next(((name, arch, step) for name, arch in presets
                      if (step := trainable_plan(arch, moded, facts, nodes, driver_node)) is not None), None)
        mode = f"  {mode_text(fmt)}: "
        if found is None:
            lines.append(mode + "none of the presets")
            continue
        name, arch, step = found
        lines.append(mode + f"{name} ({num_params(arch) / 1e9:.1f} B params): " + shape_text(arch, moded, step))
    return "\n".join(lines)


def trainable_plan(arch: ModelArch, config: Config, facts: DeviceFacts, nodes: list[NodeInfo],
                   driver_node: str) -> StepPlan | None:
    """The step plan for `arch` on `nodes`, or None where it does not fit there."""
    try:
        step = plan_step(arch, config, facts, plan_placement(arch, config, nodes, driver_node),
                         stores_allocated=False, refuse=False)
    except (ConfigError, PlanError):
        return None
    return step if step.refused is None else None


def shape_text(arch: ModelArch, config: Config, step: StepPlan) -> str:
    """The step plan's choices for one model, in a line."""
    mb_tokens = config.train.micro_batch_size * config.data.seq_len
    mlp = mlp_chunk_tokens(arch, mb_tokens, step.planned_config(config))
    return (f"peak {size(step.memory.total)}, activations "
            + ("parked in host memory" if step.offload else "on the GPU")
            + f", {step.kept} kept graph{'s' if step.kept != 1 else ''}, loss chunk "
            f"{min(step.loss_chunk_tokens, mb_tokens)} tokens, MLP "
            + (f"chunk {mlp} tokens" if mlp < mb_tokens else "unchunked") + f", {step.num_slots} weight slots"
            + (", the embedding's AdamW step on the GPU" if step.embedding_on_device else ""))
