"""Whose rates a step-time prediction uses: the GPU the run will have, never a GPU it will not.

One GPU model's rates were measured: the H100 SXM machine's (`megatrain-ray bench --parts`,
examples/benchmarks/). For the other common GPUs the table carries what their vendor's datasheet
says (dense bf16 tensor FLOP/s with fp32 accumulation, memory, the host link) and scales them by
what the H100 measured against its own datasheet (`DATASHEET_SCALED`): an estimate, not a
measurement, and said so wherever it is used. A GPU is found by the name `--gpu` gives (a key of
the table, any case, spaces and dashes ignored) or recognised from the name CUDA reports for the
live device. A live GPU outside the table is measured on the spot by two short probes on its node
(a bf16 matmul and a pinned host-to-device copy, about a second); a decoder layer's rate is then
taken as the matmul's times the ratio the H100 measured between the two. A GPU neither in the
table nor live (a described cluster's) gets no step time. Without a GPU nothing is predicted: the
CPU path is the real code, but its speed says nothing of a GPU's. The host optimizer's rate is the
H100 machine's in every case (16 cores; `megatrain-ray bench --parts` measures a machine's).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from megatrain_ray.planning.prediction import H2D_BYTES_PER_S, LAYER_TFLOPS


@dataclass(frozen=True)
class Rates:
    gpu: str  # the GPU model the rates belong to
    layer_flops_per_s: float  # one decoder layer's fwd+bwd, compiled
    h2d_bytes_per_s: float  # pinned host memory to the GPU
    matmul_flops_per_s: float  # a large bf16 matmul: the MFU denominator
    source: str  # where they come from, said wherever they are used

    def describe(self) -> str:
        return f"the {self.gpu}'s rates ({self.source})"


PCIE_LANE_BYTES_PER_S = {3: 0.985e9, 4: 1.969e9, 5: 3.938e9}  # each way, after the line encoding


@dataclass(frozen=True)
class GpuSpec:
    """A GPU model as its vendor's datasheet gives it."""

    name: str  # as the report says it
    bf16_tflops: float  # dense bf16 tensor TFLOP/s with fp32 accumulation (no sparsity)
    memory_gib: float  # its memory ("10 GB" on a card is 10 GiB)
    link: str  # its host link, as the datasheet gives it
    link_bytes_per_s: float  # that link's rate each way
    device_names: str  # a regular expression over the name CUDA reports, upper case (NAMES_OF)


def pcie(gen: int, lanes: int) -> tuple[str, float]:
    return f"PCIe {gen}.0 x{lanes}", PCIE_LANE_BYTES_PER_S[gen] * lanes


MEMORY_SUFFIX = r"( \d+ ?GB?)?"  # "RTX 3080 10GB", "H200 141GB", "GH200 480GB": the memory a name may end with


def spec(name: str, tflops: float, memory_gib: float, link: tuple[str, float], names: str) -> GpuSpec:
    return GpuSpec(name, tflops, memory_gib, *link, names + MEMORY_SUFFIX)


# GeForce cards: "Peak FP16/BF16 Tensor TFLOPS with FP32 Accumulate", dense, from NVIDIA's Ampere GA102,
# Ada and RTX Blackwell architecture whitepapers (their appendices of GeForce specifications); the data
# centre GPUs' BF16 Tensor Core figure from their datasheets, halved where it is given with sparsity.
# A name CUDA reports is matched whole: "RTX 3080 Ti", "RTX 4090 Laptop GPU" or "H100 NVL" are other
# GPUs (probed where they are live, else no step time).
SPECS = {
    "rtx3060": spec("RTX 3060", 25.6, 12, pcie(4, 16), r"RTX 3060"),
    "rtx3070": spec("RTX 3070", 40.6, 8, pcie(4, 16), r"RTX 3070"),
    "rtx3080": spec("RTX 3080", 59.5, 10, pcie(4, 16), r"RTX 3080"),
    "rtx3090": spec("RTX 3090", 71.0, 24, pcie(4, 16), r"RTX 3090"),
    "rtx4060ti": spec("RTX 4060 Ti", 44.1, 16, pcie(4, 8), r"RTX 4060 TI"),
    "rtx4070": spec("RTX 4070", 58.3, 12, pcie(4, 16), r"RTX 4070"),
    "rtx4080": spec("RTX 4080", 97.5, 16, pcie(4, 16), r"RTX 4080"),
    "rtx4090": spec("RTX 4090", 165.2, 24, pcie(4, 16), r"RTX 4090"),
    "rtx5080": spec("RTX 5080", 112.6, 16, pcie(5, 16), r"RTX 5080"),
    "rtx5090": spec("RTX 5090", 209.5, 32, pcie(5, 16), r"RTX 5090"),
    "a100-40": spec("A100 40GB", 312, 40, pcie(4, 16), r"A100 (SXM4 |PCIE )?40GB( PCIE)?"),
    "a100-80": spec("A100 80GB", 312, 80, pcie(4, 16), r"A100 (SXM4 |PCIE )?80GB( PCIE)?"),
    "l40s": spec("L40S", 362.05, 48, pcie(4, 16), r"L40S"),
    "h100-pcie": spec("H100 PCIe", 756, 80, pcie(5, 16), r"H100 (80GB )?PCIE"),
    "h100-sxm": spec("H100 SXM", 989.4, 80, pcie(5, 16), r"H100( SXM5?)?( 80GB)?( HBM3)?"),
    "h200": spec("H200", 989.4, 141, pcie(5, 16), r"H200( 141GB)?( HBM3E)?"),
    "b200": spec("B200", 2250, 180, pcie(5, 16), r"B200"),
    "gh200": spec("GH200", 989.4, 96, ("NVLink-C2C, 450 GB/s each way", 450e9), r"GH200( \d+GB?)?( HBM3E?)?"),
}
MEASURED = "h100-sxm"  # the one model whose rates were measured
ALIASES = {"h100": MEASURED}  # what --gpu took before the table grew

