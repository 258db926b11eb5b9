"""Where a profiled step's GPU time went: busy and idle time of the compute stream (the stream with
the most kernel time), idle gaps by size and the largest, and kernel time by kind and by name.

    megatrain-ray bench ... --steps 1 --warmup 1 --profile /tmp/prof
    python examples/benchmarks/trace_summary.py /tmp/prof/seq4096-mb4/rank-0/trace.json
"""

from __future__ import annotations

import collections
import json
import sys

KINDS = ("flash", "fmha", "gemm", "nvjet", "cutlass", "sm90", "triton", "elementwise", "reduce", "index",
         "embedding", "copy", "cross", "softmax", "nll")


def kind(name: str) -> str:
    lower = name.lower()
    return next((k for k in KINDS if k in lower), name[:40])


def main(path: str) -> None:
    events = [e for e in json.load(open(path))["traceEvents"]
              if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    streams = collections.defaultdict(list)
    for e in events:
        streams[(e.get("args", {}).get("stream"), e["cat"])].append(e)
    for (stream, cat), evs in streams.items():
        print(f"stream {stream} {cat}: {len(evs)} events, {sum(e['dur'] for e in evs) / 1e3:.1f} ms")
    compute = max((k for k in streams if k[1] == "kernel"), key=lambda k: sum(e["dur"] for e in streams[k]))
    ks = sorted(streams[compute], key=lambda e: e["ts"])
    span = ks[-1]["ts"] + ks[-1]["dur"] - ks[0]["ts"]
    busy = sum(e["dur"] for e in ks)
    print(f"compute stream {compute[0]}: span {span / 1e3:.1f} ms, busy {busy / 1e3:.1f} ms, "
          f"idle {(span - busy) / 1e3:.1f} ms, {len(ks)} kernels")
    gaps = [(ks[i + 1]["ts"] - ks[i]["ts"] - ks[i]["dur"], i) for i in range(len(ks) - 1)]
    by_size: collections.Counter = collections.Counter()
    for gap, _ in gaps:
        by_size["<5us" if gap < 5 else "<20us" if gap < 20 else "<100us" if gap < 100 else
                "<1ms" if gap < 1000 else ">=1ms"] += gap
    print("idle by gap size (ms):", {k: round(v / 1e3, 1) for k, v in by_size.items()})
    for gap, i in sorted(gaps, reverse=True)[:10]:
        print(f"  gap {gap / 1e3:.2f} ms after {ks[i]['name'][:70]} | before {ks[i + 1]['name'][:70]}")
    by_kind: collections.Counter = collections.Counter()
    by_name: collections.Counter = collections.Counter()
    for e in ks:
        by_kind[kind(e["name"])] += e["dur"]
        by_name[e["name"][:110]] += e["dur"]
    print("busy by kind (ms):")
    for k, v in by_kind.most_common(15):
        print(f"  {k}: {v / 1e3:.1f}")
    print("top kernels (ms):")
    for k, v in by_name.most_common(25):
        print(f"  {v / 1e3:7.1f}  {k}")


if __name__ == "__main__":
    main(sys.argv[1])
