"""Where a run's layers live: a store on every node that offers the RAM resource (and on the GPU
node unless told not to), each a contiguous range of layers in proportion to its free memory (or to
what the user states a store may take: runtime.store_memory_gib); how many GPU workers run on the
GPU node (runtime.num_gpus, default every GPU there); and each worker's window of pinned slots on
the GPU node for the layers that live on other nodes.

Raylets on one machine (one IP) share its memory: they are counted once. Pure arithmetic on what
runtime/cluster.py found (or on a described cluster, planning/whatif.py), so it is tested without a cluster.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass

import torch

from megatrain_ray.config import Config, ConfigError, RuntimeConfig, check_divisible
from megatrain_ray.host.memory import dtype_of, element_size
from megatrain_ray.models.arch import ModelArch
from megatrain_ray.models.registry import how_it_runs, model_layouts, num_params, params_text
from megatrain_ray.objective import objective_of
from megatrain_ray.host.precision import StateFormat, format_of
from megatrain_ray.host.store import bytes_per_param, layer_bytes
from megatrain_ray.host.window import window_bytes
from megatrain_ray.host.disk import (compute_bytes, compute_parts, compute_window_bytes, disk_bytes, file_bytes,
                                     layer_parts, send_bytes, window_bytes as disk_window_bytes)
from megatrain_ray.host.transport import TURN_LAYER
from megatrain_ray.planning.memory import host_parking, num_slots_setting
from megatrain_ray.planning.prediction import TRANSPORT_CORES

GiB = 1024**3
USABLE = 0.9  # of a machine's free memory, for the run's host state
GPU_NODE_RESERVE = 2 * GiB  # each GPU worker's own host memory: CUDA context, torch, batches
WINDOW_SHARE = 0.5  # of the GPU machine's spare memory an automatic window may take (the rest: parked activations, slack)
DISK_GBS = 1.0  # GB/s read and write assumed for a disk tier whose speed is not known (a described node without disk_gbps)


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    ip: str
    gpus: float
    ram_node: bool
    free_bytes: int
    gbps: float | None = None  # link speed, where known (a described cluster); else runtime.network_gbps
    adamw_params_per_s: float | None = None  # host optimizer rate, where known; else the measured one
    cpus: float = 0.0  # the CPUs Ray counts on the node (`ray start --num-cpus`, default all its cores); 0: not known
    disk_bytes: int | None = None  # free under runtime.disk_dir there (probed, or a described cluster's disk_gib); None: not known
    disk_read_gbs: float | None = None  # that disk's read speed, GB/s (probed, or disk_gbps); None: DISK_GBS assumed
    disk_write_gbs: float | None = None  # its write speed, GB/s


@dataclass(frozen=True)
class StorePlan:
    node: NodeInfo
    layers: tuple[int, ...]
    host_bytes: int
    capacity: float = 0.0  # bytes the store may take on its node (stated, or its share of the machine's usable memory)
    threads: int | None = None  # its host optimizer's (store_threads); None: a described node whose cores are not known
    disk_layers: tuple[int, ...] = ()  # layers whose optimizer state lives in the disk tier (host/disk.py)
    disk_bytes: int = 0  # their files' bytes under runtime.disk_dir (the compute copies' among them)
    disk_compute_layers: tuple[int, ...] = ()  # of those, the layers whose compute copy is on disk too (streamed over the store's link)
    disk_compute_bytes: int = 0  # the compute copies' files
    disk_send_bytes: int = 0  # what a send of each of them reads of its file: the copy alone (host/disk.py, send_bytes)

    def disk_update_bytes(self) -> int:
        """Bytes each way of a step's updates: every file read once before its layer's update and
        written once after (at most: a buffer of the window that still holds the layer spares a read)."""
        return self.disk_bytes

    def disk_step_bytes(self) -> tuple[int, int]:
        """(read, written) bytes a step where the disk binds it, which is where its seconds count: the
        updates' (`disk_update_bytes`), and for a layer fully on disk its copy read once more, for the
        backward's send (`disk_send_bytes`), and its file written once more, after its gradient's
        landing. The other reads are spared (host/disk.py): the next forward's send follows the
        layer's update, for which the GPU worker's request already waits, and finds its buffer; the
        landing overwrites its part whole and reads nothing. Where the GPU binds instead, a forward
        that asks later finds the buffer taken and reads the copy again (hidden behind compute)."""
        update = self.disk_update_bytes()
        return update + self.disk_send_bytes, update + self.disk_compute_bytes

    def disk_seconds(self) -> float:
        """A step's disk time: its reads and writes (`disk_step_bytes`) at the disk's speeds."""
        read, written = self.disk_step_bytes()
        return (read / ((self.node.disk_read_gbs or DISK_GBS) * 1e9)
                + written / ((self.node.disk_write_gbs or DISK_GBS) * 1e9))


@dataclass(frozen=True)
class Placement:
    gpu: NodeInfo
    use_cuda: bool
    stores: tuple[StorePlan, ...]
    bytes_per_param: float
    window_slots: int = 0  # pinned slots per layer size, each GPU worker's, for remote layers; 0: none remote (or not yet planned)
    window_bytes: int = 0  # what they (and the gradient outboxes) take on the GPU node, all workers together
    gpu_spare: float = 0.0  # the GPU machine's usable memory beside its workers and stores: windows and parked activations
    num_gpus: int = 1  # workers on the GPU node, data parallel over a step's micro-batches (CPU workers without CUDA)
    stated_memory: bool = False  # store capacities come from runtime.store_memory_gib
    state_format: StateFormat = StateFormat()  # optim.master, optim.moments
    compute_bytes: int = 2  # a weight of the compute copy
    idle_gpus: int = 0  # the node's GPUs no worker takes: a step's micro-batches split evenly over fewer
    train_vision: bool = False  # model.train_vision: an image-text model's vision tower trains (the model line)

    def remote_layers(self) -> list[int]:
        """Layers the GPU worker streams through its window over a store's link: those of stores on
        other nodes, and those whose compute copy is on disk (a store on its own node serves them too)."""
        return [i for s in self.stores for i in (s.layers if s.node.node_id != self.gpu.node_id else s.disk_compute_layers)]

    def disk_seconds(self) -> float:
        """The slowest store's disk time a step (stores on one machine share its disk: summed)."""
        by_machine: dict[str, float] = {}
        for s in self.stores:
            by_machine[s.node.ip] = by_machine.get(s.node.ip, 0.0) + s.disk_seconds()
        return max(by_machine.values(), default=0.0)

    def gpu_machine_state(self) -> int:
        """Store state on the GPU worker's machine (its own node and raylets beside it)."""
        return sum(s.host_bytes for s in self.stores if s.node.ip == self.gpu.ip)

    def describe(self, arch: ModelArch) -> str:
        lines = [
            f"model: {arch.model_type}{how_it_runs(arch, self.train_vision)}, {arch.num_layers} blocks, "
            f"{params_text(num_params(arch))}, "
            f"{self.bytes_per_param:.4g} host bytes/param ({self.state_format.describe()})",
            f"executor on node {node_name(self.gpu)}, GPUs there: {self.gpu.gpus:g}; "
            f"{self.num_gpus} {'GPU' if self.use_cuda else 'CPU'} worker(s), data parallel" + (
                f" ({self.idle_gpus} GPU(s) left idle: a step's micro-batches split evenly over {self.num_gpus} "
                f"workers; a multiple of {self.num_gpus + self.idle_gpus} micro-batches would use them all)"
                if self.idle_gpus else ""),
        ]
        for s in self.stores:
            role = ["the GPU node" if self.use_cuda else "the executor's node"] if s.node.node_id == self.gpu.node_id else ["RAM node"] if s.node.ram_node else []
            streamed = (f", shared memory ({len(s.disk_compute_layers)} layers streamed over its link: their compute "
                        "copy is on disk)" if s.disk_compute_layers else ", shared memory")
            lines.append(
                f"store on {node_name(s.node, role)}: "
                f"layers {s.layers[0]}-{s.layers[-1]} ({len(s.layers)}), {s.host_bytes / GiB:.2f} GiB "
                + (f"of {s.capacity / GiB:.1f} GiB stated (runtime.store_memory_gib)" if self.stated_memory
                   else f"of {s.node.free_bytes / GiB:.1f} GiB free")
                + (", streamed over TCP" if s.node.node_id != self.gpu.node_id else streamed)
                + (f", AdamW on {s.threads} thread{'s' if s.threads > 1 else ''}" if s.threads else "")
            )
            if s.disk_layers:
                lines.append(disk_line(arch, s, self))
        remote = self.remote_layers()
        if remote:
            lines.append(
                f"GPU node window for the {len(remote)} remote layers: {self.window_slots} pinned slots per layer size "
                f"+ a gradient outbox{' per GPU worker' if self.num_gpus > 1 else ''}, {self.window_bytes / GiB:.2f} GiB "
                f"(a mirror{' per worker' if self.num_gpus > 1 else ''} would be "
                f"{sum(model_layouts(arch)[i].numel for i in remote) * self.compute_bytes / GiB:.2f} GiB)"
            )
        return "\n".join(lines)

    def nodes(self) -> set[str]:
        """Every node the run uses: the stores' and the executor's."""
        return {p.node.node_id for p in self.stores} | {self.gpu.node_id}


