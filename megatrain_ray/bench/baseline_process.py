"""Each baseline in a fresh process (`python -m megatrain_ray.bench.baseline_process`): its GPU memory,
process group or crash never reaches the next; a failure comes back as a result."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import traceback

import torch

from megatrain_ray.bench.baselines import BASELINES, RUNNERS, BaselineResult
from megatrain_ray.models.arch import ModelArch
from megatrain_ray.models.registry import arch_from_dict, resolve_arch


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def run_baseline(name: str, arch: ModelArch, seq_len: int, micro_batch: int, grad_accum: int, steps: int,
                 warmup: int, device: str | None = None, lr: float = 1e-4, **options) -> BaselineResult:
    """One baseline in this process (run_baselines calls this in a child)."""
    if name not in RUNNERS:
        return BaselineResult(name, f"unavailable: unknown baseline (known: {', '.join(BASELINES)})")
    return RUNNERS[name](arch, seq_len, micro_batch, grad_accum, steps, warmup, device or default_device(), lr,
                         **options)


def run_baselines(names: list[str], arch: ModelArch, seq_len: int, micro_batch: int, grad_accum: int, steps: int,
                  warmup: int, device: str | None = None, lr: float = 1e-4, timeout_s: float = 1800.0,
                  options: dict | None = None) -> list[BaselineResult]:
    """Each baseline in a fresh `python -m megatrain_ray.bench.baseline_process` process: its GPU memory,
    process group, compiled extensions or a host-OOM kill end with it. A crash, a timeout or
    unreadable output is a result with status "error", never an exception here."""
    results = []
    for name in names:
        unavailable = _unavailable_here(name)
        if unavailable:
            results.append(BaselineResult(name, unavailable))
            continue
        args = {"name": name, "arch": arch.to_dict(), "seq_len": seq_len, "micro_batch": micro_batch,
                "grad_accum": grad_accum, "steps": steps, "warmup": warmup, "device": device, "lr": lr,
                "options": options or {}}
        results.append(_run_child(name, args, timeout_s))
    return results


def splits_for(tokens: int, seq_len: int, limit: int = 64) -> list[tuple[int, int]]:
    """Every (micro_batch, grad_accum) that makes `tokens` tokens a step of seq_len-token rows,
    micro-batches in powers of two up to `limit` sequences."""
    rows = tokens // seq_len
    out, mb = [], 1
    while mb <= min(rows, limit):
        if rows % mb == 0:
            out.append((mb, rows // mb))
        mb *= 2
    return out


def best_of(results: list[BaselineResult]) -> BaselineResult:
    """The fastest run that finished; else the first failure, which says why none did. Every
    split tried is recorded in its config."""
    tried = [{**r.config, "status": r.status, "tokens_per_s": round(r.tokens_per_s, 1)} for r in results]
    ok = [r for r in results if r.status == "ok"]
    best = max(ok, key=lambda r: r.tokens_per_s) if ok else results[0]
    return dataclasses.replace(best, config={**best.config, "tried": tried})


def run_baselines_at_best(names: list[str], arch: ModelArch, seq_len: int, splits: list[tuple[int, int]],
                          steps: int, warmup: int, on_split=lambda result: None, **kwargs) -> list[BaselineResult]:
    """Each baseline at each step split of the same tokens, one fresh process each, keeping its
    fastest: a baseline is compared at its own best micro-batch split, not at ours. `on_split` sees
    each split's result as it comes (the benchmark writes it down before the next one starts)."""
    best = []
    for name in names:
        results = []
        for mb, ga in splits:
            results.append(run_baselines([name], arch, seq_len, mb, ga, steps, warmup, **kwargs)[0])
            on_split(results[-1])
        best.append(best_of(results))
    return best


