"""What one decoder block's kept forward graph holds on the GPU, and what it costs, per activation
budget of the kept-graph compilation (streaming/compiled.py); and the pinned PCIe rate.

    python examples/benchmarks/probe_kept_block.py --model qwen2.5-3b --micro-batch 4 --seq-len 4096 --budgets 1.0 0.8 0.6 0.4

Each budget compiles the block anew through compile_kept_block, beside the default compilation the
recompute path uses, so a budget that did not take (a shared compile cache) shows the default's bytes.
"""

from __future__ import annotations

import argparse
import collections

import torch

from megatrain_ray.bench.parts import median_seconds
from megatrain_ray.streaming.compiled import compile_block, compile_kept_block
from megatrain_ray.models.registry import family, model_layouts, resolve_arch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen2.5-3b")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--budgets", type=float, nargs="+", default=[1.0, 0.8, 0.6, 0.4])
    args = p.parse_args()
    arch, dev, dt = resolve_arch(args.model), torch.device("cuda"), torch.bfloat16
    layout = model_layouts(arch)[1]
    flat = (torch.randn(layout.numel, device=dev) * 0.02).to(dt)
    w = {n: t.detach().clone().requires_grad_() for n, t in layout.views(flat).items()}
    b, t = args.micro_batch, args.seq_len
    x = torch.randn(b, t, arch.hidden_size, device=dev, dtype=dt, requires_grad=True)
    fam = family(arch)
    ctx = fam.layer_context(arch, fam.context(arch, torch.arange(t, device=dev).expand(b, t), dt), 1)
    dy = torch.randn_like(x)
    weights = {v.data_ptr() for v in w.values()}

    def probe(name: str, block) -> None:
        def fwd_bwd():
            torch.autograd.grad(block(arch, w, x, ctx), [x, *w.values()], dy)

        def fwd():
            with torch.no_grad():
                block(arch, w, x, ctx)

        saved: collections.Counter = collections.Counter()

        def pack(s):
            if s.data_ptr() not in weights and s.data_ptr() != x.data_ptr():
                saved[(tuple(s.shape), str(s.dtype))] += s.numel() * s.element_size()
            return s

        sync = torch.cuda.synchronize
        t_fb, t_f = median_seconds(fwd_bwd, 5, sync), median_seconds(fwd, 5, sync)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda s: s):
            y = block(arch, w, x, ctx)
        held = torch.cuda.memory_allocated() - before - y.numel() * y.element_size()
        torch.autograd.grad(y, [x, *w.values()], dy)
        print(f"{name}: forward {t_f * 1e3:.1f} ms, forward + backward {t_fb * 1e3:.1f} ms, graph holds "
              f"{held / 2**30:.2f} GiB ({held / (b * t) / 1024:.1f} KiB a token)", flush=True)
        for (shape, dtype), nbytes in saved.most_common(6):
            print(f"    saved {shape} {dtype}: {nbytes / 2**20:.0f} MiB")

    probe("default (recompute path)", compile_block(fam.block))
    for budget in args.budgets:
        probe(f"kept, budget {budget}", compile_kept_block(fam.block, budget))

    n = 5 * 2**30 // 2
    device_buf = torch.empty(n, dtype=dt, device=dev)
    host_buf = torch.empty(n, dtype=dt, pin_memory=True)
    for name, copy in [("d2h", lambda: host_buf.copy_(device_buf, non_blocking=True)),
                       ("h2d", lambda: device_buf.copy_(host_buf, non_blocking=True))]:
        s = median_seconds(copy, 3, torch.cuda.synchronize)
        print(f"{name}, 5 GiB pinned: {s * 1e3:.0f} ms, {5 * 2**30 / s / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
