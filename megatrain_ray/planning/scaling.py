"""Where N GPUs of one node stop scaling: the predicted step (planning/prediction.py, predict_step) at the
run's tokens per GPU with 1, 2, 4 and 8 GPUs, each reading every layer from one set of host stores.

What N GPUs share: the stores' host memory, which every GPU's copies read (every layer twice a
step: N times one GPU's bytes, against HOST_MEMORY_BYTES_PER_S), and the host optimizer, which
runs once a step over all the weights and must hide behind one GPU's share of the forward, on the
GPU node's cores less one per GPU worker (planning/placement.py, store_threads). Each GPU's PCIe
link is its own (its copies take the same time whatever N); the host end of every link is that one
host memory, and GPUs behind one PCIe switch share its uplink (`link_sharing_gpus`: how many its
copies leave room for). The tokens per step that keep N GPUs busy grow with N (each GPU's forward must still
hide the whole optimizer). `megatrain-ray plan` prints the table and where scaling ends.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatrain_ray.config import Config
from megatrain_ray.models.arch import ModelArch
from megatrain_ray.models.registry import num_params
from megatrain_ray.planning.memory import dtype_bytes, micro_batches_per_gpu
from megatrain_ray.planning.prediction import (HOST_ADAMW_THREADS, HOST_MEMORY_BYTES_PER_S, NetworkTimes, StepPrediction,
                                               predict_step)
from megatrain_ray.planning.placement import store_threads
from megatrain_ray.planning.step_plan import StepPlan

GPU_COUNTS = (1, 2, 4, 8)
EFFICIENT = 0.9  # N GPUs scale while they make at least this fraction of N times one GPU's tokens/s


@dataclass(frozen=True)
class Scale:
    gpus: int
    threads: int | None  # the host optimizer's threads on the GPU node beside that many workers (None: not known)
    prediction: StepPrediction

    @property
    def tokens_per_s(self) -> float:
        return self.prediction.tokens / self.prediction.step_s


def optimizer_threads(config: Config, step: StepPlan, gpus: int) -> int | None:
    """The GPU node's store's optimizer threads beside `gpus` workers (None: its cores not known, or
    no store there)."""
    p = step.placement
    if p is None or not any(s.node.node_id == p.gpu.node_id for s in p.stores):
        return config.runtime.optimizer_threads
    return store_threads(p.gpu, p.gpu, gpus, config.runtime)


def optimizer_seconds(optimizer_s: float, threads_then: int | None, threads: int | None) -> float:
    """The run's host optimizer time (`optimizer_s`, its rate the measured one of HOST_ADAMW_THREADS
    threads) with `threads` instead of `threads_then`: a thread's share of that rate each, never more
    than the measured rate (more threads than it was measured with are not assumed faster)."""
    if threads is None or threads_then is None:
        return optimizer_s
    return optimizer_s * min(threads_then, HOST_ADAMW_THREADS) / min(threads, HOST_ADAMW_THREADS)


def gpu_scaling(arch: ModelArch, config: Config, step: StepPlan, network: NetworkTimes | None, optimizer_s: float,
                rates=None, counts: tuple[int, ...] = GPU_COUNTS) -> list[Scale]:
    """The predicted step with each of `counts` GPUs, each taking the run's micro-batches per GPU."""
    view = step.planned_config(config)
    per_gpu = micro_batches_per_gpu(view, step.workers)
    threads_then = optimizer_threads(config, step, step.workers)
    scales = []
    for n in counts:
        scaled = view.replace(train=dataclasses.replace(view.train, grad_accum=per_gpu * n))
        threads = optimizer_threads(config, step, n)
        scales.append(Scale(n, threads, predict_step(arch, scaled, network, optimizer_seconds(optimizer_s, threads_then,
                                                                                                threads),
                                                     n, step.kept, rates)))
    return scales


def scaling_end(scales: list[Scale]) -> Scale | None:
    """The first count that makes less than EFFICIENT of its share of one GPU's tokens/s (None: none)."""
    one = scales[0].tokens_per_s
    return next((s for s in scales if s.tokens_per_s < EFFICIENT * s.gpus * one), None)


