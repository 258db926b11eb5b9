#!/usr/bin/env bash
# GRPO at the Qwen2.5-7B shape (8 prompts x 8 completions, 256 + 512 tokens, as grpo-7b-h100.sh) on
# one GPU, then on every GPU of the machine (1, 2, 4 or 8 of them: a step's 8 micro-batches split
# evenly), in one call: the rollout samples on each training GPU (grpo.rollout_gpus null: one copy a
# worker, the step's prompts split between them), so sampling, most of a GRPO step, scales with the
# GPUs. Prints each run's seconds a step and generated tokens/s, and the all-GPU run against the one.
#   bash examples/benchmarks/grpo-gpus.sh [OUT_DIR] [STEPS]
# About 3.5 minutes for one H200 and 2.5 for two (each run builds its 99 GiB host state and writes a
# final checkpoint, which the script deletes before the next run for the disk's sake).
# TINY=1: a tiny model on the CPU (two CPU workers for the GPUs): the script's own check.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-grpo-gpus-results}
steps=${2:-3}
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
out, all_gpus = sys.argv[1], int(sys.argv[2])

def figures(n):
    try:
        rows = [json.loads(line) for line in open(f"{out}/{n}gpu/run/metrics.jsonl")]
    except OSError:
        return None
    later = rows[1:] or rows
    return {k: statistics.median(r[k] for r in later) for k in ("step_seconds", "rollout_tokens_per_s", "rollout_seconds",
                                                                "train_seconds")}

print("\n| GPUs | s a step | generated tokens/s | rollout s | update s | step speed-up vs one GPU |")
print("|---|---|---|---|---|---|")
one = figures(1)
for n in sorted({1, all_gpus}):
    f = figures(n)
    if f is None:
        print(f"| {n} | no metrics: see {out}/{n}gpu/train.log | | | | |")
        continue
    speed = f"{one['step_seconds'] / f['step_seconds']:.2f}x" if one else "-"
    print(f"| {n} | {f['step_seconds']:.1f} | {f['rollout_tokens_per_s']:,.0f} | {f['rollout_seconds']:.1f} | "
          f"{f['train_seconds']:.1f} | {speed} |")
PY
