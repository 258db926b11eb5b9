"""The host side of a gradient summed in host memory (streaming/host_gradients.py) on this machine's
CPU: one share of a vocabulary-sized layer (the compute-dtype gradient a loss chunk or micro-batch
leaves on the host) added into its fp32 sum, as torch's mixed add does it and in widened pieces
(host_gradients.add_widened, what the executor runs), at the GPU worker's torch threads (the
machine's cores over its GPUs, as runtime/actors.py sets them). With a 10 GiB GPU the step plan
sums the embedding's and the head's gradients this way, one share per micro-batch and loss chunk:
`plan` counts each share's add at HOST_ADD_BYTES over the host memory's rate (planning/prediction.py).

Usage: python3 examples/benchmarks/host_add_probe.py [--model qwen2.5-14b] [--gpus 1] [--repeats 3]
"""

import argparse
import os
import time

import torch

from megatrain_ray.models.registry import PRESETS
from megatrain_ray.planning.prediction import HOST_ADD_BYTES, HOST_MEMORY_BYTES_PER_S
from megatrain_ray.streaming.host_gradients import add_widened


def seconds(work, repeats: int) -> float:
    work()
    t0 = time.perf_counter()
    for _ in range(repeats):
        work()
    return (time.perf_counter() - t0) / repeats


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-14b")
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    arch = PRESETS[args.model]
    numel = arch.vocab_size * arch.hidden_size
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.gpus))
    total = torch.zeros(numel, dtype=torch.float32, pin_memory=torch.cuda.is_available())
    part = torch.empty(numel, dtype=torch.bfloat16, pin_memory=torch.cuda.is_available()).normal_()
    plan_s = numel * HOST_ADD_BYTES / HOST_MEMORY_BYTES_PER_S
    print(f"{args.model}: a share of {numel / 1e6:.1f} M params, {torch.get_num_threads()} torch threads; "
          f"plan: {plan_s:.3f} s a share ({HOST_ADD_BYTES} bytes a param at {HOST_MEMORY_BYTES_PER_S / 1e9:.0f} GB/s)")
    for name, work in (("torch's mixed add", lambda: total.add_(part)), ("widened pieces", lambda: add_widened(total, part))):
        s = seconds(work, args.repeats)
        print(f"  {name}: {s:.3f} s a share, {numel / s / 1e9:.2f} G params/s, {numel * HOST_ADD_BYTES / s / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
