"""Does megatrain-ray's Muon train as torch.optim.Muon does? The same Qwen2 model, from the same
weights, on the same batches of real text, three ways: megatrain-ray with optim.name muon, with
optim.name adamw, and plain PyTorch (transformers' Qwen2ForCausalLM under bf16 autocast,
torch.optim.Muon for the decoder layers' matrices, torch.optim.AdamW for the rest, the same
warmup-cosine schedule and gradient clipping); the held-out loss of each after the same steps.

The text is the Python standard library's sources (examples/benchmarks/lean_quality.py: every 20th
file held out), as bytes: a byte-level tokenizer (256 byte values and an end-of-file token), so
nothing is trained before the runs. megatrain-ray runs in process (runtime/local.py), its Muon
step's Newton-Schulz on the GPU where the step plan puts it.

    # the GPU run: about 90 M parameters, 160 steps of 16 x 1,024 = 16,384 tokens each
    python examples/benchmarks/muon_quality.py --json muon-quality.json
    # a check on a CPU (a tiny model, a few steps)
    python examples/benchmarks/muon_quality.py --tiny --steps 6

It exits 1 when megatrain-ray Muon's held-out loss is more than --tolerance (relative) from plain
PyTorch Muon's.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from megatrain_ray.config import config_from_dict
from megatrain_ray.files import shard
from megatrain_ray.models.registry import load_hf_arch, num_params
from megatrain_ray.runtime.local import LocalTrainer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lean_quality import HELD_OUT_EVERY, micro_batch, read_texts, source_files, step_batches  # noqa: E402

EOS = 256  # the end-of-file token after the 256 byte values
SIZES = {  # hidden, layers, heads, kv heads, intermediate, sequence, micro-batch, micro-batches a step
    "gpu": dict(hidden=768, layers=12, heads=12, kv_heads=4, intermediate=2560, seq=1024, micro_batch=8, accum=2),
    "tiny": dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, seq=64, micro_batch=4, accum=2),
}
ARMS = ("megatrain-ray muon", "megatrain-ray adamw", "pytorch muon")


def byte_rows(texts: list[str], seq: int) -> torch.Tensor:
    """The texts' UTF-8 bytes, each file ended by EOS, concatenated and cut into rows of seq + 1."""
    eos = torch.tensor([EOS])
    ids = torch.cat([part for text in texts
                     for part in (torch.frombuffer(bytearray(text.encode("utf-8")) or bytearray(1), dtype=torch.uint8)
                                  .long(), eos)])
    rows = ids.numel() // (seq + 1)
    return ids[: rows * (seq + 1)].view(rows, seq + 1)


