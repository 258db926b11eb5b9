"""Where a rollout copy's decode step goes, on one GPU: the GRPO rollout (rl/rollout.py, Rollout)
built alone at a preset's shape with random weights (no Ray, no stores, no trainer), sampling
rows x new tokens after prompts of `--prompt` tokens, as a run's copy does.

It prints, for one copy of 64 rows and of 32 (a step's 8 x 8 completions on one GPU and on each of
two), the milliseconds a decode step, the CPU share of the decoding thread (near 100%: each step
waits for the host to launch its kernels, so the GPU idles), and from torch.profiler the GPU's busy
time a decode step and the kernels launched a step. Then two copies of 32 rows sampling at the same
time in two processes on the one GPU, and one copy of 32 rows beside a process that only burns a
CPU core: whether copies slow each other through the host (its cores, the CUDA driver) or the GPU.

    python examples/benchmarks/rollout-decode.py [--preset qwen2.5-7b] [--prompt 256] [--new 64] [--eager] [--alone]
    python examples/benchmarks/rollout-decode.py --preset tiny-llama --device cpu --prompt 8 --new 8  # its check

About two minutes at the Qwen2.5-7B shape on an H200 (each process builds its 15 GB copy)."""

import argparse
import multiprocessing as mp
import os
import time

import numpy as np
import torch

from megatrain_ray.models.registry import PRESETS
from megatrain_ray.rl.rollout import CopyTiming, Rollout, Sampling, overlap


def built(preset: str, device: str, graphs: bool = True) -> Rollout:
    rollout = Rollout(PRESETS[preset], torch.bfloat16, torch.device(device), seed=0, graphs=graphs)
    with torch.no_grad():
        for name, p in rollout.model.named_parameters():
            p.fill_(1.0) if p.ndim == 1 and "norm" in name else p.normal_(0.0, 0.02)
    return rollout


def sampled(rollout: Rollout, rows: int, prompt: int, new: int) -> CopyTiming:
    gen = np.random.default_rng(rows)
    prompts = [gen.integers(0, rollout.arch.vocab_size, prompt) for _ in range(rows // 8)]
    return rollout.sample_scored(prompts, 8, Sampling(max_new_tokens=new), scored=True)[2][0]


def said(what: str, t: CopyTiming) -> str:
    return (f"{what}: {t.ms_per_decode_step:.1f} ms a decode step, decode loop's CPU share {100 * t.cpu_share:.0f}%, "
            f"{t.tokens / t.seconds:,.0f} tok/s ({t.seconds:.2f} s, prompts' forward {t.prefill_seconds:.2f} s)")


def gpu_busy(rollout: Rollout, rows: int, prompt: int, new: int, device: str) -> str:
    """torch.profiler over a sampling: the kernels' device time and launches, per forward."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        t = sampled(rollout, rows, prompt, new)
    averages = prof.key_averages()
    device_us = sum(a.self_device_time_total for a in averages)
    launches = sum(a.count for a in averages if "LaunchKernel" in a.key or "launchKernel" in a.key)
    forwards = t.decode_steps + 1
    return (f"profiled ({rows} rows, {new} new tokens, the profiler's own overhead included): the GPU busy "
            f"{device_us / 1000 / forwards:.1f} ms a forward of {1000 * t.seconds / forwards:.1f} ms, "
            f"{launches / forwards:.0f} kernel launches a forward")


def copy_process(preset, device, graphs, rows, prompt, new, barrier, queue):
    torch.set_num_threads(1)
    rollout = built(preset, device, graphs)
    sampled(rollout, 8, prompt, 2)  # warm up
    barrier.wait()
    queue.put(sampled(rollout, rows, prompt, new))


def burner(stop):
    while not stop.is_set():
        sum(i * i for i in range(10000))


def side_by_side(args) -> list[CopyTiming]:
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=copy_process, args=(args.preset, args.device, not args.eager, 32, args.prompt, args.new, barrier, queue))
             for _ in range(2)]
    for p in procs:
        p.start()
    times = [queue.get(timeout=900) for _ in procs]
    for p in procs:
        p.join()
    return times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen2.5-7b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--eager", action="store_true", help="each decode step's kernels launched one by one (no CUDA graph)")
    ap.add_argument("--alone", action="store_true", help="the one copy's samplings only: no profile, no other process")
    args = ap.parse_args()
    torch.set_num_threads(1)  # as a rollout actor runs (Ray's OMP_NUM_THREADS=1 for an actor of no CPU)
    rollout = built(args.preset, args.device, not args.eager)
    print(f"{args.preset}, {args.prompt} + {args.new} tokens, on {args.device}; this process may use "
          f"{len(os.sched_getaffinity(0))} of {os.cpu_count()} CPUs; {rollout.describe_decoding()}", flush=True)
    sampled(rollout, 8, args.prompt, 2)  # warm up
    for rows in (64, 32, 64, 32):
        print(said(f"one copy, {rows} rows", sampled(rollout, rows, args.prompt, args.new)), flush=True)
    if args.alone:
        return
    try:
        print(gpu_busy(rollout, 64, args.prompt, min(args.new, 16), args.device), flush=True)
    except Exception as e:  # the rest still runs
        print(f"profile failed: {e!r}", flush=True)
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    burn = ctx.Process(target=burner, args=(stop,))
    burn.start()
    time.sleep(1.0)
    print(said("one copy, 32 rows, beside a process burning a CPU core", sampled(rollout, 32, args.prompt, args.new)),
          flush=True)
    stop.set()
    burn.join()
    del rollout
    if args.device == "cuda":
        torch.cuda.empty_cache()
    times = side_by_side(args)
    for i, t in enumerate(times):
        print(said(f"two copies on the one {args.device} at once, copy {i}, 32 rows", t), flush=True)
    print(f"two copies: overlap {100 * overlap(times):.0f}%, together "
          f"{sum(t.tokens for t in times) / (max(t.end for t in times) - min(t.start for t in times)):,.0f} tok/s",
          flush=True)


if __name__ == "__main__":
    main()
