"""`megatrain-ray plan CONFIG --cluster CLUSTER.yaml`: the plan for a cluster before it exists.

The description names the GPU node (its GPU and GPU memory, its host memory, its network) and the
RAM nodes (memory, network, how many); the same placement, GPU memory plan, traffic and step model
as for a live cluster then say whether the model fits and how long a step takes at each link
speed. examples/cluster-4x512.yaml is one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from megatrain_ray.planning import plan as planner
from megatrain_ray.config import Config, ConfigError, from_mapping, load_yaml
from megatrain_ray.models.arch import ModelArch
from megatrain_ray.models.registry import PRESETS, num_params
from megatrain_ray.planning.placement import (GPU_NODE_RESERVE, NAMED_MODES, USABLE, NodeInfo, largest_models,
                                              plan_placement, store_room)
from megatrain_ray.planning.traffic import StepTraffic, describe_traffic, step_traffic
from megatrain_ray.planning.step_plan import DeviceFacts, plan_step

GiB = 1024**3
GPU_NODE = "gpu-node"


@dataclass(frozen=True)
class GpuNodeSpec:
    gpu: str = "H100 80GB"  # a name for the report; the rates are the H100 machine's (planning/plan.py)
    gpu_memory_gib: float = 80.0  # GPU memory a run may use
    host_memory_gib: float = 128.0  # the node's free host memory
    network_gbps: float = 100.0
    adamw_gparams_per_s: float = planner.HOST_ADAMW_PARAMS_PER_S / 1e9  # for stores it holds


@dataclass(frozen=True)
class RamNodeSpec:
    memory_gib: float  # free memory
    network_gbps: float = 100.0
    count: int = 1
    adamw_gparams_per_s: float = planner.HOST_ADAMW_PARAMS_PER_S / 1e9  # its AdamW rate (the H100 machine's 16 cores)


@dataclass(frozen=True)
class ClusterSpec:
    gpu_node: GpuNodeSpec
    ram_nodes: tuple[RamNodeSpec, ...]


def load_cluster(path: str | Path) -> ClusterSpec:
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"cluster file {path} does not exist")
    raw = load_yaml(path.read_text()) or {}
    if not isinstance(raw, dict) or set(raw) - {"gpu_node", "ram_nodes"}:
        raise ConfigError(f"{path}: a cluster description has the keys gpu_node and ram_nodes, got {raw!r:.200}")
    gpu = from_mapping(GpuNodeSpec, raw.get("gpu_node") or {}, "gpu_node")
    if not isinstance(raw.get("ram_nodes") or [], list):
        raise ConfigError(f"{path}: ram_nodes must be a list of {{memory_gib, network_gbps, count}}")
    rams = tuple(from_mapping(RamNodeSpec, r, f"ram_nodes[{k}]") for k, r in enumerate(raw.get("ram_nodes") or []))
    for spec in (gpu, *rams):
        for f in dataclasses.fields(spec):
            value = getattr(spec, f.name)
            if isinstance(value, (int, float)) and value <= 0:
                raise ConfigError(f"{path}: {f.name} must be positive, got {value}")
    return ClusterSpec(gpu, rams)


def cluster_nodes(spec: ClusterSpec) -> list[NodeInfo]:
    g = spec.gpu_node
    nodes = [NodeInfo(GPU_NODE, GPU_NODE, 1.0, False, int(g.host_memory_gib * GiB), g.network_gbps,
                      g.adamw_gparams_per_s * 1e9)]
    for r in spec.ram_nodes:
        for _ in range(r.count):
            name = f"ram-node-{len(nodes)}"
            nodes.append(NodeInfo(name, name, 0.0, True, int(r.memory_gib * GiB), r.network_gbps, r.adamw_gparams_per_s * 1e9))
    return nodes


def described_facts(spec: ClusterSpec) -> DeviceFacts:
    """The described GPU as a worker would report it: its memory free, and what its node can give
    beside the GPU worker (the step plan takes the stores and the window off that)."""
    g = spec.gpu_node
    return DeviceFacts("cuda", g.gpu, int(g.gpu_memory_gib * GiB), int(USABLE * g.host_memory_gib * GiB - GPU_NODE_RESERVE))


def plan_cluster(arch: ModelArch, config: Config, spec: ClusterSpec, speeds: list[float]) -> tuple[str, bool]:
    """The plan as text, and whether the run fits; refusals are part of the text."""
    lines = [f"what-if: {spec.gpu_node.gpu} ({spec.gpu_node.gpu_memory_gib:g} GiB) on a node with "
             f"{spec.gpu_node.host_memory_gib:g} GiB free"
             + "".join(f", {r.count} x {r.memory_gib:g} GiB RAM node at {r.network_gbps:g} Gbit/s" for r in spec.ram_nodes)]
    try:
        lines.append(largest_models(store_room(arch, config, cluster_nodes(spec), GPU_NODE), config))
        lines.append(largest_trainable(config, spec))
        # the run's own decisions (planning/step_plan.py) on the described GPU
        step = plan_step(arch, config, described_facts(spec), plan_placement(arch, config, cluster_nodes(spec), GPU_NODE),
                         stores_allocated=False, refuse=False)
    except ConfigError as e:
        return "\n".join(lines + [f"does not fit in host memory: {e}"]), False
    except planner.PlanError as e:
        return "\n".join(lines + [f"does not fit: {e}"]), False
    lines.append(step.placement.describe(arch))
    traffic = step_traffic(arch, config, step.placement, step.kept)
    config = step.planned_config(config)
    prediction = planner.predict_step(arch, config, traffic.times(), traffic.optimizer_seconds())
    lines.append(describe_traffic(traffic, prediction.compute_s))
    lines.append(planner.describe(arch, config, step, traffic.times(), traffic.optimizer_seconds()))
    if step.refused is not None:
        return "\n".join(lines + [f"does not fit: {step.refused}"]), False
    lines.append(speed_table(arch, config, traffic, speeds))
    lines.append("fits")
    return "\n".join(lines), True


def largest_trainable(config: Config, spec: ClusterSpec) -> str:
    """The largest model preset each optimizer state mode trains on the described cluster, its host
    memory and its GPU's (with executor.gpu_memory_gib) both, at the config's step shape, with the
    step plan's choices for it: the same plan_step as a run's."""
    t, nodes = config.train, cluster_nodes(spec)
    cap = config.executor.gpu_memory_gib
    gpu = min(spec.gpu_node.gpu_memory_gib, cap) if cap is not None else spec.gpu_node.gpu_memory_gib
    lines = [f"the largest model preset it trains per optimizer state mode, host and {gpu:g} GiB of GPU memory both "
             f"(micro-batch {t.micro_batch_size} x seq {config.data.seq_len}, {t.grad_accum} micro-batches a step):"]
    presets = sorted(((name, arch) for name, arch in PRESETS.items() if not name.startswith("tiny-")),
                     key=lambda item: num_params(item[1]), reverse=True)
    for fmt in NAMED_MODES:
        if fmt.master == "bf16" and config.model.compute_dtype != "bfloat16":
            continue  # a bf16 master is the compute copy: bf16 compute only
        moded = config.replace(optim=dataclasses.replace(config.optim, master=fmt.master, moments=fmt.moments))
        found = next(((name, arch, step) for name, arch in presets
                      if (step := trainable_plan(arch, moded, spec, nodes)) is not None), None)
        mode = f"  optim.master={fmt.master} optim.moments={fmt.moments}: "
        if found is None:
            lines.append(mode + "none of the presets")
            continue
        name, arch, step = found
        lines.append(mode + f"{name} ({num_params(arch) / 1e9:.1f} B params): " + shape_text(arch, moded, step))
    return "\n".join(lines)


def trainable_plan(arch: ModelArch, config: Config, spec: ClusterSpec, nodes: list[NodeInfo]):
    """The step plan for `arch` on the described cluster, or None where it does not fit there."""
    try:
        step = plan_step(arch, config, described_facts(spec), plan_placement(arch, config, nodes, GPU_NODE),
                         stores_allocated=False, refuse=False)
    except (ConfigError, planner.PlanError):
        return None
    return step if step.refused is None else None


def shape_text(arch: ModelArch, config: Config, step) -> str:
    """The step plan's choices for one model, in a line."""
    mb_tokens = config.train.micro_batch_size * config.data.seq_len
    mlp = planner.mlp_chunk_tokens(arch, mb_tokens, step.planned_config(config))
    return (f"peak {planner.size(step.memory.total)}, activations "
            + ("parked in host memory" if step.offload else "on the GPU")
            + f", {step.kept} kept graph{'s' if step.kept != 1 else ''}, loss chunk "
            f"{min(step.loss_chunk_tokens, mb_tokens)} tokens, MLP "
            + (f"chunk {mlp} tokens" if mlp < mb_tokens else "unchunked") + f", {step.num_slots} weight slots"
            + (", the embedding's AdamW step on the GPU" if step.embedding_on_device else ""))


def speed_table(arch: ModelArch, config: Config, traffic: StepTraffic, speeds: list[float]) -> str:
    """Predicted step time with every link at each speed."""
    t = config.train
    tokens = t.micro_batch_size * t.grad_accum * config.data.seq_len
    rows = ["| link Gbit/s | weights in, fwd + bwd s | gradients out s | compute s | host optimizer s | step s | "
            "tokens/s | bound by |", "|---|---|---|---|---|---|---|---|"]
    for gbps in speeds:
        net = traffic.times(gbps)
        p = planner.predict_step(arch, config, net, traffic.optimizer_seconds())
        rows.append(f"| {gbps:g} | {net.forward_in_s:.1f} + {net.backward_in_s:.1f} | {net.out_s:.1f} | "
                    f"{p.compute_s:.1f} | {p.optimizer_s:.1f} | {p.step_s:.1f} | {tokens / p.step_s:,.0f} | {p.bound} |")
    return "\n".join(rows)