def host_memory_gpus(arch: ModelArch, config: Config, scale: Scale) -> int:
    """The most GPUs whose weight reads (every layer twice a step, each) and the gradients back fit
    in host memory's bandwidth within one GPU's compute of a step."""
    p = scale.prediction
    per_gpu = p.host_read_bytes / scale.gpus
    room = HOST_MEMORY_BYTES_PER_S * p.compute_s - num_params(arch) * dtype_bytes(config)
    return max(0, int(room // per_gpu)) if per_gpu else 0


def optimizer_gpus(config: Config, step: StepPlan, optimizer_s: float, forward_s: float, most: int = 256) -> int | None:
    """The most GPUs (up to `most`) beside which the host optimizer, on the threads their workers
    leave it, stays within one GPU's forward; None: any count."""
    then = optimizer_threads(config, step, step.workers)
    hidden = [n <= most and optimizer_seconds(optimizer_s, then, optimizer_threads(config, step, n)) <= forward_s
              for n in range(1, most + 1)]
    return None if all(hidden) else hidden.index(False)


def link_sharing_gpus(p: StepPrediction) -> int:
    """The most GPUs whose copies one host link carries within one GPU's compute of a step (GPUs
    behind one PCIe switch share its uplink: their copies add up)."""
    return int(p.compute_s // p.h2d_s) if p.h2d_s else 0


def scaling_text(arch: ModelArch, config: Config, step: StepPlan, network: NetworkTimes | None, optimizer_s: float,
                 rates=None) -> str:
    """The table and where N GPUs stop scaling, for `megatrain-ray plan`."""
    scales = gpu_scaling(arch, config, step, network, optimizer_s, rates)
    view = step.planned_config(config)
    one = scales[0]
    p1 = one.prediction
    rows = [f"scaling over the GPUs of one node at {p1.tokens} tokens per GPU a step, one set of host stores (their "
            f"memory and optimizer shared; each GPU's PCIe link its own):",
            "| GPUs | tokens/s | scaling | bound by | host optimizer (threads) | host reads a step | "
            "tokens a step that keep them busy |", "|---|---|---|---|---|---|---|"]
    for s in scales:
        p = s.prediction
        threads = f" ({s.threads})" if s.threads is not None else ""
        rows.append(f"| {s.gpus} | {s.tokens_per_s:,.0f} | {s.tokens_per_s / one.tokens_per_s:.2f}x | {p.bound} | "
                    f"{p.optimizer_s:.2f} s{threads} | {p.host_read_bytes / 1e9:.0f} GB | {p.busy_tokens} |")
    end = scaling_end(scales)
    hidden = optimizer_gpus(config, step, optimizer_s, p1.forward_s)
    rows.append(
        (f"scaling ends at {end.gpus} GPUs ({end.tokens_per_s / one.tokens_per_s:.2f}x one GPU, bound by "
         f"{end.prediction.bound})" if end else f"no end of scaling up to {scales[-1].gpus} GPUs")
        + f". Its limits at these tokens per GPU: host memory ({HOST_MEMORY_BYTES_PER_S / 1e9:.0f} GB/s, "
        f"{p1.host_read_bytes / 1e9:.0f} GB of weight reads a step per GPU) serves {host_memory_gpus(arch, view, one)} "
        f"GPUs; the host optimizer hides behind each GPU's {p1.forward_s:.2f} s forward "
        + ("with any count" if hidden is None else "not even beside one GPU" if hidden == 0 else
           f"with up to {hidden} GPUs (on the threads the node's cores leave beside one a worker)")
        + f"; each GPU's PCIe link carries {p1.h2d_s:.2f} s a step beside its {p1.compute_s:.2f} s of compute, "
        f"whatever N, and a host link that several GPUs share (a PCIe switch's uplink) stays behind compute for "
        f"{link_sharing_gpus(p1)} of them. More tokens per GPU (train.grad_accum) push every limit out")
    return "\n".join(rows)
