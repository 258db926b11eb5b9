"""Qwen3-Next's gated delta rule at the 3.9B shape's size (2 x 4,096 tokens, 32 heads of 128), forward
and backward: transformers' PyTorch fallback (eager, and compiled unless --no-compile) against
flash-linear-attention's Triton kernel. Prints each one's milliseconds and the kernel's largest
difference from the fallback (outputs and input gradients, relative to their scale).
Usage: python examples/benchmarks/fla_probe.py [--no-compile]"""
import sys
import time

import torch
import torch.nn.functional as F
from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule


def inputs(batch=2, tokens=4096, heads=32, dim=128, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    def r(*s):
        return torch.randn(*s, device="cuda", generator=g)
    q = F.normalize(r(batch, tokens, heads, dim), dim=-1).bfloat16()
    k = F.normalize(r(batch, tokens, heads, dim), dim=-1).bfloat16()
    v = r(batch, tokens, heads, dim).bfloat16()
    gate = -F.softplus(r(batch, tokens, heads)).float() * 0.1
    beta = torch.sigmoid(r(batch, tokens, heads)).bfloat16()
    return [t.requires_grad_() for t in (q, k, v, gate, beta)]


def run(fn, xs, dout):
    out = fn(*xs)
    out = out[0] if isinstance(out, tuple) else out
    grads = torch.autograd.grad(out, xs, dout)
    return out, grads


def timed(fn, xs, dout, reps=5):
    run(fn, xs, dout)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        run(fn, xs, dout)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


def main():
    xs = inputs()
    dout = torch.randn_like(xs[2])
    fallback = lambda q, k, v, g, b: torch_chunk_gated_delta_rule(q, k, v, g, b)
    ref_out, ref_grads = run(fallback, xs, dout)
    print(f"fallback eager: {timed(fallback, xs, dout):.1f} ms forward+backward", flush=True)
    if "--no-compile" not in sys.argv:
        t0 = time.perf_counter()
        compiled = torch.compile(fallback)
        run(compiled, xs, dout)
        print(f"fallback compiled: compiled in {time.perf_counter() - t0:.0f} s, "
              f"{timed(compiled, xs, dout):.1f} ms forward+backward", flush=True)
    import fla
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    kernel = lambda q, k, v, g, b: chunk_gated_delta_rule(q, k, v, g, b, scale=q.shape[-1] ** -0.5)
    out, grads = run(kernel, xs, dout)
    scale = lambda t: t.float().abs().max().item()
    diffs = [(out.float() - ref_out.float()).abs().max().item() / scale(ref_out)]
    diffs += [(a.float() - b.float()).abs().max().item() / scale(b) for a, b in zip(grads, ref_grads)]
    print(f"fla {fla.__version__} kernel: {timed(kernel, xs, dout):.1f} ms forward+backward; largest difference "
          f"from the fallback relative to scale: out {diffs[0]:.2e}, dq dk dv dg dbeta "
          + " ".join(f"{d:.2e}" for d in diffs[1:]), flush=True)


if __name__ == "__main__":
    main()
