"""The scaling table of `megatrain-ray bench --json` runs at several GPU counts (scale-gpus.sh):
tokens/s, model TFLOP/s, the scaling against the one-GPU run and the plan's predicted tokens/s.
    python examples/benchmarks/scaling_table.py RUN.json [RUN.json ...]"""

import json
import sys


def measured(path: str) -> dict | None:
    """A run's first shape's medians, or None where it did not finish one."""
    try:
        runs = json.load(open(path))["runs"]
    except (OSError, ValueError, KeyError):
        return None
    return runs[0]["median"] if runs and "median" in runs[0] else None


def main(paths: list[str]) -> None:
    rows = sorted(((m["num_gpus"], m, path) for path in paths if (m := measured(path)) is not None),
                  key=lambda row: row[0])
    if not rows:
        print("no run finished a timed step")
        return
    one = next((m["tokens_per_s"] for n, m, _ in rows if n == 1), None)
    print("\n| GPUs | tokens/s | model TFLOP/s | scaling vs one GPU | step s | host optimizer s | bound by | "
          "plan: tokens/s, bound |")
    print("|---|---|---|---|---|---|---|---|")
    for n, m, path in rows:
        p = m.get("predicted") or {}
        plan = f"{p['tokens'] / p['step_s']:,.0f}, {p['bound']}" if p else "none (no GPU rates)"
        scaling = f"{m['tokens_per_s'] / one:.2f}x" if one else "no one-GPU run"
        print(f"| {n} | {m['tokens_per_s']:,.0f} | {m['model_tflops']:.0f} | {scaling} | {m['seconds']:.2f} | "
              f"{m['optimizer_s_per_step']:.2f} | {m['bound']} | {plan} |")


if __name__ == "__main__":
    main(sys.argv[1:])
