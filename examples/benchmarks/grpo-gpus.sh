#!/usr/bin/env bash
# GRPO at the Qwen2.5-7B shape (8 prompts x 8 completions, 256 + 512 tokens, as grpo-7b-h100.sh) on
# one GPU, then on every GPU of the machine (1, 2, 4 or 8 of them: a step's 8 micro-batches split
# evenly), in one call: the rollout samples on each training GPU (grpo.rollout_gpus null: one copy a
# worker, the step's prompts split between them), so sampling, most of a GRPO step, scales with the
# GPUs. Prints each run's seconds a step and generated tokens/s, and the all-GPU run against the one;
# and each rollout copy's sampling (seconds, tokens, ms a decode step) and how much of the longest
# copy's time all copies sampled together (overlap: 100% where they run side by side), so a run that
# does not scale shows whether the copies ran one after another or each decoded slower; and the CPU
# share of each copy's decode loop (near 100%: its steps wait on the host's kernel launches, and
# copies slow each other where they share the host's cores).
#   bash examples/benchmarks/grpo-gpus.sh [OUT_DIR] [STEPS]
# Each run builds its 99 GiB host state and writes a final checkpoint, which the script deletes before the
# next run for the disk's sake; at 2 steps on two H200s (2026-11-29) the one-GPU run and the two-GPU run's
# steps fit within 500 s (the limit then cut the two-GPU run's checkpoint): a 10-minute call holds 2 steps.
# TINY=1: a tiny model on the CPU (two CPU workers for the GPUs): the script's own check.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-grpo-gpus-results}
steps=${2:-5}  # the rollout's rate still rises over the first steps (634, 1,840, 2,191 tok/s on one H200)
mkdir -p "$out"
out=$(cd "$out" && pwd)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export RAY_memory_monitor_refresh_ms=${RAY_memory_monitor_refresh_ms:-0}
base="--set model.preset=qwen2.5-7b"
if [[ -n "${TINY:-}" ]]; then
  base="--set model.preset=tiny-llama --set executor.device=cpu --set runtime.worker_threads=1"
  export SHAPE=tiny
  export NEW_TOKENS=${NEW_TOKENS:-8} PROMPT_TOKENS=${PROMPT_TOKENS:-8} PROMPT_VOCAB=256
  all=2
else
  visible=$(nvidia-smi -L | wc -l)
  all=$(for n in 8 4 2 1; do if (( n <= visible )); then echo "$n"; break; fi; done)
fi
for n in $(if (( all > 1 )); then echo 1 "$all"; else echo 1; fi); do
  echo "== GRPO on $n GPU(s)"
  MODEL_SETS="$base --set runtime.num_gpus=$n" bash "$here/grpo-7b-h100.sh" "$out/${n}gpu" 8 "$steps"
  rm -rf "$out/${n}gpu/run/checkpoints"
done
python - "$out" "$all" <<'PY'
import json, statistics, sys
from megatrain_ray.rl.rollout import CopyTiming
out, all_gpus = sys.argv[1], int(sys.argv[2])

def figures(n):
    try:
        rows = [json.loads(line) for line in open(f"{out}/{n}gpu/run/metrics.jsonl")]
    except OSError:
        return None
    later = rows[1:] or rows
    f = {k: statistics.median(r[k] for r in later) for k in ("step_seconds", "rollout_tokens_per_s", "rollout_seconds",
                                                             "train_seconds", "rollout_overlap")}
    copies = [CopyTiming(**c) for r in later for c in r["rollout_copies"]]
    ms = [c.ms_per_decode_step for c in copies]
    return {**f, "copies": len(later[-1]["rollout_copies"]), "ms_step": statistics.median(ms), "ms_step_max": max(ms),
            "prefill": statistics.median(c.prefill_seconds for c in copies),
            "cpu": statistics.median(c.cpu_share for c in copies)}

print("\n| GPUs | s a step | generated tokens/s | rollout s | update s | step speed-up vs one GPU "
      "| copies | ms a decode step (median, slowest) | prompts' forward s | copies' overlap | decode loop's CPU share |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
one = figures(1)
for n in sorted({1, all_gpus}):
    f = figures(n)
    if f is None:
        print(f"| {n} | no metrics: see {out}/{n}gpu/train.log | | | | | | | | | |")
        continue
    speed = f"{one['step_seconds'] / f['step_seconds']:.2f}x" if one else "-"
    print(f"| {n} | {f['step_seconds']:.1f} | {f['rollout_tokens_per_s']:,.0f} | {f['rollout_seconds']:.1f} | "
          f"{f['train_seconds']:.1f} | {speed} | {f['copies']} | {f['ms_step']:.1f}, {f['ms_step_max']:.1f} | "
          f"{f['prefill']:.2f} | {100 * f['rollout_overlap']:.0f}% | {100 * f['cpu']:.0f}% |")
PY