def disk_line(arch: ModelArch, s: StorePlan, placement: Placement) -> str:
    """A store's disk tier as the plan prints it: what lives where, and what it costs a step."""
    layouts = model_layouts(arch, placement.train_vision)
    params = sum(layouts[i].numel for i in s.layers)
    on_disk = sum(layouts[i].numel for i in s.disk_layers)
    esize = placement.compute_bytes
    fmt = placement.state_format
    ram_bpp = ram_bytes_per_param(layouts[s.disk_layers[-1]], fmt, esize)
    known = s.node.disk_read_gbs is not None
    speed = (f"{s.node.disk_read_gbs:.2f} GB/s read, {s.node.disk_write_gbs:.2f} GB/s write" if known else
             f"{DISK_GBS:g} GB/s read and write assumed (not known)")
    room = f" of {s.node.disk_bytes / GiB:.1f} GiB free" if s.node.disk_bytes is not None else ""
    read, written = s.disk_step_bytes()
    fully = ""
    if s.disk_compute_layers:
        layout = layouts[s.disk_compute_layers[-1]]
        dtype = torch.float32 if esize == 4 else torch.bfloat16
        fully = (f"; {len(s.disk_compute_layers)} of them ({sum(layouts[i].numel for i in s.disk_compute_layers) / 1e9:.2f} "
                 f"B params) keep their compute copy there too: a parameter of those holds 0 bytes in RAM (but the "
                 f"windows) and {(disk_bytes(layout, fmt) + file_bytes(compute_parts(layout, fmt, dtype))) / layout.numel:.4g} on disk")
    return (f"  disk tier (runtime.disk_dir): {len(s.disk_layers)} of its {len(s.layers)} layers ({on_disk / 1e9:.2f} of "
            f"{params / 1e9:.2f} B params) keep their optimizer state on disk, {s.disk_bytes / GiB:.2f} GiB{room}; "
            f"a parameter there holds {ram_bpp:.4g} bytes in RAM and {fmt.bytes_per_param(esize) - ram_bpp:.4g} on disk{fully}; "
            f"disk {speed}: {read / 1e9:.1f} GB read and {written / 1e9:.1f} GB written a step, {s.disk_seconds():.2f} s")


