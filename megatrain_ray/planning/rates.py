"""Whose rates a step-time prediction uses: the GPU the run will have, never a GPU it will not.

A table per GPU model holds rates measured on that model, with where they were measured. A GPU
not in the table is measured on the spot by two short probes on its node (a bf16 matmul and a
pinned host-to-device copy, about a second); a decoder layer's rate is then taken as the matmul's
times the ratio the table's H100 measured between the two. Without a GPU nothing is predicted:
the CPU path is the real code, but its speed says nothing of a GPU's. The host optimizer's rate
is the H100 machine's in every case (16 cores; `megatrain-ray bench --parts` measures a machine's).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from megatrain_ray.planning import plan as planner


@dataclass(frozen=True)
class Rates:
    gpu: str  # the GPU model the rates belong to
    layer_flops_per_s: float  # one decoder layer's fwd+bwd, compiled
    h2d_bytes_per_s: float  # pinned host memory to the GPU
    matmul_flops_per_s: float  # a large bf16 matmul: the MFU denominator
    source: str  # where they come from, said wherever they are used

    def describe(self) -> str:
        return f"the {self.gpu}'s rates ({self.source})"


H100 = Rates("H100", planner.LAYER_TFLOPS, planner.H2D_BYTES_PER_S, 799e12,
             "measured on the H100 80GB machine: `megatrain-ray bench --parts`, examples/benchmarks/")
TABLE = {"H100": H100}


def table_rates(gpu_name: str) -> Rates | None:
    """The table's entry for a device name such as "NVIDIA H100 80GB HBM3", or None."""
    words = gpu_name.upper().replace("-", " ").split()
    return next((rates for model, rates in TABLE.items() if model in words), None)


def probed_rates(gpu_name: str, matmul_flops_per_s: float, h2d_bytes_per_s: float) -> Rates:
    """Rates for a GPU outside the table, from the probes' two numbers (see the module docstring)."""
    layer = matmul_flops_per_s * H100.layer_flops_per_s / H100.matmul_flops_per_s
    return replace(H100, gpu=gpu_name, layer_flops_per_s=layer, h2d_bytes_per_s=h2d_bytes_per_s,
                   matmul_flops_per_s=matmul_flops_per_s,
                   source=f"probed here: bf16 matmul {matmul_flops_per_s / 1e12:.0f} TFLOP/s, host->GPU "
                          f"{h2d_bytes_per_s / 1e9:.1f} GB/s; a layer at the H100's ratio of layer to matmul rate")


def probe_gpu() -> tuple[str, float, float]:
    """(name, bf16 matmul FLOP/s, pinned host->GPU bytes/s) of this process's GPU, in about a second."""
    import time

    import torch

    device = torch.device("cuda")
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    host = torch.empty(256 * 2**20, dtype=torch.uint8, pin_memory=True)
    target = torch.empty_like(host, device=device)

    def timed(work, repeats: int) -> float:
        work()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(repeats):
            work()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / repeats

    matmul = 2 * n**3 / timed(lambda: a @ b, 10)
    h2d = host.numel() / timed(lambda: target.copy_(host, non_blocking=True), 5)
    return torch.cuda.get_device_name(device), matmul, h2d


def rates_for_gpu(name: str, probe=None) -> Rates:
    """The table's rates for this GPU, else the probes' (`probe`: a callable returning probe_gpu()'s tuple)."""
    known = table_rates(name)
    if known is not None:
        return known
    probed_name, matmul, h2d = (probe or probe_gpu)()
    return probed_rates(probed_name, matmul, h2d)


NO_GPU = ("no GPU here: no step time is predicted (the CPU path runs the same schedule, but its speed says "
          "nothing of a GPU's); run `plan` on the GPU machine, or pass --gpu H100 for the table's H100 rates")
