#!/usr/bin/env bash
# The rollout's decode step launched kernel by kernel and as one CUDA graph (rl/decoding.py), one
# after the other on GPU 0 (examples/benchmarks/rollout-decode.py at the Qwen2.5-7B shape, 256 + 128
# tokens), while the GPU tests of rl/ run on the last GPU; then, where there are two or more GPUs,
# rl/'s tests that use every visible GPU (the rollout on a GPU of its own).
#   bash examples/benchmarks/decode-graphs.sh OUT_DIR
# About 6 minutes on two H200s.
set -uo pipefail
out=${1:?OUT_DIR}
mkdir -p "$out"
source examples/benchmarks/device-setup.sh
last=$(( $(nvidia-smi -L | wc -l) - 1 ))
(CUDA_VISIBLE_DEVICES=$last python3 -m pytest -q -m gpu tests/rl -p no:cacheprovider --durations=8 \
   >"$out/gpu-tests-rl.log" 2>&1; echo "rl rc=$?" >>"$out/gpu-tests-rl.log") &
for mode in --eager ""; do
  CUDA_VISIBLE_DEVICES=0 python3 examples/benchmarks/rollout-decode.py --new 128 $mode \
    >"$out/rollout-decode${mode:+-eager}.log" 2>&1
done
wait
if (( last > 0 )); then
  python3 -m pytest -q -m gpu tests/rl/test_grpo_run.py -p no:cacheprovider --durations=4 \
    >"$out/gpu-tests-rl-all-gpus.log" 2>&1; echo "rl all GPUs rc=$?" >>"$out/gpu-tests-rl-all-gpus.log"
fi
tail -n 12 "$out"/*.log