def disk_layers_for(layers: list[int], layouts, held: list[float], capacity: float, fmt: StateFormat,
                    keep: tuple[int, ...] = ()) -> tuple[int, ...]:
    """The fewest layers of a store whose state, on disk, leaves the rest within `capacity` of RAM
    (the tier's window of buffers counted), the smallest first, then from the last layer back; never those of `keep`
    (the embedding where a GPU may step it). () when none needs to go; all the others when even that
    is short (the caller refuses with the figure)."""
    saved = {i: sum(p.nbytes for p in layer_parts(layouts[i], fmt)) for i in layers if i not in keep}
    return fewest_on_disk(saved, sum(held[i] for i in layers), capacity,
                          lambda chosen: tier_window_bytes(chosen, layouts, fmt))


def disk_compute_layers_for(layers: tuple[int, ...], layouts, ram: float, capacity: float, fmt: StateFormat,
                            dtype) -> tuple[int, ...]:
    """Of a store's layers whose optimizer state is on disk (`layers`), the fewest whose compute copy
    (and a bf16 master's gradient buffer) goes there too for the rest, `ram` bytes, to fit `capacity`
    with the windows' buffers; never the embedding (the step's turn: host/transport.py, TURN_LAYER)."""
    saved = {i: compute_bytes(layouts[i], fmt, dtype) for i in layers if i != TURN_LAYER}
    return fewest_on_disk(saved, ram, capacity,
                          lambda chosen: compute_window_bytes([layouts[i] for i in chosen], fmt, dtype))


