#!/usr/bin/env bash
# One call on a two-GPU machine (wheels carried: .whl, .whl-tf, .whl-fla for flash-linear-attention):
#   GPU 0: GRPO at the Qwen2.5-7B shape (grpo-7b-h100.sh: 8 prompts x 8 completions, 256 + 512 tokens,
#          4 steps), then the Qwen2.5-VL-7B shape with its vision tower frozen (vlm-7b-h100.sh frozen);
#   GPU 1: the GPU tests of GRPO and the image-text models, then the Qwen3-Next shape with
#          flash-linear-attention's kernels beside the DeepSeek-V3 shape (3.9 B each, 2 x 8 x 4,096 tokens).
# The two sides share the host's cores. Logs in OUT_DIR/logs.tgz and OUT_DIR/*.log.
# Usage from the repository root: bash examples/benchmarks/rl-vl-hybrid-two-gpus.sh OUT_DIR
set -uo pipefail
out=${1:?OUT_DIR}; work=/tmp/rl-vl-hybrid; mkdir -p "$out" "$work/bin"
source examples/benchmarks/device-setup.sh
printf '#!/bin/sh\nexec python3 -m megatrain_ray.cli "$@"\n' >"$work/bin/megatrain-ray"; chmod +x "$work/bin/megatrain-ray"
export PATH="$work/bin:$PATH" RAY_memory_monitor_refresh_ms=0
(
  export CUDA_VISIBLE_DEVICES=1
  python3 -m pytest -q -m gpu tests/rl tests/models/test_image_text.py -p no:cacheprovider >"$out/gpu-tests-rl-vl.log" 2>&1
  echo "rc=$?" >>"$out/gpu-tests-rl-vl.log"
  python3 -c 'import fla; print("fla", fla.__version__)' >"$out/hybrids.log" 2>&1
  for model in qwen3-next-3b deepseek-v3-4b; do
    mr bench --model "examples/models/$model.json" --seq-len 4096 --micro-batch 2 --grad-accum 8 --steps 3 --warmup 2 \
      --json "$work/$model.json" >>"$out/hybrids.log" 2>&1 || echo "$model rc=$?" >>"$out/hybrids.log"
  done
) &
export CUDA_VISIBLE_DEVICES=0
timeout 330 bash examples/benchmarks/grpo-7b-h100.sh "$work/grpo" 8 4 >"$out/grpo.log" 2>&1; echo "grpo rc=$?" >>"$out/grpo.log"
cp "$work/grpo/run/metrics.jsonl" "$out/grpo-metrics.jsonl" 2>/dev/null
timeout 240 bash examples/benchmarks/vlm-7b-h100.sh "$work/vlm" frozen >"$out/vlm.log" 2>&1; echo "vlm rc=$?" >>"$out/vlm.log"
wait
tar czf "$out/logs.tgz" -C "$work" --exclude='*.safetensors' --exclude='*.png' --exclude='*.jpg' --exclude='checkpoints' . 2>/dev/null
tail -n 4 "$out/gpu-tests-rl-vl.log"; grep -E "^step [0-9]+:|tokens/s|rc=|Error" "$out/hybrids.log" | tail -12
tail -n 6 "$out/grpo.log"; grep -E "tokens/s|GiB|rc=|Error|refuse" "$out/vlm.log" | tail -10
