"""A checkpoint of a store with the disk tier on the tier's own file system: its files hard-linked into
the checkpoint (files/shard.py, link_tier_files) against copied into it (the links refused). Prints, for
each, the seconds the checkpoint took and the bytes it took from the file system (its free space before
and after), and the seconds of the step after it (whose writes give each linked file a fresh one:
host/disk.py, DiskTier._unshare) against a step without a checkpoint before it.

  python examples/benchmarks/checkpoint_reuse.py --dir /nvme/run --model qwen2.5-1.5b --layers 4 \\
      --mode bf16/int8 [--fully] [--json out.json]

A store of the model with `--layers` blocks, every layer but the embedding on disk (`--fully`: the
blocks' compute copies too), trained 2 steps from drawn gradients first."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

import torch

from megatrain_ray.files import checkpoint as ckpt
from megatrain_ray.files import shard
from megatrain_ray.host.adamw import AdamWStep
from megatrain_ray.host.precision import StateFormat
from megatrain_ray.host.store import ShardStore
from megatrain_ray.models.registry import PRESETS


def step(store: ShardStore, n: int) -> float:
    """One update of every layer from a drawn gradient; seconds, its writes on disk included."""
    t0 = time.perf_counter()
    hp = AdamWStep(n, 1e-4, 1.0, (0.9, 0.95), 1e-8, 0.1)
    for i in store.layers:
        with store.landing_gradient(i) as grad:
            grad.normal_(generator=torch.Generator().manual_seed(n * 1000 + i))
        store.step_layer(i, hp)
    store.disk.flush()
    if store.hot is not None:
        store.hot.tier.flush()
    return time.perf_counter() - t0


def free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def checkpoint(store: ShardStore, root: Path, n: int) -> dict:
    root.mkdir(parents=True, exist_ok=True)
    os.sync()
    before, t0 = free(root), time.perf_counter()
    staging = ckpt.new_staging_dir(root, n)
    entry = shard.save_shard(store, str(staging), "shard-000.safetensors")
    path = ckpt.commit(staging, root, n, [entry], {"step": n}, keep=10)
    seconds = time.perf_counter() - t0
    os.sync()
    return {"seconds": seconds, "gb_taken": (before - free(root)) / 1e9, "linked_files": len(entry.get(ckpt.LINKED, ())),
            "path": str(path)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", required=True, help="the tier's and the checkpoints' directory (one file system)")
    p.add_argument("--model", default="qwen2.5-1.5b")
    p.add_argument("--layers", type=int, default=4, help="decoder blocks")
    p.add_argument("--mode", default="bf16/int8", help="optim.master/optim.moments")
    p.add_argument("--fully", action="store_true", help="the blocks' compute copies on disk too")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    fmt = StateFormat(*args.mode.split("/"))
    arch = PRESETS[args.model].replace(num_layers=args.layers)
    layers = list(range(args.layers + 2))
    blocks = tuple(range(1, args.layers + 1))
    root = Path(args.dir)
    store = ShardStore(arch, layers, torch.bfloat16 if fmt.master == "bf16" else torch.float32, state_format=fmt,
                       seed=3, disk_dir=str(root / "tier"), disk_layers=tuple(layers[1:]),
                       disk_compute_layers=blocks if args.fully else ())
    try:
        store.init_random(seed=5, std=0.02)
        store.fault_in_moments()
        step(store, 1)
        plain = step(store, 2)
        tiers = [store.disk] + ([store.hot] if store.hot is not None else [])
        for tier in tiers:
            tier.link = lambda *_: False  # the links refused: a copy
        copied = checkpoint(store, root / "copied", 2)
        for tier in tiers:
            del tier.link
        linked = checkpoint(store, root / "linked", 2)
        after = step(store, 3)
        out = {"model": args.model, "layers": args.layers, "mode": args.mode, "fully": args.fully,
               "tier_gb": store.disk.file_bytes() / 1e9 + (store.hot.tier.file_bytes() / 1e9 if store.hot else 0),
               "copied": copied, "linked": linked, "step_s": plain, "step_after_linked_checkpoint_s": after}
        print(json.dumps(out, indent=2))
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    finally:
        store.close()
        shutil.rmtree(root / "copied", ignore_errors=True)
        shutil.rmtree(root / "linked", ignore_errors=True)


if __name__ == "__main__":
    main()