def initial_model(size: dict, seed: int, root: Path) -> Path:
    """A transformers Qwen2 drawn from `seed` (initializer_range 0.02), saved for every arm to start from."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.Qwen2Config(
        vocab_size=EOS + 1, hidden_size=size["hidden"], intermediate_size=size["intermediate"],
        num_hidden_layers=size["layers"], num_attention_heads=size["heads"], num_key_value_heads=size["kv_heads"],
        max_position_embeddings=size["seq"], tie_word_embeddings=False)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(root / "initial")
    return root / "initial"


def optim_settings(args, name: str) -> dict:
    return {"name": name, "lr": args.lr, "muon_lr": args.muon_lr, "weight_decay": args.weight_decay,
            "warmup_steps": args.steps // 10, "grad_clip": 1.0, "min_lr_ratio": 0.1}


def megatrain_run(name: str, model_dir: Path, size: dict, args, batches, held_out) -> dict:
    """megatrain-ray in process with optim.name `name`, from the saved weights."""
    config = config_from_dict({
        "model": {"path": str(model_dir), "compute_dtype": "bfloat16"},
        "optim": optim_settings(args, name),
        "train": {"steps": args.steps, "micro_batch_size": size["micro_batch"], "grad_accum": size["accum"],
                  "seed": args.seed},
        "executor": {"device": args.device, "compile": False, "embedding_step": "host"},
    })
    arch = load_hf_arch(model_dir)
    trainer = LocalTrainer(config, arch)
    t0 = time.perf_counter()
    losses = []
    try:
        for store in trainer.stores:
            shard.load_hf(store, str(model_dir))
        if name == "muon":
            print(f"  megatrain-ray muon: Newton-Schulz on the GPU for {len(trainer.plan.muon_on_device)} blocks",
                  flush=True)
        for k, step in enumerate(batches, start=1):
            losses.append(trainer.train_step(step).loss)
            report(f"megatrain-ray {name}", k, len(batches), losses[-1])
        result = trainer.eval_loss(held_out)
        host_bytes = sum(s.host_bytes() for s in trainer.stores)
    finally:
        trainer.close()
    return {"arm": f"megatrain-ray {name}", "held_out_loss": result.loss_sum / result.target_tokens,
            "train_loss_last10": sum(losses[-10:]) / len(losses[-10:]), "seconds": time.perf_counter() - t0,
            "host_bytes_per_param": host_bytes / num_params(arch), "params": num_params(arch)}


def report(arm: str, k: int, steps: int, loss: float) -> None:
    if k % max(1, steps // 8) == 0 or k == steps:
        print(f"  {arm}: step {k}/{steps}, loss {loss:.4f}", flush=True)


def lr_factor(update: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup to the peak at the last warmup update, then a half cosine to min_ratio of it."""
    if update < warmup:
        return (update + 1) / warmup
    done = min(1.0, (update - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * (1 + math.cos(math.pi * done)) / 2


def summed_loss(model, mb: dict, device) -> torch.Tensor:
    with torch.autocast(device.type, dtype=torch.bfloat16):
        logits = model(input_ids=mb["input_ids"].to(device), position_ids=mb["position_ids"].to(device),
                       use_cache=False).logits
    return F.cross_entropy(logits.float().flatten(0, 1), mb["labels"].to(device).flatten(), reduction="sum")


def pytorch_run(model_dir: Path, args, batches, held_out) -> dict:
    """Plain PyTorch: torch.optim.Muon on the decoder layers' matrices, torch.optim.AdamW (decay on the
    other matrices) on the rest, fp32 weights, bf16 autocast, clip_grad_norm_."""
    import transformers

    device = torch.device("cuda" if args.device != "cpu" and torch.cuda.is_available() else "cpu")
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    named = list(model.named_parameters())
    muon = [p for n, p in named if ".layers." in n and p.dim() == 2]
    rest = [(n, p) for n, p in named if not any(p is q for q in muon)]
    o = optim_settings(args, "muon")
    adamw = torch.optim.AdamW([{"params": [p for _, p in rest if p.dim() >= 2], "weight_decay": o["weight_decay"]},
                               {"params": [p for _, p in rest if p.dim() < 2], "weight_decay": 0.0}], lr=o["lr"],
                              betas=(0.9, 0.95), eps=1e-8)
    matrices = torch.optim.Muon(muon, lr=o["muon_lr"], weight_decay=o["weight_decay"], momentum=0.95, nesterov=True,
                                ns_steps=5, adjust_lr_fn="original")
    factor = lambda k: lr_factor(k, o["warmup_steps"], args.steps, o["min_lr_ratio"])  # noqa: E731
    schedules = [torch.optim.lr_scheduler.LambdaLR(opt, factor) for opt in (adamw, matrices)]
    t0 = time.perf_counter()
    losses = []
    model.train()
    for k, step in enumerate(batches, start=1):
        target = sum(int((mb["labels"] != -100).sum()) for mb in step)
        total = 0.0
        for mb in step:
            loss = summed_loss(model, mb, device) / target
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), o["grad_clip"])
        for opt in (adamw, matrices):
            opt.step()
            opt.zero_grad(set_to_none=True)
        for schedule in schedules:
            schedule.step()
        losses.append(total)
        report("pytorch muon", k, len(batches), total)
    model.eval()
    with torch.no_grad():
        loss_sum = sum(float(summed_loss(model, mb, device)) for mb in held_out)
    targets = sum(int((mb["labels"] != -100).sum()) for mb in held_out)
    return {"arm": "pytorch muon", "held_out_loss": loss_sum / targets,
            "train_loss_last10": sum(losses[-10:]) / len(losses[-10:]), "seconds": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="a tiny model and few files: a check on a CPU")
    p.add_argument("--steps", type=int, default=160)
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW's (the AdamW arm, and the Muon arms' other tensors)")
    p.add_argument("--muon-lr", type=float, default=0.02)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--files", type=int, default=None, help="use only the first N source files (default: all; --tiny: 60)")
    p.add_argument("--eval-batches", type=int, default=8, help="held-out micro-batches")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    p.add_argument("--tolerance", type=float, default=0.01, help="largest relative held-out loss difference, "
                                                                  "megatrain-ray Muon against plain PyTorch's")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    size = SIZES["tiny" if args.tiny else "gpu"]

    files = source_files(args.files or (60 if args.tiny else None))
    texts = read_texts(files)
    train_rows = byte_rows([t for k, t in enumerate(texts) if k % HELD_OUT_EVERY], size["seq"])
    eval_rows = byte_rows([t for k, t in enumerate(texts) if k % HELD_OUT_EVERY == 0], size["seq"])
    print(f"text: {len(files)} files of {source_files(None)[0].parent} ({train_rows.numel() / 1e6:.2f} M training "
          f"bytes, {eval_rows.numel() / 1e6:.2f} M held out)", flush=True)
    batches = step_batches(train_rows, args.steps, size["micro_batch"], size["accum"], args.seed)
    n_eval = min(args.eval_batches, eval_rows.shape[0] // size["micro_batch"])
    held_out = [micro_batch(eval_rows[k * size["micro_batch"]: (k + 1) * size["micro_batch"]]) for k in range(n_eval)]

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = initial_model(size, args.seed, Path(tmp))
        for arm in args.arms:
            if arm == "pytorch muon":
                results[arm] = pytorch_run(model_dir, args, batches, held_out)
            else:
                results[arm] = megatrain_run(arm.split()[-1], model_dir, size, args, batches, held_out)
    tokens = size["micro_batch"] * size["accum"] * size["seq"]
    params = next((r["params"] for r in results.values() if "params" in r), 0)
    print(f"\n{params / 1e6:.1f} M params, {args.steps} steps of {tokens} tokens, held-out loss over "
          f"{n_eval * size['micro_batch'] * size['seq']} tokens:")
    print("| run | host bytes/param | train loss (last 10 steps) | held-out loss | seconds |")
    print("|---|---|---|---|---|")
    for r in results.values():
        bpp = f"{r['host_bytes_per_param']:.2f}" if "host_bytes_per_param" in r else ""
        print(f"| {r['arm']} | {bpp} | {r['train_loss_last10']:.4f} | {r['held_out_loss']:.4f} | {r['seconds']:.0f} |")
    ok = True
    if "megatrain-ray muon" in results and "pytorch muon" in results:
        diff = results["megatrain-ray muon"]["held_out_loss"] / results["pytorch muon"]["held_out_loss"] - 1
        ok = abs(diff) <= args.tolerance
        print(f"megatrain-ray Muon against plain PyTorch Muon: {100 * diff:+.2f}% "
              f"({'within' if ok else 'outside'} {100 * args.tolerance:g}%)")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