def fewest_on_disk(saved: dict[int, float], ram: float, capacity: float, window_of) -> tuple[int, ...]:
    """The fewest of these layers (`saved`: the RAM each frees on disk) that leave `ram` with the
    window's buffers (`window_of(chosen)`) within `capacity`: the smallest first (the window's buffers
    fit the largest), then from the last layer back; all of them when even that is short."""
    chosen: list[int] = []
    for i in sorted(saved, key=lambda i: (saved[i], -i)):
        if ram + window_of(chosen) <= capacity:
            break
        chosen.append(i)
        ram -= saved[i]
    return tuple(sorted(chosen))


def with_host_gradients_possible(config: Config) -> Config:
    """`config` as the step plan may still run it: executor.host_gradients left null may turn on
    (choose_host_gradients), so the room a store leaves on the GPU machine counts its pinned sums too."""
    if config.executor.host_gradients is not None:
        return config
    return config.replace(executor=dataclasses.replace(config.executor, host_gradients=True))


def ram_bytes_per_param(layout, fmt: StateFormat, esize: int) -> float:
    """Host RAM a parameter of a layer in the disk tier still takes: its compute copy (and a bf16
    master's gradient buffer)."""
    return fmt.bytes_per_param(esize) - sum(p.nbytes for p in layer_parts(layout, fmt)) / layout.numel


def tier_window_bytes(disk_layers, layouts, fmt: StateFormat) -> int:
    return disk_window_bytes([layouts[i] for i in disk_layers], fmt)


def node_name(node: NodeInfo, notes: list[str] = ()) -> str:
    """A node as the plan names it: its address, with its id's start where it has one apart from
    its name (a described node has only a name) and `notes`, in parentheses when there are any."""
    ident = [] if node.node_id == node.ip else [node.node_id[:8]]
    return f"{node.ip} ({', '.join(ident + list(notes))})" if ident or notes else node.ip


def split_by_capacity(numels: list[int], capacities: list[float]) -> list[list[int]]:
    """Contiguous layer ranges whose sizes follow the capacities; every store gets a layer when it can."""
    total, cap_total = sum(numels), sum(capacities)
    ranges, start, acc = [], 0, 0
    for k, cap in enumerate(capacities):
        if k == len(capacities) - 1:
            end = len(numels)
        else:
            goal = total * sum(capacities[: k + 1]) / cap_total
            end = start
            while end < len(numels) - (len(capacities) - 1 - k) and (end == start or acc + numels[end] / 2 <= goal):
                acc += numels[end]
                end += 1
        ranges.append(list(range(start, end)))
        start = end
    return ranges


def store_threads(node: NodeInfo, gpu: NodeInfo, workers: int, rt: RuntimeConfig) -> int | None:
    """A store's host optimizer threads: runtime.optimizer_threads, else the CPUs Ray counts on its node
    less those its node's other work needs: on the GPU node one, and one per GPU worker; on a RAM node
    its links' (TRANSPORT_CORES). Several raylets on one machine each count their own CPUs (the
    benchmark's --ram-nodes gives each its share), so their stores never take the same cores twice."""
    if rt.optimizer_threads is not None:
        return rt.optimizer_threads
    if not node.cpus:
        return None
    reserved = 1 + workers if node.node_id == gpu.node_id else TRANSPORT_CORES
    return max(1, int(node.cpus) - reserved)


def executor_node(nodes: list[NodeInfo], want_cuda: bool, driver_node: str, num_gpus: int | None = None,
                  rollout_gpus: int = 0) -> NodeInfo:
    """The node that runs the workers: the first with the GPUs asked for (one, without
    runtime.num_gpus) and `rollout_gpus` more for a GRPO run's rollout (`rollout_gpus`), else the
    driver's own node (the CPU path)."""
    if want_cuda:
        with_gpu = [n for n in nodes if n.gpus >= (num_gpus or 1) + rollout_gpus]
        if with_gpu:
            return with_gpu[0]
        if rollout_gpus and any(n.gpus >= 1 for n in nodes):
            raise ConfigError(f"grpo.rollout_gpu=own needs {rollout_gpus} GPU(s) for the rollout beside the workers' "
                              f"({(num_gpus or 1) + rollout_gpus} on one node) but the most on one node of the Ray "
                              f"cluster is {max(n.gpus for n in nodes):g}: set grpo.rollout_gpu=shared, fewer "
                              f"grpo.rollout_gpus or fewer runtime.num_gpus")
        if num_gpus and any(n.gpus >= 1 for n in nodes):
            raise ConfigError(f"runtime.num_gpus={num_gpus} but no node of the Ray cluster offers that many GPUs "
                              f"(the most on one node: {max(n.gpus for n in nodes):g}); GPU workers run on one node")
    return next(n for n in nodes if n.node_id == driver_node)