H100 = Rates("H100", LAYER_TFLOPS, H2D_BYTES_PER_S, 799e12,
             "measured on the H100 80GB machine: `megatrain-ray bench --parts`, examples/benchmarks/")


def datasheet_rates(gpu: GpuSpec) -> Rates:
    """A GPU's rates estimated from its datasheet: each of its figures times what the measured H100
    reached of the same figure of its own datasheet (a layer and a matmul of its bf16 peak, a pinned
    copy of its PCIe link)."""
    h100 = SPECS[MEASURED]
    compute = gpu.bf16_tflops / h100.bf16_tflops
    link = gpu.link_bytes_per_s / h100.link_bytes_per_s
    return Rates(gpu.name, H100.layer_flops_per_s * compute, H100.h2d_bytes_per_s * link,
                 H100.matmul_flops_per_s * compute,
                 f"a datasheet-scaled estimate, not a measurement: {gpu.bf16_tflops:g} dense bf16 TFLOP/s and "
                 f"{gpu.link} from its datasheet, at the fractions the measured H100 SXM reached of its own "
                 f"({H100.layer_flops_per_s / 1e12 / h100.bf16_tflops:.0%} of {h100.bf16_tflops:g} TFLOP/s in a "
                 f"layer, {H100.h2d_bytes_per_s / h100.link_bytes_per_s:.0%} of its {h100.link})")


def rates_of(key: str) -> Rates:
    return H100 if key == MEASURED else datasheet_rates(SPECS[key])


def spec_key(name: str) -> str | None:
    """The table's key for a name `--gpu` gives ("RTX 3080", "rtx3080", "h100-sxm"), or None."""
    squeezed = re.sub(r"[\s_-]", "", name.lower())
    keys = {re.sub(r"-", "", key): key for key in SPECS}
    return keys.get(squeezed) or ALIASES.get(squeezed)


def device_key(gpu_name: str) -> str | None:
    """The table's key for a name CUDA reports ("NVIDIA GeForce RTX 3080", "NVIDIA H100 80GB HBM3"),
    matched whole: None for another model (a Ti, a laptop's, an NVL)."""
    name = re.sub(r"[\s-]+", " ", gpu_name.upper()).strip()
    name = re.sub(r"^(NVIDIA )?(GEFORCE )?", "", name)
    return next((key for key, s in SPECS.items() if re.fullmatch(s.device_names, name)), None)


def table_rates(gpu_name: str) -> Rates | None:
    """The table's rates for a device name such as "NVIDIA H100 80GB HBM3" (measured, or estimated
    from the datasheet), or None."""
    key = device_key(gpu_name)
    return None if key is None else rates_of(key)


def named_rates(name: str) -> Rates | None:
    """The rates of a GPU named by `--gpu` or a cluster description: a table key, or a name as CUDA
    reports it; None for a GPU the table lacks."""
    key = spec_key(name) or device_key(name)
    return None if key is None else rates_of(key)


def named_spec(name: str) -> GpuSpec | None:
    """The datasheet entry of a GPU named as `named_rates` takes it, or None."""
    key = spec_key(name) or device_key(name)
    return None if key is None else SPECS[key]


# what a GPU's memory has free for a run, less than the datasheet's: the CUDA context, a desktop's
# display. An allowance, not a measurement (an RTX 3080 10GB with a display read about 9.5 GiB free)
FREE_ALLOWANCE_GIB = 0.5


def table_keys() -> str:
    return ", ".join(SPECS)


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
          "nothing of a GPU's); run `plan` on the GPU machine, or pass --gpu MODEL for the rates table's (one of "
          f"{table_keys()})")
