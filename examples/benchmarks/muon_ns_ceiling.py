"""How much Muon's Newton-Schulz costs a compute-bound step: one decoder block's orthogonalization
timed on this device, and the tokens/s fraction of AdamW's that is left at best.

    python examples/benchmarks/muon_ns_ceiling.py [--model qwen2.5-7b] [--adamw-step 12.28] [--reps 10]
    python examples/benchmarks/muon_ns_ceiling.py --tiny      # a smoke test: tiny-llama's shapes, any device

Per matrix of the block's Muon tensors (host/muon.py, `muon_slots`; Qwen2.5-7B: q and o 3584 x 3584,
k and v 512 x 3584, gate and up 18944 x 3584, down 3584 x 18944) it runs what the worker's update
phase runs (streaming/muon_step.py): `orthogonalize` on a bf16 gradient and an fp32 momentum already
on the device (the momentum's lerp, Nesterov, torch.optim.Muon's 5 Newton-Schulz iterations in bf16),
and, apart, `newton_schulz` alone. Each is timed over --reps repetitions of the whole block after
--warmup, between CUDA events (perf_counter on the CPU). It prints the seconds a block and a step
(every block of the model), the iterations' FLOP/s (host/muon.py, `newton_schulz_flops`), and the
ceiling AdamW_step / (AdamW_step + NS_step): where the GPU's arithmetic bounds the step, the
iterations add their time whatever overlaps them. On a GPU it also times one block's copies over
PCIe (pinned host memory; 6 bytes a parameter each way with an fp32 momentum), which the update
phase overlaps with the iterations.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from megatrain_ray.host.muon import muon_slots, muon_step, newton_schulz, newton_schulz_flops, orthogonalize
from megatrain_ray.config import config_from_dict
from megatrain_ray.models.registry import PRESETS, model_layouts


class Timer:
    """Seconds of the work queued inside `span`, on CUDA between events."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def span(self, work, reps: int) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                work()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / reps
        t0 = time.perf_counter()
        for _ in range(reps):
            work()
        return (time.perf_counter() - t0) / reps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-7b", help="a preset (megatrain_ray/models/registry.py)")
    p.add_argument("--tiny", action="store_true", help="tiny-llama's shapes: a smoke test that runs on a CPU")
    p.add_argument("--adamw-step", type=float, default=12.28, help="AdamW's step seconds at the shape compared")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args()
    name = "tiny-llama" if args.tiny else args.model
    arch, device = PRESETS[name], torch.device(args.device)
    optim = config_from_dict({"model": {"preset": name}, "optim": {"name": "muon"}}).optim
    step = muon_step(optim, 1.0)
    layouts = [layout for layout in model_layouts(arch) if muon_slots(layout, "muon")]
    slots = muon_slots(layouts[0], "muon")  # every block of these presets has the same matrices
    torch.manual_seed(0)
    grads = [torch.randn(slot.numel, device=device).bfloat16() for slot in slots]
    momenta = [torch.randn(slot.numel, device=device) * 1e-3 for slot in slots]

    def block_orthogonalized():
        for slot, g, m in zip(slots, grads, momenta):
            orthogonalize(g, m, slot.shape, 0.5, step)

    def block_iterated():
        for slot, g in zip(slots, grads):
            newton_schulz(g.view(slot.shape), step.ns_steps)

    timer = Timer(device)
    for work in (block_orthogonalized, block_iterated):
        timer.span(work, args.warmup)
    whole, iterations = timer.span(block_orthogonalized, args.reps), timer.span(block_iterated, args.reps)
    flop = newton_schulz_flops(layouts[0], "muon", step.ns_steps)
    blocks = len(layouts)
    figures = {
        "model": name, "device": torch.cuda.get_device_name(device) if timer.cuda else "cpu",
        "matrices": [list(slot.shape) for slot in slots], "blocks": blocks, "reps": args.reps,
        "block_flop": flop, "orthogonalize_block_s": whole, "newton_schulz_block_s": iterations,
        "orthogonalize_step_s": whole * blocks, "newton_schulz_step_s": iterations * blocks,
        "newton_schulz_flop_per_s": flop / iterations, "adamw_step_s": args.adamw_step,
        "ceiling": args.adamw_step / (args.adamw_step + whole * blocks),
    }
    print(f"{name} on {figures['device']}: {blocks} blocks, matrices {', '.join('x'.join(map(str, s.shape)) for s in slots)}")
    print(f"Newton-Schulz alone: {iterations * 1e3:.2f} ms a block, {iterations * blocks:.3f} s a step, "
          f"{flop / 1e12:.3g} TFLOP a block at {flop / iterations / 1e12:.3g} TFLOP/s")
    print(f"orthogonalize (lerp, Nesterov, Newton-Schulz, as the update phase): {whole * 1e3:.2f} ms a block, "
          f"{whole * blocks:.3f} s a step")
    if timer.cuda:
        figures.update(pcie(grads, momenta, timer, args.reps))
        print(f"one block's copies, pinned: in {figures['h2d_block_s'] * 1e3:.1f} ms ({figures['h2d_gbps']:.1f} GB/s), "
              f"out {figures['d2h_block_s'] * 1e3:.1f} ms ({figures['d2h_gbps']:.1f} GB/s); "
              f"{figures['h2d_block_s'] * blocks:.3f} + {figures['d2h_block_s'] * blocks:.3f} s a step, overlapped")
    print(f"ceiling with AdamW's step {args.adamw_step:.2f} s: {args.adamw_step:.2f} / ({args.adamw_step:.2f} + "
          f"{whole * blocks:.3f}) = {figures['ceiling']:.3f} of AdamW's tokens/s (target 0.95)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)


def pcie(grads: list[torch.Tensor], momenta: list[torch.Tensor], timer: Timer, reps: int) -> dict:
    """One block's trip as the update phase makes it: the bf16 gradient and fp32 momentum in, the
    fp32 momentum and bf16 update out, between pinned host buffers and the device."""
    host = [torch.empty(t.numel(), dtype=t.dtype, pin_memory=True) for t in (*grads, *momenta)]
    device = [*grads, *momenta]
    nbytes = sum(t.numel() * t.element_size() for t in host)

    def upload():
        for d, h in zip(device, host):
            d.copy_(h, non_blocking=True)

    def download():
        for d, h in zip(device, host):
            h.copy_(d, non_blocking=True)

    timer.span(upload, 1)
    timer.span(download, 1)
    up, down = timer.span(upload, reps), timer.span(download, reps)
    return {"block_bytes_each_way": nbytes, "h2d_block_s": up, "d2h_block_s": down,
            "h2d_gbps": nbytes / up / 1e9, "d2h_gbps": nbytes / down / 1e9}


if __name__ == "__main__":
    main()