def worker_count(rt: RuntimeConfig, gpu: NodeInfo, use_cuda: bool, rollout_gpus: int = 0,
                 micro_batches: int = 1) -> int:
    """runtime.num_gpus, else as many of the node's GPUs but the rollout's as split a step's
    `micro_batches` evenly (every worker takes an equal share: streaming/data_parallel.py); without
    CUDA, that many CPU workers (default 1)."""
    if rt.num_gpus is not None:
        return rt.num_gpus
    free = max(1, int(gpu.gpus) - rollout_gpus) if use_cuda else 1
    return max(n for n in range(1, free + 1) if micro_batches % n == 0)


def machine_memory(nodes: list[NodeInfo]) -> dict[str, int]:
    """Free memory per machine: raylets on one IP read the same /proc/meminfo, so count it once."""
    free: dict[str, int] = {}
    for n in nodes:
        free[n.ip] = max(free.get(n.ip, 0), n.free_bytes)
    return free


def stated_machines(free: dict[str, int], sharing: Counter, rt: RuntimeConfig) -> dict[str, float]:
    """Each machine's memory: what it reads free, or with runtime.store_memory_gib at least what the
    stores on it are stated to take (a machine whose memory grows as it is used reads too little)."""
    if rt.store_memory_gib is None:
        return dict(free)
    return {ip: max(f, sharing[ip] * rt.store_memory_gib * GiB / USABLE) for ip, f in free.items()}


@dataclass(frozen=True)
class StoreRoom:
    """The nodes that hold stores and what each may take, before any layer is placed."""

    gpu: NodeInfo
    use_cuda: bool
    workers: int
    holders: list[NodeInfo]
    capacities: list[float]
    machines: dict[str, float]  # each machine's memory (free, or as stated)
    reserve: float  # held back on the GPU machine: its workers and their least windows
    streams: bool  # some store is on another node than the GPU workers
    idle_gpus: int = 0  # the node's GPUs that neither a worker nor the rollout takes


def store_room(arch: ModelArch, config: Config, nodes: list[NodeInfo], driver_node: str) -> StoreRoom:
    rt = config.runtime
    cluster_has_gpu = any(n.gpus >= 1 for n in nodes)
    if config.executor.device == "cuda" and not cluster_has_gpu:
        raise ConfigError("executor.device is 'cuda' but no node of the Ray cluster offers a GPU; "
                          "set executor.device=auto (or cpu) to run the CPU path")
    use_cuda = cluster_has_gpu and config.executor.device != "cpu"
    objective = objective_of(config)
    rollout = objective.rollout_gpus(use_cuda)
    gpu = executor_node(nodes, use_cuda, driver_node, rt.num_gpus, rollout)
    workers = worker_count(rt, gpu, use_cuda, rollout, objective.micro_batches)
    check_divisible(objective.micro_batches, workers)
    holders = [n for n in nodes if n.ram_node and n.node_id != gpu.node_id]
    if rt.store_on_gpu_node or not holders:
        holders = [gpu] + holders
    numels = [layout.numel for layout in model_layouts(arch)]
    esize = element_size(dtype_of(config.model.compute_dtype))
    streams = any(n.node_id != gpu.node_id for n in holders)
    least_window = workers * window_bytes(numels, least_slots(config), esize) if streams else 0
    reserve = workers * GPU_NODE_RESERVE + least_window
    sharing = Counter(n.ip for n in holders)
    machines = stated_machines(machine_memory(holders + [gpu]), sharing, rt)
    usable = {ip: USABLE * free for ip, free in machines.items()}
    usable[gpu.ip] -= reserve
    capacities = ([rt.store_memory_gib * GiB] * len(holders) if rt.store_memory_gib is not None else
                  [max(0.0, usable[n.ip]) / sharing[n.ip] for n in holders])
    idle = int(gpu.gpus) - rollout - workers if use_cuda and rt.num_gpus is None else 0
    return StoreRoom(gpu, use_cuda, workers, holders, capacities, machines, reserve, streams, max(0, idle))


NAMED_MODES = (StateFormat("fp32", "fp32"), StateFormat("fp32", "bf16"), StateFormat("fp32", "int8"),
               StateFormat("bf16", "int8"),  # AdamW: 14, 10, 8 and 6 bytes a parameter (with bf16 compute)
               StateFormat("fp32", "fp32", "muon"), StateFormat("fp32", "bf16", "muon"),
               StateFormat("bf16", "bf16", "muon"))  # Muon: 10, 8 and 6 a block matrix's (host/muon.py)


