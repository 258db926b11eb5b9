"""`megatrain-ray bench --parts`: the ceilings a step is built from, each timed alone: one decoder
layer's forward + backward (for a mixture of experts, beside a dense layer with as many active
parameters) and the host AdamW per thread count."""

from __future__ import annotations

import statistics
import time

from megatrain_ray.bench.workload import Shape
from megatrain_ray.models.arch import ModelArch
from megatrain_ray.models.moe import MoeArch, active_layer_params
from megatrain_ray.models.registry import family, model_layouts


def median_seconds(fn, repeats: int, sync) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_parts(arch: ModelArch, args, shape: Shape) -> dict:
    """Per-layer compute ceiling (forward + backward, no recompute) and the host optimizer rate;
    for a mixture of experts, its first sparse layer and a dense layer with as many active
    parameters (models/moe.py, MoeArch.dense_equivalent)."""
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() and args.device != "cpu" else "cpu")
    dtype = torch.bfloat16 if args.compute_dtype == "bfloat16" else torch.float32
    indices = args.parts_layers or [first_sparse_layer(arch)]
    for index in indices:
        if not 1 <= index <= arch.num_layers:
            raise ValueError(f"--parts-layers: {index} is not a decoder layer (1..{arch.num_layers})")
    layers = {i: time_layer(arch, i, shape, device, dtype, not args.no_compile) for i in indices}
    out = {"device": str(device), **layers[indices[0]], "layers": layers}  # the first layer's keys at the top
    if isinstance(arch, MoeArch):
        dense = time_layer(arch.dense_equivalent(), 1, shape, device, dtype, not args.no_compile)
        out["dense_equivalent"] = dense
        for mode in ("eager", "compiled"):
            key = f"layer_fwd_bwd_{mode}_tflops"
            if key in out and key in dense:
                out[f"moe_over_dense_{mode}"] = out[key] / dense[key]
    return {**out, **bench_host_adamw(arch, args)}


def bench_host_adamw(arch: ModelArch, args) -> dict:
    """The host AdamW on one decoder layer held as a store holds it (its compute buffer in /dev/shm),
    one pass (what the stores run) against torch's fused AdamW in three, per thread count."""
    import os

    import torch

    from megatrain_ray.host.memory import DTYPES
    from megatrain_ray.host.adamw_kernel import native_kernel
    from megatrain_ray.host.adamw import AdamWStep, adamw_step
    from megatrain_ray.host.store import ShardStore

    cores = os.cpu_count() or 1
    threads = sorted({t for t in (args.optimizer_threads or [4, 8, 12, cores - 2, cores]) if 1 <= t <= cores})
    store = ShardStore(arch, [1], DTYPES[args.compute_dtype], shm_dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    state = store.layers[1]
    state.master.normal_(0.0, 0.02)  # finite, normal numbers: no subnormal slow paths
    state.compute.copy_(state.master)
    hp = AdamWStep(1, 1e-4, 0.5, (0.9, 0.95), 1e-8, 0.1)
    n = state.layout.numel
    ways = {
        "one_pass": lambda: store.step_layer(1, hp),
        "torch_three_pass": lambda: adamw_step(state.master, state.exp_avg, state.exp_avg_sq, state.compute,
                                               state.layout.segments(), hp, 1, one_pass=False),
    }
    rates: dict[str, dict[int, float]] = {way: {} for way in ways}
    default_threads = torch.get_num_threads()
    try:
        for t in threads:
            torch.set_num_threads(t)
            for way, fn in ways.items():
                rates[way][t] = n / median_seconds(fn, 5, lambda: None) / 1e9
                print(f"host AdamW, {way}, {t} threads: {rates[way][t]:.2f} G params/s", flush=True)
    finally:
        torch.set_num_threads(default_threads)
        store.close()
    out = {"host_adamw_layer_params": n, "host_adamw_kernel": "one pass" if native_kernel() else
           "unavailable: one_pass fell back to torch's three passes", "host_cores": cores}
    for way, by_threads in rates.items():
        best = max(by_threads, key=by_threads.get)
        out[f"host_adamw_{way}_gparams_per_s"] = by_threads
        out[f"host_adamw_{way}_best"] = {"gparams_per_s": by_threads[best], "threads": best}
    return out


def first_sparse_layer(arch: ModelArch) -> int:
    """The first block whose tokens use fewer parameters than it holds (a mixture of experts), else 1."""
    layouts = model_layouts(arch)
    return next((l.index for l in layouts[1:-1] if active_layer_params(arch, l) < l.numel), 1)


def time_layer(arch: ModelArch, index: int, shape: Shape, device, dtype, compile_too: bool) -> dict:
    """One decoder layer's forward + backward over one micro-batch (no recompute), eager and (on
    CUDA) compiled. Model TFLOP/s count the parameters a token uses (its routed experts, in a
    mixture of experts) and the model's average attention per layer (a sliding-window layer does
    less model work than that, a global one more)."""
    import torch

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    layout = model_layouts(arch)[index]
    flat = (torch.randn(layout.numel, device=device) * 0.02).to(dtype)
    weights = {k: v.requires_grad_() for k, v in {n: t.detach().clone() for n, t in layout.views(flat).items()}.items()}
    b, t = shape.micro_batch, shape.seq_len
    x = torch.randn(b, t, arch.hidden_size, device=device, dtype=dtype, requires_grad=True)
    pos = torch.arange(t, device=device).expand(b, t)
    fam = family(arch)
    ctx = fam.layer_context(arch, fam.context(arch, pos, dtype), layout.index)
    dy = torch.randn_like(x)
    active = active_layer_params(arch, layout)
    layer_flops = (6 * active + fam.attention_flops_per_token(arch, t) / arch.num_layers) * b * t  # fwd + bwd

    def fwd_bwd(fn):
        def run():
            y = fn(arch, weights, x, ctx)
            torch.autograd.grad(y, [x, *weights.values()], dy)
        return run

    out = {"model": arch.model_type, "layer": layout.index, "layer_params": layout.numel, "active_params": active,
           "tokens": b * t}
    eager = median_seconds(fwd_bwd(fam.block), 5, sync)
    out["layer_fwd_bwd_eager_tflops"] = layer_flops / eager / 1e12
    if device.type == "cuda" and compile_too:
        compiled = torch.compile(fam.block, dynamic=False)
        secs = median_seconds(fwd_bwd(compiled), 5, sync)
        out["layer_fwd_bwd_compiled_tflops"] = layer_flops / secs / 1e12
    return out
