"""Measured, not guessed: one forward and backward of one decoder layer of each kind, on the device
the run uses, at the run's micro-batch shape.

A family written by hand carries a working set fitted on the H100; a model run through
transformers' modules (models/transformers/) has none that anyone fitted, and its layers may be of
several kinds (linear and full attention, dense and mixture-of-experts MLPs). The probe gives the
planner each kind's working set (the peak of device memory during the layer's forward and backward,
above its weights, its input and the gradients it returns) and its compute rate. The layer runs
eagerly: a compiled layer keeps less, so the figure errs on the side of fitting.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from megatrain_ray.models.arch import ModelArch
from megatrain_ray.models.layout import BLOCK, LayerLayout, with_shared
from megatrain_ray.models.registry import family, model_layouts


@dataclass(frozen=True)
class LayerProbe:
    layer: int  # layout index of the layer measured
    count: int  # decoder layers of its kind
    tokens: int
    working_set_bytes: int | None  # None where the device does not count its memory (the CPU)
    seconds: float  # one forward and backward
    flops: float  # what the planner counts for them: 6 x active parameters x tokens + attention

    @property
    def tflops(self) -> float:
        return self.flops / self.seconds / 1e12 if self.seconds > 0 else 0.0


def layer_kinds(arch: ModelArch) -> dict[int, list[int]]:
    """Decoder layers grouped by kind, keyed by the first of each: the family's templates where it
    names them (models/transformers/), else the layers' tensor names and shapes."""
    fam = family(arch)
    blocks = [layout for layout in model_layouts(arch) if layout.kind == BLOCK]
    templates = fam.template_kinds(arch)
    kinds: dict[object, list[int]] = {}
    for layout in blocks:
        key = templates[layout.index - 1] if templates else tuple((p.name, p.shape) for p in layout.params)
        kinds.setdefault(key, []).append(layout.index)
    return {members[0]: members for members in kinds.values()}


def probe_layers(arch: ModelArch, micro_batch: int, seq_len: int, dtype: torch.dtype,
                 device: torch.device) -> list[LayerProbe]:
    """Each kind's working set and time at `micro_batch` rows of `seq_len` tokens."""
    fam = family(arch)
    positions = torch.arange(seq_len, device=device).expand(micro_batch, seq_len)
    ctx = fam.context(arch, positions, dtype, packed=False)
    layouts = model_layouts(arch)
    return [probe_one(arch, layouts[first], len(members), ctx, micro_batch, seq_len, dtype, device)
            for first, members in layer_kinds(arch).items()]


def random_weights(arch: ModelArch, layout: LayerLayout, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    fam = family(arch)
    flat = torch.empty(layout.numel, dtype=torch.float32)
    gen = torch.Generator().manual_seed(layout.index)
    for p in layout.params:
        fam.init_param(p, flat[p.offset: p.offset + p.numel], gen, 0.02)
    return flat.to(device=device, dtype=dtype)


def random_leaves(arch: ModelArch, layout: LayerLayout, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    return {name: view.detach().requires_grad_(True)
            for name, view in layout.views(random_weights(arch, layout, dtype, device)).items()}


def probe_one(arch: ModelArch, layout: LayerLayout, count: int, ctx, micro_batch: int, seq_len: int,
              dtype: torch.dtype, device: torch.device) -> LayerProbe:
    fam = family(arch)
    layouts = model_layouts(arch)
    w = with_shared(random_leaves(arch, layout, dtype, device),  # and a shared block's (LayerLayout.shares)
                    [random_leaves(arch, layouts[held], dtype, device) for held in layout.shares])
    x = torch.randn(micro_batch, seq_len, arch.stream_width, dtype=dtype, device=device, requires_grad=True)
    layer_ctx = fam.layer_context(arch, ctx, layout.index)
    aux = {"aux": True} if fam.aux_loss_on(arch) else {}

    def forward_backward() -> list[torch.Tensor]:
        y = fam.block(arch, w, x, layer_ctx, **aux)
        y = y[0] if aux else y
        return torch.autograd.grad(y, [x, *w.values()], torch.ones_like(y), allow_unused=True, materialize_grads=True)

    cuda = device.type == "cuda"
    forward_backward()  # a first pass: lazy initialisation, kernel selection
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device) if cuda else 0
    start = time.perf_counter()
    grads = forward_backward()
    if cuda:
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    working = None
    if cuda:
        returned = sum(g.numel() * g.element_size() for g in grads)
        working = max(0, torch.cuda.max_memory_allocated(device) - before - returned)
    tokens = micro_batch * seq_len
    active = sum(t.numel() for t in w.values()) - fam.layer_inactive_params(arch, layout)  # a shared block's too
    flops = 6 * active * tokens + tokens * fam.attention_flops_per_token(arch, seq_len) / arch.num_layers
    return LayerProbe(layout.index, count, tokens, working, seconds, flops)


def describe_probe(probes: list[LayerProbe], device: torch.device) -> str:
    lines = [f"measured on {_device_name(device)}, one forward and backward per layer kind (eager):"]
    for p in probes:
        ws = "not counted on this device" if p.working_set_bytes is None else \
            f"working set {p.working_set_bytes / 2**20:.0f} MiB ({p.working_set_bytes / p.tokens / 1024:.1f} KiB a token)"
        lines.append(f"  layer {p.layer - 1} and its kind ({p.count} layers): {ws}, {p.seconds * 1e3:.1f} ms, "
                     f"{p.tflops:.3g} TFLOP/s")
    return "\n".join(lines)


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "the CPU"


def measure_working_set(arch: ModelArch, micro_batch: int, seq_len: int, dtype: torch.dtype,
                        device: torch.device) -> tuple[float, str]:
    """A transformers-family model's largest layer kind's working set a token, in `dtype` elements
    (0: not measured: a family written by hand has its own fit, the CPU does not count its memory),
    and the lines that say which figure the plan uses."""
    if not family(arch).measures_working_set(arch):
        return 0.0, "working set: the family's estimate (fitted on the H100)"
    probes = probe_layers(arch, micro_batch, seq_len, dtype, device)
    text = describe_probe(probes, device)
    measured = [p.working_set_bytes / p.tokens for p in probes if p.working_set_bytes is not None]
    if not measured:
        return 0.0, text + "\nworking set: an estimate (the Llama family's fit); the CPU does not count its memory"
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the probe's blocks back, so that the device's free memory is the run's
    return (max(measured) / torch.empty((), dtype=dtype).element_size(),
            text + "\nworking set: the largest kind's, as measured above")