def mode_text(fmt: StateFormat) -> str:
    """A state mode as the settings that choose it."""
    return (f"optim.name={fmt.optimizer} " if fmt.optimizer != "adamw" else "") + \
        f"optim.master={fmt.master} optim.moments={fmt.moments}"


def fewer_bytes_text(fmt: StateFormat) -> str:
    """The leanest state mode of `fmt`'s optimizer, as advice (none where `fmt` is it)."""
    leanest = {"adamw": StateFormat("bf16", "int8"), "muon": StateFormat("bf16", "bf16", "muon")}[fmt.optimizer]
    if fmt == leanest:
        return ""
    what = "a parameter" if fmt.optimizer == "adamw" else "a block matrix's parameter"
    return (f"hold the optimizer state in fewer bytes (optim.master: bf16, optim.moments: {leanest.moments}: "
            f"{leanest.bytes_per_param(2):.0f} bytes {what}), ")


def mean_bytes_per_param(arch: ModelArch, config: Config, fmt: StateFormat) -> float:
    """Host bytes a parameter of this model in `fmt`, over all its layers: with Muon a block matrix's
    and the AdamW tensors' (the embedding, the head) differ, so the mean is the model's."""
    layouts = model_layouts(arch, config.model.train_vision)
    dtype = dtype_of(config.model.compute_dtype)
    return sum(layer_bytes(layout, dtype, fmt) for layout in layouts) / sum(layout.numel for layout in layouts)


def largest_models(room: StoreRoom, config: Config) -> str:
    """The largest model the stores' memory holds in each optimizer state mode, as text: what
    choosing a lean mode (optim.master, optim.moments) buys on this cluster."""
    capacity = sum(room.capacities)
    esize = element_size(dtype_of(config.model.compute_dtype))
    lines = [f"host memory for the stores: {capacity / GiB:.1f} GiB; the largest dense model per optimizer state mode "
             "(Muon's: a decoder block's matrices; the embedding and head take AdamW's bytes):"]
    for fmt in NAMED_MODES:
        if fmt.master == "bf16" and esize != 2:
            continue  # a bf16 master is the compute copy: bf16 compute only
        if fmt.optimizer == "muon" and config.runtime.disk_dir is not None:
            continue  # the disk tier holds AdamW's moments only
        bpp = fmt.bytes_per_param(esize)
        chosen = " (this config)" if fmt == format_of(config.optim) else ""
        lines.append(f"  {mode_text(fmt)}: {bpp:.4g} bytes/param -> "
                     f"{capacity / bpp / 1e9:.1f} B params{chosen}" + with_disk_text(room, config, fmt, esize))
    return "\n".join(lines)


def with_disk_text(room: StoreRoom, config: Config, fmt: StateFormat, esize: int) -> str:
    """What the disk tier adds to a mode's largest model: RAM and the disk together hold its state
    (a layer's compute copy goes to disk too where RAM is short: `disk_compute_layers_for`); the
    windows and the embedding's state left out. Without a known disk, the disk it would take to
    double RAM's."""
    if config.runtime.disk_dir is None:
        return ""
    bpp = fmt.bytes_per_param(esize)
    ram = sum(room.capacities)
    disks = {n.ip: n.disk_bytes for n in room.holders}
    if any(d is None for d in disks.values()):
        return f", {2 * ram / bpp / 1e9:.1f} B with the disk tier if its disk holds {ram / GiB:.0f} GiB"
    disk = sum(disks.values())
    return f", {(ram + disk) / bpp / 1e9:.1f} B with the disk tier ({disk / GiB:.0f} GiB free)"


