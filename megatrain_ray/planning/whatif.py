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

from megatrain_ray.planning.memory import PlanError

from megatrain_ray.planning.prediction import HOST_ADAMW_PARAMS_PER_S, predict_step

from megatrain_ray.planning.report import describe
from megatrain_ray.config import Config, ConfigError, from_mapping, load_yaml
from megatrain_ray.models.arch import ModelArch
from megatrain_ray.planning.largest import largest_trainable
from megatrain_ray.planning.placement import GPU_NODE_RESERVE, USABLE, NodeInfo, largest_models, plan_placement, store_room
from megatrain_ray.planning.rates import Rates, named_rates, table_keys
from megatrain_ray.planning.scaling import scaling_text
from megatrain_ray.planning.traffic import StepTraffic, describe_traffic, step_traffic
from megatrain_ray.planning.step_plan import DeviceFacts, plan_step

GiB = 1024**3
GPU_NODE = "gpu-node"


@dataclass(frozen=True)
class GpuNodeSpec:
    gpu: str = "H100 80GB"  # its model: the rates table's (planning/rates.py) predict the step; no step time for another
    gpu_memory_gib: float = 80.0  # GPU memory a run may use
    host_memory_gib: float = 128.0  # the node's free host memory
    network_gbps: float = 100.0
    adamw_gparams_per_s: float = HOST_ADAMW_PARAMS_PER_S / 1e9  # for stores it holds
    disk_gib: float | None = None  # free disk under runtime.disk_dir (the disk tier); null: not checked
    disk_gbps: float | None = None  # that disk's read and write speed, GB/s (bytes, as disks are rated); null: 1 assumed


@dataclass(frozen=True)
class RamNodeSpec:
    memory_gib: float  # free memory
    network_gbps: float = 100.0
    count: int = 1
    adamw_gparams_per_s: float = HOST_ADAMW_PARAMS_PER_S / 1e9  # its AdamW rate (the H100 machine's 16 cores)
    disk_gib: float | None = None  # as the GPU node's
    disk_gbps: float | None = None


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
                      g.adamw_gparams_per_s * 1e9, **described_disk(g))]
    for r in spec.ram_nodes:
        for _ in range(r.count):
            name = f"ram-node-{len(nodes)}"
            nodes.append(NodeInfo(name, name, 0.0, True, int(r.memory_gib * GiB), r.network_gbps, r.adamw_gparams_per_s * 1e9,
                                  **described_disk(r)))
    return nodes


def described_disk(spec: GpuNodeSpec | RamNodeSpec) -> dict:
    """A described node's disk for the tier (NodeInfo's fields)."""
    return {"disk_bytes": None if spec.disk_gib is None else int(spec.disk_gib * GiB),
            "disk_read_gbs": spec.disk_gbps, "disk_write_gbs": spec.disk_gbps}


def described_facts(spec: ClusterSpec) -> DeviceFacts:
    """The described GPU as a worker would report it: its memory free, and what its node can give
    beside the GPU worker (the step plan takes the stores and the window off that)."""
    g = spec.gpu_node
    return DeviceFacts("cuda", g.gpu, int(g.gpu_memory_gib * GiB), int(USABLE * g.host_memory_gib * GiB - GPU_NODE_RESERVE))


def unknown_gpu(name: str) -> str:
    return (f"no step time: the rates table (planning/rates.py) has no GPU named {name!r}; name one of its models "
            f"({table_keys()}) as gpu_node.gpu, or pass --gpu, for a datasheet-scaled estimate")


def plan_cluster(arch: ModelArch, config: Config, spec: ClusterSpec, speeds: list[float],
                 gpu: str | None = None) -> tuple[str, bool]:
    """The plan as text, and whether the run fits; refusals are part of the text. Step times on the
    rates of `gpu` (a model of the rates table), else of the described GPU where the table knows it."""
    lines = [f"what-if: {spec.gpu_node.gpu} ({spec.gpu_node.gpu_memory_gib:g} GiB) on a node with "
             f"{spec.gpu_node.host_memory_gib:g} GiB free"
             + "".join(f", {r.count} x {r.memory_gib:g} GiB RAM node at {r.network_gbps:g} Gbit/s" for r in spec.ram_nodes)]
    try:
        lines.append(largest_models(store_room(arch, config, cluster_nodes(spec), GPU_NODE), config))
        lines.append(largest_trainable(config, described_facts(spec), cluster_nodes(spec), GPU_NODE))
        # the run's own decisions (planning/step_plan.py) on the described GPU
        step = plan_step(arch, config, described_facts(spec), plan_placement(arch, config, cluster_nodes(spec), GPU_NODE),
                         stores_allocated=False, refuse=False)
    except ConfigError as e:
        return "\n".join(lines + [f"does not fit in host memory: {e}"]), False
    except PlanError as e:
        return "\n".join(lines + [f"does not fit: {e}"]), False
    lines.append(step.placement.describe(arch))
    traffic = step_traffic(arch, config, step.placement, step.kept)
    config = step.planned_config(config)
    rates = named_rates(gpu or spec.gpu_node.gpu)
    prediction = predict_step(arch, config, traffic.times(), traffic.optimizer_seconds(), rates=rates)
    if step.placement.remote_layers():  # as a live plan: a node's traffic where layers stream to the GPU node
        lines.append(describe_traffic(traffic, prediction.compute_s if rates else None))
    lines.append(describe(arch, config, step, traffic.times(), traffic.optimizer_seconds(), rates=rates,
                                  no_prediction=None if rates else unknown_gpu(gpu or spec.gpu_node.gpu)))
    if step.refused is not None:
        return "\n".join(lines + [f"does not fit: {step.refused}"]), False
    if rates is not None:
        lines.append(speed_table(arch, config, traffic, speeds, rates))
        lines.append(scaling_text(arch, config, step, traffic.times(), traffic.optimizer_seconds(), rates))
    lines.append("fits")
    return "\n".join(lines), True


def speed_table(arch: ModelArch, config: Config, traffic: StepTraffic, speeds: list[float], rates: Rates) -> str:
    """Predicted step time with every link at each speed, on the GPU's `rates`."""
    t = config.train
    tokens = t.micro_batch_size * t.grad_accum * config.data.seq_len
    rows = ["| link Gbit/s | weights in, fwd + bwd s | gradients out s | compute s | host optimizer s | step s | "
            "tokens/s | bound by |", "|---|---|---|---|---|---|---|---|"]
    for gbps in speeds:
        net = traffic.times(gbps)
        p = predict_step(arch, config, net, traffic.optimizer_seconds(), rates=rates)
        rows.append(f"| {gbps:g} | {net.forward_in_s:.1f} + {net.backward_in_s:.1f} | {net.out_s:.1f} | "
                    f"{p.compute_s:.1f} | {p.optimizer_s:.1f} | {p.step_s:.1f} | {tokens / p.step_s:,.0f} | {p.bound} |")
    return "\n".join(rows)
