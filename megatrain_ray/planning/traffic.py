"""What crosses the network in one step, per node, and the time it takes at a link speed.

Each layer held by a store on another machine than the GPU worker's crosses the network two or
three times a step: its weights ahead of the forward, again ahead of the backward unless the
GPU node's window still holds them at the turn (window.fetches_per_step, the window's own
policy) or the block keeps its forward graph, and its gradient once, on the way back. Links are
full duplex: weights in and gradients out overlap. At the turn of a step nothing hides the first
layer's gradient out, its store's AdamW and its new weights back; it travels in pieces
(host/transport.py, turn_pieces), so the three overlap. A store on the GPU worker's machine (a raylet
beside it) is reached over loopback and crosses no network card: its bytes are listed, not timed.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatrain_ray.config import Config
from megatrain_ray.streaming.layer_order import layer_order
from megatrain_ray.host.memory import dtype_of, element_size
from megatrain_ray.models.arch import ModelArch
from megatrain_ray.models.registry import model_layouts
from megatrain_ray.planning.placement import Placement
from megatrain_ray.planning.prediction import HOST_ADAMW_PARAMS_PER_S, NetworkTimes
from megatrain_ray.host.transport import TURN_LAYER, piece_bounds, turn_pieces
from megatrain_ray.host.window import fetches_per_step

GiB = 1024**3


@dataclass(frozen=True)
class NodeTraffic:
    """One node's share of a step. For a store: weights it sends, gradients it receives; for the
    GPU node the sum over the stores it streams from, in the other direction."""

    name: str
    params: int  # parameters of the layers held there: its host optimizer's work
    state_bytes: int
    pinned_bytes: int  # the GPU node's window and outbox for remote layers
    forward_bytes: int  # weights ahead of the forward
    backward_bytes: int  # weights again ahead of the backward
    gradient_bytes: int
    gbps: float
    adamw_params_per_s: float
    over_network: bool = True  # False: a store on the GPU worker's machine (loopback)
    disk_s: float = 0.0  # its disk tier's reads and writes a step (planning/placement.py), beside its AdamW

    @property
    def weight_bytes(self) -> int:
        return self.forward_bytes + self.backward_bytes

    def seconds(self, nbytes: int, gbps: float | None = None) -> float:
        return nbytes * 8 / ((gbps or self.gbps) * 1e9)

    def hiding_gbps(self, compute_s: float) -> float:
        """The link speed that hides this node's transfers behind the step's compute: the forward's
        weights within its quarter, the backward's weights and the gradients within the rest."""
        if compute_s <= 0:
            return 0.0
        need = max(self.forward_bytes / (compute_s / 4), self.backward_bytes / (3 * compute_s / 4),
                   self.gradient_bytes / (3 * compute_s / 4))
        return need * 8 / 1e9


@dataclass(frozen=True)
class StepTraffic:
    gpu: NodeTraffic
    stores: tuple[NodeTraffic, ...]
    first_layer_bytes: int  # layer 0 when it streams: its gradient out and new weights in sit between steps
    first_layer_gbps: float
    first_layer_adamw_s: float = 0.0  # its store's AdamW on it, between the two
    first_layer_pieces: int = 1  # what it travels in (host/transport.py, turn_pieces): the three overlap

    def turn_seconds(self, gbps: float | None = None) -> float:
        """The turn of the step: layer 0's gradient out, its update, its new weights back, one after
        the other piece by piece; in pieces it costs the slowest stage and a piece of the others."""
        if not self.first_layer_bytes:
            return 0.0
        wire = self.first_layer_bytes * 8 / ((gbps or self.first_layer_gbps) * 1e9)
        stages = (wire, self.first_layer_adamw_s, wire)
        return max(stages) + (sum(stages) - max(stages)) / self.first_layer_pieces

    def times(self, gbps: float | None = None) -> NetworkTimes:
        """Seconds per phase at the nodes' link speeds (or every link at `gbps`)."""
        remote = [s for s in self.stores if s.over_network]
        if not remote:
            return NetworkTimes()

        def slowest(bytes_of) -> float:
            return max([self.gpu.seconds(bytes_of(self.gpu), gbps)] + [s.seconds(bytes_of(s), gbps) for s in remote])

        return NetworkTimes(slowest(lambda n: n.forward_bytes), slowest(lambda n: n.backward_bytes),
                            slowest(lambda n: n.gradient_bytes), self.turn_seconds(gbps))

    def optimizer_seconds(self) -> float:
        """The slowest store machine's AdamW over its layers, or its disk tier's reads and writes
        where those take longer (they run beside it, layer by layer: host/disk.py); machines work in parallel."""
        return max((max(s.params / s.adamw_params_per_s, s.disk_s) for s in self.stores), default=0.0)


