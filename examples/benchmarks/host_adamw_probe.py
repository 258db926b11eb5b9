"""The one-pass host AdamW kernel on this node, three ways of sharing a layer among threads, three
placements of its buffers, per thread count; and torch's own memory bandwidth for scale.

    python examples/benchmarks/host_adamw_probe.py [--params 233057792] [--threads 12 14 16] [--repeats 9]

Scheduling: the kernel as shipped (64 Ki-element tiles taken from a shared counter), 16 Ki tiles,
and one equal static range per thread (the kernel before 2026-11-23). Placement: as a store holds a
layer (torch.empty/zeros, the compute buffer in /dev/shm), anonymous memory first touched by
torch's threads, and the same with MADV_HUGEPAGE. Each line: median/best G params/s. The default
size is one Qwen2.5-7B decoder layer. 2026-11-23-h100.md, "The host optimizer, measured".
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load_inline

from megatrain_ray.host import adamw_kernel as host_adamw
from megatrain_ray.host.memory import shm_tensor

STATIC_STEP = r"""
template <typename T>
void step(float* p, float* m, float* v, T* gw, int64_t n, c10::ArrayRef<int64_t> ends,
          c10::ArrayRef<double> decays, Scalars s) {
  at::parallel_for(0, (n + kTile - 1) / kTile, 1, [&](int64_t t0, int64_t t1) {
    const int64_t lo = t0 * kTile, hi = std::min(n, t1 * kTile);
    int64_t start = 0;
    for (size_t k = 0; k < ends.size(); start = ends[k++]) {
      const int64_t a = std::max(lo, start), b = std::min(hi, ends[k]);
      if (a < b) update(p + a, m + a, v + a, gw + a, b - a, float(decays[k]), s);
    }
  });
}

"""


def variant(name: str, tile: int, static: bool):
    """The shipped source under its own op namespace, with another tile size or the static split."""
    shipped = "constexpr int64_t kTile = 65536;"
    if shipped not in host_adamw._SOURCE:
        raise SystemExit(f"host/adamw_kernel.py no longer says {shipped!r}: update this probe")
    src = host_adamw._SOURCE.replace(shipped, f"constexpr int64_t kTile = {tile};")
    if static:
        head, rest = src.split("template <typename T>\nvoid step(", 1)
        head = head.rsplit("// Threads take tiles", 1)[0]
        src = head + STATIC_STEP + "}  // namespace\n" + rest.split("}  // namespace\n", 1)[1]
    src = src.replace("TORCH_LIBRARY(megatrain,", f"TORCH_LIBRARY({name},")
    load_inline(name, cpp_sources=[src], extra_cflags=host_adamw._CFLAGS, extra_ldflags=["-fopenmp"],
                build_directory=tempfile.mkdtemp(), is_python_module=False)
    return getattr(torch.ops, name).adamw_step


def anonymous(n: int, dtype: torch.dtype, huge: bool) -> torch.Tensor:
    size = n * torch.empty(0, dtype=dtype).element_size()
    mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge:
        mm.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(mm, dtype=dtype, count=n)  # the tensor keeps the mapping alive


def buffers(kind: str, n: int) -> tuple[torch.Tensor, ...]:
    if kind == "store-like":
        p, m, v = torch.empty(n), torch.zeros(n), torch.zeros(n)
        path = Path("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()) / f"adamw-probe-{os.getpid()}"
        g = shm_tensor(path, n, torch.bfloat16, create=True)
        path.unlink()  # the mapping stays until the tensor goes
    else:
        huge = kind == "anonymous-huge"
        p, m, v, g = (anonymous(n, dt, huge) for dt in (torch.float32,) * 3 + (torch.bfloat16,))
        for t in (p, m, v, g):
            t.zero_()  # first touch by torch's threads
    p.normal_(0.0, 0.02)  # finite, normal numbers: no subnormal slow paths
    g.copy_(p)
    return p, m, v, g


def timings(fn, repeats: int) -> list[float]:
    """Seconds of each of `repeats` calls, after one untimed call."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def rate(kernel, bufs, n: int, threads: int, repeats: int) -> tuple[float, float]:
    torch.set_num_threads(threads)
    args = ([n], [0.99999], 1.0, 0.9, 0.95, 0.3, 1e-8, 1e-4)
    times = timings(lambda: kernel(*bufs, *args), repeats)
    return n / statistics.median(times) / 1e9, n / min(times) / 1e9


def bandwidth(threads: int, n: int = 2**29) -> dict[str, float]:
    """torch's in-place multiply (8 bytes an element) and out-of-place add (12), GB/s."""
    torch.set_num_threads(threads)
    a, b, c = torch.ones(n), torch.ones(n), torch.empty(n)
    out = {}
    for name, fn, nbytes in (("in-place mul", lambda: a.mul_(1.0), 8), ("add out", lambda: torch.add(a, b, out=c), 12)):
        out[name] = round(n * nbytes / statistics.median(timings(fn, 7)) / 1e9, 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, default=233_057_792)
    ap.add_argument("--threads", type=int, nargs="+", default=[12, 14, 16])
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    kernels = {"tiles 64Ki (shipped)": host_adamw.native_kernel(), "tiles 16Ki": variant("probe_tiles16k", 16384, False),
               "static ranges": variant("probe_static", 4096, True)}
    for t in args.threads:
        print(f"bandwidth, {t} threads, GB/s: {bandwidth(t)}", flush=True)
    for kind in ("store-like", "anonymous", "anonymous-huge"):
        bufs = buffers(kind, args.params)
        for t in args.threads:
            row = {name: "%.2f/%.2f" % rate(k, bufs, args.params, t, args.repeats) for name, k in kernels.items()}
            print(f"{kind:14s} {t:2d} threads, median/best G params/s: {row}", flush=True)
        del bufs


if __name__ == "__main__":
    main()
