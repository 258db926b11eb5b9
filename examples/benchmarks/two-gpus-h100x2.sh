#!/usr/bin/env bash
# On the two-H100 machine (nvidia-h100-x2), one call: the GPU tests of the embedding's step and of two
# GPUs, then Qwen2.5-7B at 131,072 tokens per GPU a step on one GPU and on two, one after the other.
# Usage from the repository root: bash examples/benchmarks/two-gpus-h100x2.sh OUT_DIR
set -uo pipefail
out=${1:?OUT_DIR}
source examples/benchmarks/device-setup.sh
export RAY_memory_monitor_refresh_ms=0
python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/streaming/test_data_parallel.py \
  "tests/streaming/test_gpu_trainer.py::test_the_embedding_stepped_on_the_gpu_trains_like_on_the_host" 2>&1 \
  | tee "$out/gpu-tests-embedding.log" | grep -E "passed|failed|Error|^\[" | tail -8
COMMON="--model qwen2.5-7b --seq-len 4096 --micro-batch 4 --steps 2 --warmup 1 --loss-chunk-tokens 2048 --store-memory-gib 200"
mr bench $COMMON --num-gpus 1 --grad-accum 8 --json "$out/qwen2.5-7b-1gpu.json" 2>&1 | tee "$out/qwen2.5-7b-1gpu.log" | grep -E "^(step|executor)"
mr bench $COMMON --num-gpus 2 --grad-accum 16 --json "$out/qwen2.5-7b-2gpu.json" 2>&1 | tee "$out/qwen2.5-7b-2gpu.log" | grep -E "^(step|executor)"
