#!/usr/bin/env bash
# Ours against DeepSpeed ZeRO-3 offload (parameters and optimizer on the host, DeepSpeedCPUAdam, its
# documented stage-3 throughput knobs; megatrain_ray/bench/baselines.py), one H100 of the two-GPU
# machine (256 GiB host), the same tokens a step (SEQS sequences of 4,096, default 16: 65,536 tokens),
# fp32 master and moments in both.
#   bash examples/benchmarks/deepspeed-h100x2.sh OUT_DIR 7b [SEQS]  ours (SEQS = 16: 4 x 4; fewer: SEQS x 1
#                                                             and SEQS/2 x 2, on one set of stores), then
#                                                             DeepSpeed at splits SEQS x 1 and SEQS/2 x 2
#   bash examples/benchmarks/deepspeed-h100x2.sh OUT_DIR 14b  DeepSpeed at 14B (its error where it cannot
#                                                             hold it), then ours at 14B
# The call carries .whl and .whl-ds (DeepSpeed built with DS_BUILD_OPS=0: CPU Adam compiles on first use).
set -uo pipefail
out=${1:?OUT_DIR}; size=${2:?7b or 14b}; seqs=${3:-16}
source examples/benchmarks/device-setup.sh
export CUDA_VISIBLE_DEVICES=0 RAY_memory_monitor_refresh_ms=0
ours() { mr bench --model "qwen2.5-$size" --seq-len 4096 --micro-batch 4 --grad-accum 4 --steps 3 --warmup 1 "$@"; }
ours_small() { mr bench --model "qwen2.5-$size" --seq-len 4096 4096 --micro-batch "$seqs" $((seqs / 2)) --grad-accum 1 2 \
  --steps 3 --warmup 1 "$@"; }
deepspeed_at() {  # MICRO_BATCH GRAD_ACCUM [timeout seconds]
  timeout "${3:-400}" python3 -m megatrain_ray.bench.baseline_process --name deepspeed_offload --model "qwen2.5-$size" \
    --seq-len 4096 --micro-batch "$1" --grad-accum "$2" --steps 2 --warmup 1 >"$out/$size-deepspeed-$1x$2.log" 2>&1
  echo "deepspeed $1x$2 rc=$?" >>"$out/$size-deepspeed-$1x$2.log"
  free -g | head -2 >>"$out/$size-deepspeed-$1x$2.log"
}
if [ "$size" = 7b ] && [ "$seqs" != 16 ]; then
  ours_small --json "$out/7b-ours-$seqs.json" >"$out/7b-ours-$seqs.log" 2>&1
  deepspeed_at "$seqs" 1 240
  deepspeed_at $((seqs / 2)) 2 180
elif [ "$size" = 7b ]; then
  ours --json "$out/7b-ours.json" >"$out/7b-ours.log" 2>&1
  deepspeed_at 16 1 260
  deepspeed_at 8 2 200
else
  deepspeed_at 16 1 240
  ours --json "$out/14b-ours.json" >"$out/14b-ours.log" 2>&1
fi
for f in "$out/$size"-*.log; do echo "== $f"; grep -E "tokens/s|status|error|Error|rc=|Mem:|Killed" "$f" | tail -8; done