def _unavailable_here(name: str) -> str:
    """What can be known without starting a process (each start costs seconds of imports)."""
    if name not in RUNNERS:
        return f"unavailable: unknown baseline (known: {', '.join(BASELINES)})"
    if name == "deepspeed_offload" and importlib.util.find_spec("deepspeed") is None:
        return "unavailable: deepspeed not installed"
    return ""


def _run_child(name: str, args: dict, timeout_s: float) -> BaselineResult:
    cmd = [sys.executable, "-m", "megatrain_ray.bench.baseline_process", "--json-args", json.dumps(args)]
    print(f"baseline {name}: starting a fresh process", file=sys.stderr, flush=True)
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=None, text=True, timeout=timeout_s,
                              cwd=os.getcwd(), env=_child_env())
    except subprocess.TimeoutExpired as e:  # a result printed before a hang still counts
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
        return _result_line(out) or BaselineResult(name, "error", error=f"timed out after {timeout_s:.0f} s")
    return _result_line(proc.stdout) or BaselineResult(
        name, "error", error=f"process exited {proc.returncode} without a result "
                             f"(negative: killed by signal, e.g. -9 for the host OOM killer)")


def _result_line(stdout: str) -> BaselineResult | None:
    lines = [line for line in stdout.splitlines() if line.strip()]
    try:
        return BaselineResult(**json.loads(lines[-1])) if lines else None
    except (json.JSONDecodeError, TypeError):
        return None


def _child_env() -> dict:
    """The child must import this package even when it is not installed (tests, a checkout)."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


@contextlib.contextmanager
def stdout_to_stderr():
    """Everything printed while a baseline runs (DeepSpeed logs, ninja builds: file descriptor 1,
    not only sys.stdout) goes to stderr, so stdout carries the one JSON line."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m megatrain_ray.bench.baseline_process", description=__doc__.splitlines()[0])
    p.add_argument("--name", choices=BASELINES, help="which baseline")
    p.add_argument("--model", default="qwen2.5-1.5b", help="preset name or a Hugging Face config.json / model dir")
    p.add_argument("--layers", type=int, default=None, help="override the number of decoder blocks")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--grad-accum", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when there is one)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--no-checkpoint", action="store_true", help="keep every block's activations (no recompute)")
    p.add_argument("--json-args", default=None, help="all of the above as one JSON object (run_baselines uses it)")
    return p.parse_args(argv)


def _call_from_args(args: argparse.Namespace) -> dict:
    if args.json_args:
        j = json.loads(args.json_args)
        return {"name": j["name"], "arch": arch_from_dict(j["arch"]), "seq_len": j["seq_len"],
                "micro_batch": j["micro_batch"], "grad_accum": j["grad_accum"], "steps": j["steps"],
                "warmup": j["warmup"], "device": j.get("device"), "lr": j.get("lr", 1e-4), **j.get("options", {})}
    if not args.name:
        raise SystemExit("--name or --json-args is required")
    arch = resolve_arch(args.model)
    if args.layers:
        arch = arch.replace(num_layers=args.layers)
    return {"name": args.name, "arch": arch, "seq_len": args.seq_len, "micro_batch": args.micro_batch,
            "grad_accum": args.grad_accum, "steps": args.steps, "warmup": args.warmup, "device": args.device,
            "lr": args.lr, "checkpoint_blocks": not args.no_checkpoint}


def main(argv: list[str] | None = None) -> int:
    call = _call_from_args(parse_args(argv))
    with stdout_to_stderr():
        try:
            result = run_baseline(**call)
        except Exception:  # noqa: BLE001 - setup errors too come back as a result
            result = BaselineResult(call["name"], "error", error=traceback.format_exc(limit=8))
    print(json.dumps(dataclasses.asdict(result)), flush=True)
    return 0


if __name__ == "__main__":
    # Once its result line is out, the process ends at once: the parent has all it needs, and on the
    # H100 machine a DeepSpeed child sat for minutes after its last step instead of exiting.
    code = main()
    sys.stderr.flush()
    os._exit(code)
