#!/usr/bin/env bash
# Small GPUs stood for by a capped H100 (executor.gpu_memory_gib): what `plan` predicts for each cap,
# then the runs: Qwen2.5-7B under 10 GiB (fp32 state) on GPU 0, and Qwen2.5-14B under 24 GiB in the
# 6-byte mode (bf16 master, int8 moments) on GPU 1, side by side. The compute is an H100's.
# Usage from the repository root: bash examples/benchmarks/gpu-cap-h100.sh OUT_DIR
set -uo pipefail
out=${1:?OUT_DIR}
source examples/benchmarks/device-setup.sh
export RAY_memory_monitor_refresh_ms=0
CUDA_VISIBLE_DEVICES=0 mr plan examples/qwen2.5-7b-10g.yaml --gpu H100 >"$out/7b-10g-plan.log" 2>&1
CUDA_VISIBLE_DEVICES=1 mr plan examples/qwen2.5-14b-lean.yaml --set executor.gpu_memory_gib=24 --gpu H100 \
  >"$out/14b-24g-plan.log" 2>&1
(CUDA_VISIBLE_DEVICES=1 mr bench --model qwen2.5-14b --optim-modes bf16/int8 --gpu-memory-gib 24 --seq-len 4096 \
   --grad-accum 4 --steps 3 --warmup 1 --json "$out/14b-24g.json" >"$out/14b-24g.log" 2>&1) &
CUDA_VISIBLE_DEVICES=0 mr bench --model qwen2.5-7b --gpu-memory-gib 10 --seq-len 4096 --grad-accum 4 --steps 3 --warmup 1 \
  --json "$out/7b-10g.json" >"$out/7b-10g.log" 2>&1
wait
for f in 7b-10g 14b-24g; do
  echo "== $f"; grep -E "tokens|step time|GPU|fits|cap" "$out/$f-plan.log" | head -12
  grep -E "^(step|executor|plan|device memory)|capped|fit|tokens/s|Error" "$out/$f.log" | tail -12
done
