#!/usr/bin/env bash
# A small GPU stood for by a capped H100 (executor.gpu_memory_gib): the plan, then Qwen2.5-7B under a
# 10 GiB cap. The compute is an H100's. Usage from the repository root: bash examples/benchmarks/gpu-cap-h100.sh OUT_DIR
set -uo pipefail
out=${1:?OUT_DIR}
source examples/benchmarks/device-setup.sh
export CUDA_VISIBLE_DEVICES=0 RAY_memory_monitor_refresh_ms=0
mr bench --model qwen2.5-7b --gpu-memory-gib 10 --seq-len 4096 --grad-accum 4 --steps 2 --warmup 1 --json "$out/7b-10g.json" \
  2>&1 | tee "$out/7b-10g.log" | grep -E "^(step|executor|plan|device memory|  )|capped|fit"
