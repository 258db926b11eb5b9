"""`megatrain-ray bench --parts`: the ceilings a step is built from, each timed alone: one decoder
layer's forward + backward (for a mixture of experts, beside a dense layer with as many active
parameters) and the host AdamW per thread count."""

from __future__ import annotations

import statistics
import time

from megatrain_ray.bench.workload import Shape
from megatrain_ray.models.arch import ModelArch
from megatrain_ray.models.moe import active_layer_params
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
    equivalent = family(arch).dense_equivalent(arch)
    if equivalent is not None:
        dense = time_layer(equivalent, 1, shape, device, dtype, not args.no_compile)
        out["dense_equivalent"] = dense
        for mode in ("eager", "compiled"):
            key = f"layer_fwd_bwd_{mode}_tflops"
            if key in out and key in dense:
                out[f"moe_over_dense_{mode}"] = out[key] / dense[key]
    return {**out, **bench_host_adamw(arch, args)}


def bench_host_adamw(arch: ModelArch, args) -> dict:
    """The host AdamW on one decoder layer held as a store holds it (its compute buffer in /dev/shm),
    one pass (what the stores run) against torch's fused AdamW in three, per thread count; then the
    one pass in each lean optimizer state mode asked for (--optim-modes: host/precision.py)."""
    import os

    import torch

    from megatrain_ray.host.adamw_kernel import native_kernel
    from megatrain_ray.host.adamw import AdamWStep, adamw_step
    from megatrain_ray.host.precision import StateFormat

    cores = os.cpu_count() or 1
    threads = sorted({t for t in (args.optimizer_threads or [4, 8, 12, cores - 2, cores]) if 1 <= t <= cores})
    named = ["fp32/fp32", "fp32/bf16", "fp32/int8"] + (["bf16/int8"] if args.compute_dtype == "bfloat16" else [])
    modes = [StateFormat(*m.split("/")) for m in args.optim_modes or named]  # a bf16 master needs bf16 compute
    hp = AdamWStep(1, 1e-4, 0.5, (0.9, 0.95), 1e-8, 0.1)
    out = {"host_adamw_kernel": "one pass" if native_kernel() else
           "unavailable: one_pass fell back to torch's three passes", "host_cores": cores, "host_adamw_modes": {}}
    for fmt in modes:
        store, state = _bench_store(arch, args, fmt)
        n = state.layout.numel
        ways = {"one_pass": lambda: store.step_layer(1, hp)}
        if fmt.exact:
            ways["torch_three_pass"] = lambda: adamw_step(state.master, state.exp_avg, state.exp_avg_sq, state.compute,
                                                          state.layout.segments(), hp, 1, one_pass=False)
        try:
            rates = _rates_by_threads(ways, threads, n, f"{fmt.master} master, {fmt.moments} moments")
        finally:
            store.close()
        out["host_adamw_layer_params"] = n
        label = f"{fmt.master}/{fmt.moments}"
        out["host_adamw_modes"][label] = {"bytes_per_param": store.host_bytes() / n, **_best(rates["one_pass"])}
        if fmt.exact:  # the keys earlier reports used
            for way, by_threads in rates.items():
                out[f"host_adamw_{way}_gparams_per_s"] = by_threads
                out[f"host_adamw_{way}_best"] = _best(by_threads)
    return out


def _bench_store(arch: ModelArch, args, fmt):
    """A store of layer 1 alone in `fmt`, with finite normal weights and a gradient in place."""
    import os

    from megatrain_ray.host.memory import DTYPES
    from megatrain_ray.host.store import ShardStore

    store = ShardStore(arch, [1], DTYPES[args.compute_dtype], shm_dir="/dev/shm" if os.path.isdir("/dev/shm") else None,
                       state_format=fmt)
    state = store.layers[1]
    state.master.normal_(0.0, 0.02)  # finite, normal numbers: no subnormal slow paths
    if state.compute is not state.master:
        state.compute.copy_(state.master)
    if state.grad is not state.compute:
        state.grad.normal_(0.0, 1e-3)
    return store, state


def _rates_by_threads(ways: dict, threads: list[int], n: int, what: str) -> dict[str, dict[int, float]]:
    import torch

    rates: dict[str, dict[int, float]] = {way: {} for way in ways}
    default_threads = torch.get_num_threads()
    try:
        for t in threads:
            torch.set_num_threads(t)
            for way, fn in ways.items():
                rates[way][t] = n / median_seconds(fn, 5, lambda: None) / 1e9
                print(f"host AdamW, {what}, {way}, {t} threads: {rates[way][t]:.2f} G params/s", flush=True)
    finally:
        torch.set_num_threads(default_threads)
    return rates


def _best(by_threads: dict[int, float]) -> dict:
    best = max(by_threads, key=by_threads.get)
    return {"gparams_per_s": by_threads[best], "threads": best}


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