def plan_placement(arch: ModelArch, config: Config, nodes: list[NodeInfo], driver_node: str) -> Placement:
    """The stores' layers and the GPU machine's spare memory; the window for remote layers is the
    step plan's to size (`with_window`), once it knows what parked activations take."""
    rt = config.runtime
    room = store_room(arch, config, nodes, driver_node)
    gpu, use_cuda, workers, holders, capacities = room.gpu, room.use_cuda, room.workers, room.holders, room.capacities
    numels = [layout.numel for layout in model_layouts(arch)]
    fmt = format_of(config.optim)
    bpp = (mean_bytes_per_param(arch, config, fmt) if fmt.optimizer == "muon"
           else bytes_per_param(dtype_of(config.model.compute_dtype), fmt))
    held = [layer_bytes(layout, dtype_of(config.model.compute_dtype), fmt)
            for layout in model_layouts(arch, config.model.train_vision)]
    esize = element_size(dtype_of(config.model.compute_dtype))
    stated = rt.store_memory_gib is not None
    sharing = Counter(n.ip for n in holders)
    reserve, streams = room.reserve, room.streams
    need, have = sum(held), sum(capacities)
    if need > have and rt.disk_dir is None:
        raise ConfigError(
            f"the model needs {need / GiB:.1f} GiB of host memory ({params_text(sum(numels))} x {bpp:.4g} bytes, "
            f"{fmt.describe()}) "
            + (f"but the {len(holders)} store node(s) may take {have / GiB:.1f} GiB as stated "
               f"(runtime.store_memory_gib={rt.store_memory_gib:g} each)" if stated else
               f"but the {len(holders)} store node(s) can hold {have / GiB:.1f} GiB ({USABLE:.0%} of their machines' "
               f"free memory" + (f", less {reserve / GiB:.1f} GiB on the GPU machine for the GPU "
                                 f"worker(s)" + (" and their windows of remote layers" if streams else "")
                                 if gpu.ip in sharing else "")
               + "; a machine whose memory grows as it is used reads too little free: state what a store may take "
                 "with runtime.store_memory_gib")
            + f"): short by {(need - have) / GiB:.1f} GiB; add RAM nodes with at least that much free memory between "
            f"them (ray start --resources='{{\"{rt.ram_resource}\": 1}}'), "
            + (fewer_bytes_text(fmt) if esize == 2 else "")
            + "keep the optimizer state of some layers on a local SSD (runtime.disk_dir"
            + (", with optim.name adamw" if fmt.optimizer == "muon" else "") + "), or choose a smaller model"
        )
    ranges = split_by_capacity(numels, capacities)
    stores = tuple(
        StorePlan(node, tuple(r), int(sum(held[i] for i in r)), cap, store_threads(node, gpu, workers, rt))
        for node, r, cap in zip(holders, ranges, capacities) if r
    )
    if rt.disk_dir is not None:
        stores = with_disk_tier(stores, arch, config, held, gpu.ip, workers)
    placement = Placement(gpu, use_cuda, stores, bpp, num_gpus=workers, stated_memory=stated, state_format=fmt,
                          compute_bytes=esize, idle_gpus=room.idle_gpus, train_vision=config.model.train_vision)
    spare = USABLE * room.machines[gpu.ip] - workers * GPU_NODE_RESERVE - placement.gpu_machine_state()
    return dataclasses.replace(placement, gpu_spare=spare)


