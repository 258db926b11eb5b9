#!/usr/bin/env bash
# A Qwen2.5-VL-7B-shaped model (8.29 B: the 7.6 B decoder, a 0.67 B vision tower and merger; random init)
# fine-tuned on generated image-text rows (examples/benchmarks/vlm_data.py: two 896 x 896 images a row,
# 2,048 image tokens, the rest of 4,096 positions text), bf16 compute, 131,072 positions a step as the
# text-only 7B headline: the vision tower frozen (4 x 8 rows), then trained (model.train_vision; 1 x 32
# rows: the tower's activations under autograd, which the plan counts for a row of image tokens), then the text-only
# Qwen2.5-7B shape in the same call. vlm_bench.py runs the session `megatrain-ray train` runs, without its
# final checkpoint (8 B parameters of optimizer state would not fit the disk), and prints tokens/s, the
# GPU peak and the plan (host memory). One H100 80GB, 128 GiB host; a few minutes a line.
# Usage from the repository root: bash examples/benchmarks/vlm-7b-h100.sh OUT_DIR [PARTS]
# PARTS (default "frozen train-vision text"): which lines, so that a call stays within its time limit.
set -uo pipefail
out=${1:?OUT_DIR}
parts=${2:-frozen train-vision text}
mkdir -p "$out"
source examples/benchmarks/device-setup.sh
export CUDA_VISIBLE_DEVICES=0 RAY_memory_monitor_refresh_ms=0
[ -s "$out/vl/rows.jsonl" ] || python3 examples/benchmarks/vlm_data.py "$out/vl" --rows 64 || exit
V="python3 examples/benchmarks/vlm_bench.py $out/vl/model $out/vl/rows.jsonl --seq-len 4096 --steps 3 --warmup 1"

# 7.6 B x 14 bytes of host state and the frozen tower's 0.67 B x 6 (103 GiB; trained: 108 GiB) may not
# fit a 128 GiB box: where the plan refuses it, the same run with bf16 moments (10 bytes a parameter)
show() { grep -E "^(model|data|executor|step|result|host|  )|GiB|Error|refuse|fit"; }
for run in "frozen --micro-batch 4 --grad-accum 8" "train-vision --micro-batch 1 --grad-accum 32 --train-vision"; do
  name=${run%% *}; opts=${run#* }
  [[ " $parts " == *" $name "* ]] || continue
  $V $opts --json "$out/vl-$name.json" 2>&1 | tee "$out/vl-$name.log" | show
  [ -s "$out/vl-$name.json" ] || $V $opts --moments bf16 --json "$out/vl-$name-bf16.json" 2>&1 \
    | tee "$out/vl-$name-bf16.log" | show
done
[[ " $parts " == *" text "* ]] && mr bench --model qwen2.5-7b --seq-len 4096 --micro-batch 4 --grad-accum 8 --steps 3 --warmup 1 \
  --loss-chunk-tokens 2048 --json "$out/text-7b.json" 2>&1 | tee "$out/text-7b.log" | tail -15
