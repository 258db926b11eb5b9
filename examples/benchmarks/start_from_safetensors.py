"""From `megatrain-ray bench` to the first step, with the first weights drawn and loaded from a
Hugging Face directory: writes a random Qwen2.5-7B-shaped directory (bf16 safetensors in 4 shards,
as the published one is sharded; config.json from our own export), drops its pages from the page
cache so that the load reads the disk, then runs the benchmark from it and with random weights, one
after the other, and prints each run's start-up line (the parts of the start and when the first step
ended, counted from the command's start).

Usage on the GPU machine, from the repository root (after `source examples/benchmarks/device-setup.sh`):

    python examples/benchmarks/start_from_safetensors.py OUT_DIR [--model qwen2.5-7b] [--dir /tmp/qwen-random]

About 15 GB on local disk at 7B; about 5 minutes on a 16-core, 128 GiB host.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from megatrain_ray.files.hf import export_hf
from megatrain_ray.host.store import init_layer_weights
from megatrain_ray.models.registry import PRESETS, family, model_layouts, num_params

SHAPE = ["--seq-len", "4096", "--micro-batch", "4", "--grad-accum", "8", "--steps", "1", "--warmup", "1",
         "--loss-chunk-tokens", "2048"]


def write_random_model(name: str, out: Path, layers: int | None = None, shards: int = 4) -> float:
    """A random model of the preset's shape as a bf16 directory in about `shards` files; returns seconds."""
    arch = PRESETS[name] if layers is None else PRESETS[name].replace(num_layers=layers)
    fam, layouts = family(arch), model_layouts(arch)
    bf16_bytes = 2 * num_params(arch)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        def layers():
            for layout in layouts:
                flat = torch.empty(layout.numel)
                init_layer_weights(fam, layout, flat, seed=1, std=0.02, pool=pool)
                yield layout.index, flat

        export_hf(out, arch, layers(), dtype=torch.bfloat16, max_shard_bytes=int(bf16_bytes / (shards - 0.5)))
    return time.perf_counter() - t0


def drop_from_page_cache(directory: Path) -> None:
    """The directory's files out of the page cache (their pages are clean once written and synced),
    so the load that follows reads the disk; no root needed."""
    for file in directory.iterdir():
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def bench(args: list[str], log: Path) -> str:
    """One benchmark run in its own process; its output to `log`; returns its start-up lines."""
    cmd = [sys.executable, "-m", "megatrain_ray.cli", "bench", *args]
    print("$ megatrain-ray " + " ".join(cmd[3:]), flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    log.write_text(proc.stdout + proc.stderr)
    wanted = ("executor device", "start-up", "step 0", "first weights", "refused", "Error", "error:")
    lines = [line for line in (proc.stdout + proc.stderr).splitlines()
             if line.startswith(wanted) or "GPU worker built" in line]
    return "\n".join(lines + [f"exit {proc.returncode}, {time.perf_counter() - t0:.1f} s in all"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="logs go here")
    p.add_argument("--model", default="qwen2.5-7b")
    p.add_argument("--dir", default="/tmp/megatrain-random-model", help="where the random model is written")
    p.add_argument("--layers", type=int, default=None, help="fewer decoder blocks (a small machine's check)")
    p.add_argument("--shape", nargs=argparse.REMAINDER, default=SHAPE,
                   help=f"the bench's step and device arguments (default: {' '.join(SHAPE)})")
    args = p.parse_args()
    out, model_dir = Path(args.out), Path(args.dir)
    out.mkdir(parents=True, exist_ok=True)
    if not model_dir.exists():
        seconds = write_random_model(args.model, model_dir, args.layers)
        size = sum(f.stat().st_size for f in model_dir.iterdir())
        print(f"wrote {size / 1e9:.1f} GB ({len(list(model_dir.glob('*.safetensors')))} safetensors files) to "
              f"{model_dir} in {seconds:.1f} s", flush=True)
    drop_from_page_cache(model_dir)
    layers = ["--layers", str(args.layers)] if args.layers else []
    print(bench(["--model", args.model, "--weights", str(model_dir), *layers, *args.shape], out / "bench-safetensors.log"),
          flush=True)
    print(bench(["--model", args.model, *layers, *args.shape], out / "bench-random.log"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
