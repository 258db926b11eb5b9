#!/usr/bin/env bash
# GRPO at the Qwen2.5-7B shape on one H100 80GB (128 GiB host): random weights and random 256-token
# prompts (throughput is the point), 8 completions per prompt, 512 new tokens each (no EOS: every
# completion runs to 512), bf16 compute and rollout, fp32 master and AdamW on the host.
#   bash examples/benchmarks/grpo-7b-h100.sh [OUT_DIR] [PROMPTS_PER_STEP] [STEPS]
# Prints the rollout's and the update's tokens/s and the seconds per step (the median of the steps
# after the first, which compiles), from the run's metrics.jsonl, and leaves the run in OUT_DIR.
# Other shapes (examples/benchmarks/grpo-streamed.sh): SHAPE names it, MODEL_SETS adds --set
# arguments (the model, the optimizer's state), NEW_TOKENS and PROMPT_TOKENS the lengths (PROMPT_VOCAB
# the prompts' token ids' bound, for a smaller vocabulary). On a
# machine of two GPUs, MODEL_SETS="--set model.preset=qwen2.5-7b --set grpo.rollout_gpu=own" rolls
# out on the second GPU while the first trains, one policy version behind.
# The rollout's bf16 copy (15 GiB + the KV cache: about 19 GiB) shares the GPU with the trainer, whose
# step the run plans within the rest (it says how much; GPU_GIB=N sets executor.gpu_memory_gib
# instead); the copy stays on the GPU between steps. MegaTrain's README reports ~60 s a step at 7B on one H100 with a smaller rollout batch.
set -euo pipefail
out=${1:-grpo-7b-results}
prompts_per_step=${2:-8}
steps=${3:-4}
shape=${SHAPE:-Qwen2.5-7B}
new_tokens=${NEW_TOKENS:-512}
prompt_tokens=${PROMPT_TOKENS:-256}
read -r -a model_sets <<< "${MODEL_SETS:---set model.preset=qwen2.5-7b}"
cap=()
if [[ -n "${GPU_GIB:-}" ]]; then cap=(--set executor.gpu_memory_gib="$GPU_GIB"); fi
mkdir -p "$out"
out=$(cd "$out" && pwd)

python - "$out" "$prompts_per_step" "$prompt_tokens" "${PROMPT_VOCAB:-150000}" <<'PY'
import json, random, sys
out, n, length, vocab = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
rng = random.Random(0)
with open(f"{out}/prompts.jsonl", "w") as f:
    for i in range(max(64, 4 * n)):
        f.write(json.dumps({"prompt_ids": [rng.randrange(vocab // 150, vocab) for _ in range(length)]}) + "\n")
with open(f"{out}/bench_rewards.py", "w") as f:
    f.write("def low_tokens(prompts, completions, completion_ids, **columns):\n"
            "    return [sum(t < 20000 for t in ids) / max(1, len(ids)) for ids in completion_ids]\n")
PY

cd "$out"
megatrain-ray train /dev/null --overwrite \
  "${model_sets[@]}" --set model.compute_dtype=bfloat16 \
  --set data.source="$out/prompts.jsonl" --set data.seq_len=$((prompt_tokens + new_tokens)) \
  --set train.objective=grpo --set train.steps="$steps" --set train.micro_batch_size=8 \
  --set train.output_dir="$out/run" --set train.step_timeout_s=3600 \
  --set grpo.group_size=8 --set grpo.prompts_per_step="$prompts_per_step" --set grpo.max_new_tokens="$new_tokens" \
  --set "grpo.rewards={bench_rewards:low_tokens: 1.0}" \
  --set optim.lr=1e-6 --set checkpoint.export_hf=false "${cap[@]}" 2>&1 | tee "$out/train.log" ||
  echo "the run exited non-zero: see train.log (on a GPU machine's small disk the final checkpoint can end it; the steps' metrics are kept)"

grep -E "the rollout's copy samples on|rollout device:" "$out/train.log" || true
python - "$out/run/metrics.jsonl" "$prompts_per_step" "$shape" "$prompt_tokens" "$new_tokens" <<'PY'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
n, shape, prompt, new = int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
later = rows[1:] or rows
med = lambda key: statistics.median(r[key] for r in later)
print(f"GRPO, {shape} shape, {n} prompts x 8 completions, {prompt} + {new} tokens, steps after the first "
      f"({len(later)}):")
print(f"  rollout {med('rollout_tokens_per_s'):,.0f} tokens/s ({med('rollout_seconds'):.1f} s, "
      f"{1000 * med('rollout_seconds') / new:.0f} ms a decode step with the prompts' forward), "
      f"update {med('train_tokens_per_s'):,.0f} tokens/s ({med('train_seconds'):.1f} s), "
      f"{med('step_seconds'):.1f} s a step (of which the rollout copy's weight refresh {med('refresh_seconds'):.1f} s); "
      f"generated tokens per step {8 * n * new:,}; "
      f"first step {rows[0]['step_seconds']:.1f} s")
PY
