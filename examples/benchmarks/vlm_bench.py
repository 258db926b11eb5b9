"""Image-text fine-tuning speed: the run's own session (stores, GPU worker, step plan, as
`megatrain-ray train` makes them) on micro-batches of image-text rows read through the data path
and the model's processor, made before the timed steps (so the step's time is the model's; the
time the driver spent making them is printed beside it). No checkpoint is written: an 8 B model's
optimizer state would not fit the GPU machine's disk.

    python examples/benchmarks/vlm_bench.py MODEL_DIR ROWS [--train-vision] [--micro-batch 4]
        [--grad-accum 8] [--seq-len 4096] [--steps 3] [--warmup 1] [--device cuda] [--moments fp32] [--no-compile] [--json OUT]

MODEL_DIR holds config.json (random init) and the processor's files (vlm_data.py makes both).
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model_dir")
    p.add_argument("rows")
    p.add_argument("--train-vision", action="store_true")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--device", default="cuda")
    p.add_argument("--moments", default="fp32", help="optim.moments (bf16: 10 bytes a parameter on the host, not 14)")
    p.add_argument("--no-compile", action="store_true", help="executor.compile: false")
    p.add_argument("--json")
    args = p.parse_args()

    from megatrain_ray.config import config_from_dict
    from megatrain_ray.data import build_dataset
    from megatrain_ray.models.registry import model_arch, model_layouts, num_params, params_text
    from megatrain_ray.planning.report import describe
    from megatrain_ray.runtime.cluster import connect
    from megatrain_ray.runtime.session import Session

    dtype = "bfloat16" if args.device == "cuda" else "float32"
    config = config_from_dict({
        "model": {"preset": f"{args.model_dir}/config.json", "compute_dtype": dtype, "train_vision": args.train_vision},
        "data": {"source": args.rows, "tokenizer": args.model_dir, "seq_len": args.seq_len},
        "optim": {"moments": args.moments},
        "train": {"steps": args.warmup + args.steps, "micro_batch_size": args.micro_batch, "grad_accum": args.grad_accum},
        "executor": {"device": args.device, "loss_chunk_tokens": 2048, "compile": not args.no_compile},
    })
    arch = model_arch(config.model)
    print(f"model: {arch.model_type}, {params_text(num_params(arch))} (embedding layer with the vision tower: "
          f"{params_text(model_layouts(arch)[0].numel)}), train_vision {args.train_vision}", flush=True)
    t0 = time.perf_counter()
    stream = build_dataset(config.data, arch.vocab_size, 0).batches(args.micro_batch, args.grad_accum)
    steps = [next(stream)[0] for _ in range(args.warmup + args.steps)]
    data_s = (time.perf_counter() - t0) / len(steps)
    print(f"data: {data_s:.2f} s a step on the driver (the processor over "
          f"{args.micro_batch * args.grad_accum} rows), made before the timed steps", flush=True)

    connect(config.runtime)
    session = Session(config, arch)
    try:
        session.init_weights()
        print(f"executor device: {session.start_executor()}", flush=True)
        print(describe(session.arch, session.config, session.plan), flush=True)
        rows = []
        for i, batch in enumerate(steps):
            if i == args.warmup:
                t_timed = time.perf_counter()
            r = session.train_step(batch)
            rows.append(r)
            print(f"step {i}: loss {r.loss:.4f}, {r.tokens / r.seconds:,.0f} tokens/s, {r.seconds:.2f} s, "
                  f"GPU peak {r.peak_device_bytes / 2**30:.1f} GiB", flush=True)
        wall = time.perf_counter() - t_timed
        session.drain()
    finally:
        session.close()
    timed = rows[args.warmup:]
    result = {"tokens_per_s": sum(r.tokens for r in timed) / wall,
              "loss_tokens_per_s": sum(r.target_tokens for r in timed) / wall,
              "gpu_peak_gib": max(r.peak_device_bytes for r in rows) / 2**30,
              "data_seconds_per_step": data_s, "train_vision": args.train_vision, "moments": args.moments,
              "losses": [r.loss for r in rows]}
    print(f"result: {result['tokens_per_s']:,.0f} tokens/s ({result['loss_tokens_per_s']:,.0f} loss tokens/s), "
          f"GPU peak {result['gpu_peak_gib']:.1f} GiB", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
