"""The disk tier's own speed (host/disk.py), with nothing else running: a store's layers on disk
cycled through its window as the updates of a step cycle through them, reads only and then reads
and writes, against what a plain tool measures of the same disk (dd, fio: disk-tier-h200x4.sh).

  python examples/benchmarks/disk_tier_speed.py --dir /nvme/tier --model mistral-large-123b --layers 8 \
      --mode bf16/int8 --cycles 2 [--json out.json]

The files are written once first (an allocated block that was never written reads as zeros without
touching the disk, which would flatter the reads)."""

from __future__ import annotations

import argparse
import json
import time

from megatrain_ray.host.disk import DiskTier, file_bytes, probe_disk
from megatrain_ray.host.precision import StateFormat
from megatrain_ray.models.registry import PRESETS, model_layouts


def cycle(tier: DiskTier, layers: list[int], cycles: int, dirty: bool) -> float:
    """Seconds for `cycles` passes over the layers, each acquired then released (written back if `dirty`)."""
    t0 = time.perf_counter()
    for _ in range(cycles):
        for i in layers:
            tier.acquire(i)
            tier.release(i, dirty)
    tier.flush()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", required=True)
    p.add_argument("--model", default="mistral-large-123b")
    p.add_argument("--layers", type=int, default=8, help="decoder blocks on disk")
    p.add_argument("--mode", default="bf16/int8", help="optim.master/optim.moments")
    p.add_argument("--cycles", type=int, default=2)
    p.add_argument("--threads", type=int, default=None, help="the tier's I/O threads (default: host/disk.py's)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    fmt = StateFormat(*args.mode.split("/"))
    layouts = {layout.index: layout for layout in model_layouts(PRESETS[args.model].replace(num_layers=args.layers))
               if layout.kind == "block"}
    read_probe, write_probe = probe_disk(args.dir)
    extra = {"threads": args.threads} if args.threads else {}
    tier = DiskTier(args.dir, f"speed{time.time_ns() % 10**6}", layouts, fmt, **extra)
    try:
        order = sorted(layouts)
        total = sum(file_bytes(tier.parts[i]) for i in order)
        cycle(tier, order, 1, dirty=True)  # every block written once
        reads = cycle(tier, order, args.cycles, dirty=False)
        both = cycle(tier, order, args.cycles, dirty=True)
        out = {
            "model": args.model, "mode": args.mode, "layers": len(order), "gib_on_disk": total / 2**30,
            "window_gib": tier.resident_bytes() / 2**30, "direct_io": tier.direct,
            "read_gb_per_s": args.cycles * total / reads / 1e9,
            "read_write_gb_per_s": 2 * args.cycles * total / both / 1e9,  # bytes read plus bytes written
            "probe_read_gb_per_s": read_probe, "probe_write_gb_per_s": write_probe,
        }
    finally:
        tier.close()
    print(f"disk tier on {args.dir} ({'O_DIRECT' if out['direct_io'] else 'buffered'}): {out['layers']} blocks of "
          f"{args.model} in {args.mode}, {out['gib_on_disk']:.1f} GiB, window {out['window_gib']:.2f} GiB: reads "
          f"{out['read_gb_per_s']:.2f} GB/s, reads and writes together {out['read_write_gb_per_s']:.2f} GB/s "
          f"(the probe: {read_probe:.2f} read, {write_probe:.2f} write)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