def with_disk_tier(stores: tuple[StorePlan, ...], arch: ModelArch, config: Config, held: list[float],
                   gpu_ip: str, workers: int) -> tuple[StorePlan, ...]:
    """Each store with the layers whose optimizer state goes to the disk tier (runtime.disk_dir): the
    fewest that bring its RAM within what it may take (`disk_layers_for`), and where RAM is still short
    the compute copies of the fewest of those too (`disk_compute_layers_for`), a store on the GPU machine
    leaving room for the boundary activations the step may park there (the step plan decides that
    later; without the tier a model either fits with room to spare or is refused). Refuses, with the
    figures, a store whose RAM is short even with all of them there, and a disk that cannot hold
    its files (where its free bytes are known)."""
    layouts = model_layouts(arch, config.model.train_vision)
    fmt = format_of(config.optim)
    dtype = dtype_of(config.model.compute_dtype)
    keep = (TURN_LAYER,) if fmt.exact and config.executor.embedding_step != "host" else ()  # it may step on a GPU
    out = []
    for s in stores:
        room = s.capacity
        if s.node.ip == gpu_ip and not config.runtime.store_memory_gib:
            room = max(0.0, room - host_parking(arch, with_host_gradients_possible(config), offload=True,
                                                num_gpus=workers))
        chosen = disk_layers_for(list(s.layers), layouts, held, room, fmt, keep)
        ram = (sum(held[i] for i in s.layers) - sum(p.nbytes for i in chosen for p in layer_parts(layouts[i], fmt))
               + tier_window_bytes(chosen, layouts, fmt))
        fully = disk_compute_layers_for(chosen, layouts, ram, room, fmt, dtype) if ram > room else ()
        ram = int(ram - sum(compute_bytes(layouts[i], fmt, dtype) for i in fully)
                  + compute_window_bytes([layouts[i] for i in fully], fmt, dtype))
        if ram > s.capacity:
            raise ConfigError(
                f"the store on {s.node.ip} needs {ram / GiB:.1f} GiB of RAM even with the optimizer state of every layer "
                f"{'but the embedding ' if keep else ''}on disk, and the compute copy of every layer but the embedding "
                f"(runtime.disk_dir; the disk tier's windows of buffers stay in RAM) but may take {s.capacity / GiB:.1f} GiB: short by "
                f"{(ram - s.capacity) / GiB:.1f} GiB; give the stores more memory (runtime.store_memory_gib), add RAM "
                "nodes, or choose a smaller model")
        hot = sum(file_bytes(compute_parts(layouts[i], fmt, dtype)) for i in fully)
        out.append(dataclasses.replace(s, host_bytes=ram, disk_layers=chosen, disk_compute_layers=fully,
                                       disk_compute_bytes=hot,
                                       disk_send_bytes=sum(send_bytes(layouts[i], fmt, dtype) for i in fully),
                                       disk_bytes=sum(disk_bytes(layouts[i], fmt) for i in chosen) + hot))
    by_machine: dict[str, list[StorePlan]] = {}
    for s in out:
        by_machine.setdefault(s.node.ip, []).append(s)
    for ip, plans in by_machine.items():
        need, free = sum(s.disk_bytes for s in plans), plans[0].node.disk_bytes
        if free is not None and need > free:
            raise ConfigError(
                f"the disk tier needs {need / GiB:.1f} GiB under runtime.disk_dir={config.runtime.disk_dir} on {ip} "
                f"but {free / GiB:.1f} GiB is free there: short by {(need - free) / GiB:.1f} GiB; free that much, give "
                "runtime.disk_dir a larger disk, give the stores more memory (runtime.store_memory_gib), hold the state "
                "in fewer bytes (optim.master: bf16, optim.moments: int8), or choose a smaller model")
    return tuple(out)


def with_window(placement: Placement, arch: ModelArch, config: Config, parked_bytes: int = 0) -> Placement:
    """The placement with each worker's window for the layers on other nodes, sized in what the GPU
    machine has spare beside `parked_bytes` (parked activations, all its workers'): the step plan's
    decision (planning/step_plan.py). Where layers are fully on disk (RAM is short), the least window:
    a larger one would hold in RAM the compute copies the plan just put on disk."""
    numels = [layout.numel for layout in model_layouts(arch)]
    remote = [numels[i] for i in placement.remote_layers()]
    if not remote:
        return placement
    workers, esize = placement.num_gpus, placement.compute_bytes
    grow = not any(s.disk_compute_layers for s in placement.stores)
    slots = window_slots(remote, (placement.gpu_spare - parked_bytes) / workers, esize, config, grow)  # a window a worker
    return dataclasses.replace(placement, window_slots=slots, window_bytes=workers * window_bytes(remote, slots, esize))


def least_slots(config: Config) -> int:
    """The smallest window that keeps the network ahead of the device: its slots and one more."""
    return config.runtime.remote_window or num_slots_setting(config) + 1


def window_slots(remote: list[int], spare: float, esize: int, config: Config, grow: bool = True) -> int:
    """runtime.remote_window, or the largest window (up to a mirror of the remote layers) that
    takes at most WINDOW_SHARE of the GPU machine's spare memory (`grow` False: the least), and never
    less than least_slots."""
    deepest = max(Counter(remote).values())
    least = min(least_slots(config), deepest)
    slots = least
    if not config.runtime.remote_window and grow:
        slots = max([k for k in range(least, deepest + 1)
                     if window_bytes(remote, k, esize) <= WINDOW_SHARE * spare], default=least)
    need = window_bytes(remote, slots, esize)
    if need > spare:
        raise ConfigError(
            f"the GPU node needs {need / GiB:.1f} GiB of pinned host memory for its window of {slots} slots per layer "
            f"size (the layers that stream from other nodes, and their gradients on the way out) but has "
            f"{max(0.0, spare) / GiB:.1f} GiB beside the stores on its machine, the GPU actor and any parked "
            f"activations: "
            + ("lower runtime.remote_window, " if config.runtime.remote_window else "")
            + "fewer tokens per step if activations are parked (train.grad_accum), keep the stores off the GPU node "
              "(runtime.store_on_gpu_node: false), or give the GPU node more memory"
        )
    return slots