def step_traffic(arch: ModelArch, config: Config, placement: Placement, kept: int = 0) -> StepTraffic:
    """`kept`: the blocks whose forward graphs the GPU keeps; their backward fetches nothing."""
    layouts = model_layouts(arch)
    esize = element_size(dtype_of(config.model.compute_dtype))
    remote = placement.remote_layers()
    fetched = fetches_per_step({i: layouts[i].numel for i in remote}, layer_order(arch, kept),
                               placement.window_slots)
    default_gbps = config.runtime.network_gbps
    gpu_ip = placement.gpu.ip
    by_machine: dict[str, list] = {}
    for s in placement.stores:
        by_machine.setdefault(s.node.ip, []).append(s)
    stores, totals = [], [0, 0, 0]
    for ip, plans in by_machine.items():
        layers = [i for s in plans for i in s.layers]
        streamed = [i for i in layers if i in fetched]
        nbytes = {i: layouts[i].numel * esize for i in streamed}
        node = plans[0].node
        traffic = NodeTraffic(
            name=ip, params=sum(layouts[i].numel for i in layers), state_bytes=sum(s.host_bytes for s in plans),
            pinned_bytes=0, forward_bytes=sum(nbytes.values()),
            backward_bytes=sum(nbytes[i] * (fetched[i] - 1) for i in streamed),
            gradient_bytes=sum(nbytes.values()), gbps=node.gbps or default_gbps,
            adamw_params_per_s=node.adamw_params_per_s or HOST_ADAMW_PARAMS_PER_S, over_network=ip != gpu_ip,
            disk_s=sum(s.disk_seconds() for s in plans),
        )
        stores.append(traffic)
        if traffic.over_network:
            totals = [totals[0] + traffic.forward_bytes, totals[1] + traffic.backward_bytes,
                      totals[2] + traffic.gradient_bytes]
    gpu = NodeTraffic(
        name=f"{gpu_ip} (GPU node)", params=0, state_bytes=placement.gpu_machine_state(),
        pinned_bytes=placement.window_bytes, forward_bytes=totals[0], backward_bytes=totals[1],
        gradient_bytes=totals[2], gbps=placement.gpu.gbps or default_gbps, adamw_params_per_s=HOST_ADAMW_PARAMS_PER_S,
    )
    first = next((s for s in placement.stores if TURN_LAYER in s.layers), None)
    if first is None or first.node.ip == gpu_ip:
        return StepTraffic(gpu, tuple(stores), 0, gpu.gbps)
    numel = layouts[TURN_LAYER].numel
    piece = turn_pieces(config.runtime.transport_piece_mib, esize).get(TURN_LAYER, 0)
    return StepTraffic(gpu, tuple(stores), numel * esize, min(gpu.gbps, first.node.gbps or default_gbps),
                       numel / (first.node.adamw_params_per_s or HOST_ADAMW_PARAMS_PER_S),
                       len(piece_bounds(numel, piece)))


def describe_traffic(traffic: StepTraffic, compute_s: float | None) -> str:
    """Per node: state, pinned bytes, bytes each way per step, and the link speed that hides them
    (`compute_s`: the step's compute on the GPU's rates; None without a GPU's rates: not said)."""
    lines = ["per node and step (weights in two phases, gradients once; links full duplex):"]
    # the GPU machine's own store moves nothing over any link: the GPU node's line says it
    own = [n for n in traffic.stores if not n.over_network and not n.weight_bytes and not n.gradient_bytes]
    for n in (traffic.gpu, *(n for n in traffic.stores if n not in own)):
        role = "receives weights" if n is traffic.gpu else "sends weights"
        grads = "sends gradients" if n is traffic.gpu else "receives gradients"
        name = n.name + ("" if n.over_network else " (on the GPU machine: loopback, no network)")
        if n is traffic.gpu and own:  # "ip (GPU node)"
            name = n.name.removesuffix(")") + "; its own store's layers through shared memory)"
        lines.append(
            f"  {name}: state {n.state_bytes / GiB:.1f} GiB, pinned {n.pinned_bytes / GiB:.2f} GiB; {role} "
            f"{n.forward_bytes / 1e9:.1f} GB before the forward + {n.backward_bytes / 1e9:.1f} GB before the backward, "
            f"{grads} {n.gradient_bytes / 1e9:.1f} GB"
            + (hiding(n, compute_s) if n.over_network and n.weight_bytes and compute_s is not None else "")
        )
    return "\n".join(lines)


def hiding(node: NodeTraffic, compute_s: float) -> str:
    """Whether the node's link hides its transfers behind the step's compute, with the speed that would."""
    need = node.hiding_gbps(compute_s)
    if need <= node.gbps:
        return (f"; hidden behind the step's {compute_s:.1f} s of compute: that takes {need:.1f} Gbit/s of its "
                f"{node.gbps:g} Gbit/s link")
    return (f"; not hidden: within the step's {compute_s:.1f} s of compute (the weights before the forward within "
            f"its quarter) they need {need:.1f} Gbit/s, its link has {node.gbps:g} Gbit/s")
