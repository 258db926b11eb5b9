#!/usr/bin/env bash
# Qwen2.5-7B at 524,288 tokens of context, one sequence a step, on one H100 of the two-GPU machine
# (256 GiB host): its boundary activations parked in host memory (116 GiB by the plan) beside the
# 99 GiB of host state. The plan predicts about 400 s a step, so one timed step runs without a
# warm-up (its time includes the first step's set-up) and eagerly (attention dominates at this
# length). Usage from the repository root (not yet measured):
#   bash examples/benchmarks/long-context-524k.sh OUT_DIR
set -uo pipefail
out=${1:?OUT_DIR}
source examples/benchmarks/device-setup.sh
export CUDA_VISIBLE_DEVICES=0 RAY_memory_monitor_refresh_ms=0
free -g | head -2
timeout 560 python3 -c 'import sys; from megatrain_ray.cli import main; sys.exit(main())' bench --model qwen2.5-7b \
  --seq-len 524288 --micro-batch 1 --grad-accum 1 --steps 1 --warmup 0 --no-compile --loss-chunk-tokens 2048 \
  --json "$out/7b-524k.json" >"$out/7b-524k.log" 2>&1
echo "rc=$?" >>"$out/7b-524k.log"
grep -E "^(plan|step|start-up|timed)|^\| megatrain|boundary activations|Error|rc=" "$out/7b-524k.log"
