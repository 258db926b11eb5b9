"""Does a lean optimizer state train as well as fp32? The same model, from the same weights, on the
same batches of real text, in each optimizer state mode (optim.master / optim.moments); the
held-out loss of each after the same steps, and its relative difference to fp32's.

The text is the Python standard library's own sources (on every machine that runs this), every
20th file (in sorted order) held out; a byte-level BPE tokenizer is trained on the rest with the
`tokenizers` package, deterministically. Training runs in process (runtime/local.py: the stores,
the host optimizer and the streaming executor, no Ray).

    # the GPU run (a ~100 M-parameter Llama-shaped model, 200 steps of 16 x 512 tokens, each mode)
    python examples/benchmarks/lean_quality.py
    # a check on a CPU (a tiny model, a few steps)
    python examples/benchmarks/lean_quality.py --tiny --steps 20

It exits 1 when a lean mode's held-out loss is more than --tolerance (relative) above fp32's.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import sysconfig
import time
from pathlib import Path

import torch

from megatrain_ray.config import config_from_dict
from megatrain_ray.models.registry import model_arch, num_params
from megatrain_ray.runtime.local import LocalTrainer

MODES = ["fp32/fp32", "fp32/bf16", "fp32/int8", "bf16/int8"]  # 14, 10, 8 and 6 bytes a parameter
HELD_OUT_EVERY = 20  # every 20th source file is held out
EOS = "<|endoftext|>"

SIZES = {  # hidden, layers, heads, intermediate, vocabulary, sequence, micro-batch, micro-batches a step
    "gpu": dict(hidden=768, layers=12, heads=12, intermediate=2048, vocab=8192, seq=512, micro_batch=8, accum=2),
    "tiny": dict(hidden=64, layers=2, heads=4, intermediate=128, vocab=512, seq=64, micro_batch=4, accum=2),
}


def source_files(limit: int | None) -> list[Path]:
    """The standard library's .py files in a fixed order (site-packages left out: it differs between machines)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file())
    return files[:limit] if limit else files


def read_texts(files: list[Path]) -> list[str]:
    return [f.read_text(encoding="utf-8", errors="replace") for f in files]


def train_tokenizer(texts: list[str], vocab: int):
    """Byte-level BPE on the training texts: the same merges on every run of the same texts."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def token_rows(tok, texts: list[str], seq: int) -> torch.Tensor:
    """The texts' tokens, each file ended by EOS, concatenated and cut into rows of seq + 1."""
    eos = tok.token_to_id(EOS)
    ids = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos)
    rows = len(ids) // (seq + 1)
    return torch.tensor(ids[: rows * (seq + 1)], dtype=torch.int64).view(rows, seq + 1)


def micro_batch(rows: torch.Tensor) -> dict:
    b, t = rows.shape[0], rows.shape[1] - 1
    return {"input_ids": rows[:, :-1].contiguous(), "labels": rows[:, 1:].contiguous(),
            "position_ids": torch.arange(t).expand(b, t).contiguous()}


def step_batches(rows: torch.Tensor, steps: int, micro: int, accum: int, seed: int) -> list[list[dict]]:
    """Each step's micro-batches, drawn once from a seeded shuffle: every mode sees the same ones."""
    gen = torch.Generator().manual_seed(seed)
    order = torch.cat([torch.randperm(rows.shape[0], generator=gen)
                       for _ in range(math.ceil(steps * micro * accum / rows.shape[0]))])
    picks = order[: steps * micro * accum].view(steps, accum, micro)
    return [[micro_batch(rows[idx]) for idx in step] for step in picks]


