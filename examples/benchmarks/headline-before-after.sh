#!/usr/bin/env bash
# The 7B headline with the code before a change (a copy of its megatrain_ray/ in .before/) and after,
# one after the other on GPU 0, then the host AdamW per state mode on one 7B layer.
# Usage on the GPU machine, from the repository root: bash examples/benchmarks/headline-before-after.sh OUT_DIR
set -uo pipefail
out=${1:?OUT_DIR}
source examples/benchmarks/device-setup.sh
export CUDA_VISIBLE_DEVICES=0
HEADLINE="bench --model qwen2.5-7b --seq-len 4096 --micro-batch 4 --grad-accum 8 --steps 3 --warmup 1 --loss-chunk-tokens 2048"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
(cd .before && PYTHONPATH=/tmp/site:$PWD mr $HEADLINE --json "$out/bench7b-before.json") 2>&1 | tee "$out/bench7b-before.log" | grep -E "^(step|executor|bench)"
mr $HEADLINE --json "$out/bench7b-after.json" 2>&1 | tee "$out/bench7b-after.log" | grep -E "^(step|executor|bench)"
mr bench --model qwen2.5-7b --parts --optimizer-threads 14 16 --seq-len 4096 --micro-batch 1 --json "$out/parts-7b.json" \
  2>&1 | tee "$out/parts-7b.log" | grep -E "host AdamW|layer"
