#!/usr/bin/env bash
# One H100 (the nvidia-h100-x1 kind: 80 GB, 128 GiB host), one run after the other: the 7B headline
# at 131,072 tokens a step, then the capped-GPU runs of gpu-cap-h100.sh one at a time (7B under
# 10 GiB with fp32 state, 14B under 24 GiB in the 6-byte mode), each after its `plan`.
# Usage from the repository root: bash examples/benchmarks/h100-headline-caps.sh OUT_DIR
set -uo pipefail
out=${1:?OUT_DIR}
source examples/benchmarks/device-setup.sh
export CUDA_VISIBLE_DEVICES=0 RAY_memory_monitor_refresh_ms=0
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 200 python3 -c 'import sys; from megatrain_ray.cli import main; sys.exit(main())' bench --model qwen2.5-7b \
  --seq-len 4096 --micro-batch 4 --grad-accum 8 --steps 3 --warmup 1 --loss-chunk-tokens 2048 \
  --json "$out/bench7b.json" >"$out/bench7b.log" 2>&1
mr plan examples/qwen2.5-7b-10g.yaml --gpu H100 >"$out/7b-10g-plan.log" 2>&1
timeout 150 python3 -c 'import sys; from megatrain_ray.cli import main; sys.exit(main())' bench --model qwen2.5-7b \
  --gpu-memory-gib 10 --seq-len 4096 --grad-accum 4 --steps 3 --warmup 1 --json "$out/7b-10g.json" >"$out/7b-10g.log" 2>&1
mr plan examples/qwen2.5-14b-lean.yaml --set executor.gpu_memory_gib=24 --gpu H100 >"$out/14b-24g-plan.log" 2>&1
timeout 190 python3 -c 'import sys; from megatrain_ray.cli import main; sys.exit(main())' bench --model qwen2.5-14b \
  --optim-modes bf16/int8 --gpu-memory-gib 24 --seq-len 4096 --grad-accum 4 --steps 3 --warmup 1 \
  --json "$out/14b-24g.json" >"$out/14b-24g.log" 2>&1
for f in bench7b 7b-10g 14b-24g; do
  echo "== $f"; grep -E "predicted peak|tokens/s" "$out/$f-plan.log" 2>/dev/null | head -4
  grep -E "^(step|executor|device memory)|tokens/s|Error" "$out/$f.log" | tail -8
done