def config_for(mode: str, size: dict, args) -> dict:
    master, moments = mode.split("/")
    return {
        "model": {"preset": "tiny-llama", "compute_dtype": "bfloat16", "init_std": 0.02,
                  "overrides": {"vocab_size": size["vocab"], "hidden_size": size["hidden"],
                                "intermediate_size": size["intermediate"], "num_layers": size["layers"],
                                "num_heads": size["heads"], "num_kv_heads": size["heads"],
                                "head_dim": size["hidden"] // size["heads"],
                                "max_position_embeddings": size["seq"]}},
        "optim": {"lr": args.lr, "warmup_steps": args.steps // 10, "master": master, "moments": moments},
        "train": {"steps": args.steps, "micro_batch_size": size["micro_batch"], "grad_accum": size["accum"],
                  "seed": args.seed},
        "executor": {"device": args.device, "compile": args.device != "cpu" and not args.no_compile,
                     "embedding_step": "host"},  # every mode steps every layer on the host: like for like
    }


def train_mode(mode: str, size: dict, args, batches: list[list[dict]], held_out: list[dict]) -> dict:
    config = config_from_dict(config_for(mode, size, args))
    arch = model_arch(config.model)
    trainer = LocalTrainer(config, arch)
    t0 = time.perf_counter()
    losses = []
    try:
        for k, step in enumerate(batches, start=1):
            losses.append(trainer.train_step(step).loss)
            if k % max(1, args.steps // 10) == 0 or k == len(batches):
                print(f"  {mode}: step {k}/{len(batches)}, loss {losses[-1]:.4f}", flush=True)
        result = trainer.eval_loss(held_out)
    finally:
        trainer.close()
    bytes_per_param = sum(s.host_bytes() for s in trainer.stores) / num_params(arch)
    return {"mode": mode, "bytes_per_param": bytes_per_param, "train_loss_last10": sum(losses[-10:]) / len(losses[-10:]),
            "held_out_loss": result.loss_sum / result.target_tokens, "seconds": time.perf_counter() - t0,
            "params": num_params(arch)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="a tiny model and few files: a check on a CPU")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", nargs="+", default=MODES, help="MASTER/MOMENTS; fp32/fp32 first is the reference")
    p.add_argument("--files", type=int, default=None, help="use only the first N source files (default: all; --tiny: 200)")
    p.add_argument("--eval-batches", type=int, default=16, help="held-out micro-batches")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--tolerance", type=float, default=0.01, help="largest relative held-out loss excess over fp32")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    if args.modes[0] != "fp32/fp32":
        p.error("--modes must start with fp32/fp32, the reference")
    size = SIZES["tiny" if args.tiny else "gpu"]

    files = source_files(args.files or (200 if args.tiny else None))
    train_files = [f for k, f in enumerate(files) if k % HELD_OUT_EVERY]
    eval_files = [f for k, f in enumerate(files) if k % HELD_OUT_EVERY == 0]
    t0 = time.perf_counter()
    train_texts, eval_texts = read_texts(train_files), read_texts(eval_files)
    tok = train_tokenizer(train_texts, size["vocab"])
    train_rows, eval_rows = token_rows(tok, train_texts, size["seq"]), token_rows(tok, eval_texts, size["seq"])
    print(f"text: {len(train_files)} training files ({train_rows.numel() / 1e6:.2f} M tokens), {len(eval_files)} "
          f"held out ({eval_rows.numel() / 1e6:.2f} M tokens), from {sysconfig.get_paths()['stdlib']}; "
          f"BPE vocabulary {tok.get_vocab_size()}, {time.perf_counter() - t0:.0f} s", flush=True)
    batches = step_batches(train_rows, args.steps, size["micro_batch"], size["accum"], args.seed)
    n_eval = min(args.eval_batches, eval_rows.shape[0] // size["micro_batch"])
    held_out = [micro_batch(eval_rows[k * size["micro_batch"]: (k + 1) * size["micro_batch"]]) for k in range(n_eval)]

    results = []
    for mode in args.modes:
        results.append(train_mode(mode, size, args, batches, held_out))
    ref = results[0]["held_out_loss"]
    print(f"\n{results[0]['params'] / 1e6:.1f} M params, {args.steps} steps of "
          f"{size['micro_batch'] * size['accum'] * size['seq']} tokens, held-out loss over "
          f"{n_eval * size['micro_batch'] * size['seq']} tokens:")
    print("| optim.master/moments | host bytes/param | train loss (last 10 steps) | held-out loss | vs fp32 | seconds |")
    print("|---|---|---|---|---|---|")
    worst = 0.0
    for r in results:
        r["relative_to_fp32"] = r["held_out_loss"] / ref - 1.0
        worst = max(worst, r["relative_to_fp32"])
        print(f"| {r['mode']} | {r['bytes_per_param']:.2f} | {r['train_loss_last10']:.4f} | {r['held_out_loss']:.4f} | "
              f"{100 * r['relative_to_fp32']:+.2f}% | {r['seconds']:.0f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    ok = worst <= args.tolerance
    print(f"every lean mode within {100 * args.tolerance:g}% of fp32's held-out loss: {'yes' if ok else 'no'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
