#!/usr/bin/env bash
# One call on the two-H200 machine (nvidia-h200-x2: 32 cores, 256 GiB), two jobs side by side:
# - GPU 0, cores 0-23: the 7B headline (131,072 tokens a step) with the code before the structural
#   change (a copy of its megatrain_ray/ in .before/), after it with AdamW, and after it with Muon
#   (its Newton-Schulz on the GPU), one after the other, each on fresh stores;
# - GPU 1, cores 24-31: Muon's GPU test, then Muon's quality run (examples/benchmarks/muon_quality.py).
#   bash examples/benchmarks/night-h200x2.sh OUT_DIR
set -uo pipefail
out=${1:?OUT_DIR}
mkdir -p "$out"
source examples/benchmarks/device-setup.sh
export RAY_memory_monitor_refresh_ms=0
HEADLINE="bench --model qwen2.5-7b --seq-len 4096 --micro-batch 4 --grad-accum 8 --steps 2 --warmup 1 --loss-chunk-tokens 2048"
(
  export CUDA_VISIBLE_DEVICES=1
  taskset -c 24-31 python3 -m pytest -q -m gpu tests/streaming/test_muon_step.py >"$out/muon-gpu-test.log" 2>&1
  taskset -c 24-31 timeout 400 python3 examples/benchmarks/muon_quality.py --json "$out/muon-quality.json" >"$out/muon-quality.log" 2>&1
  echo "rc=$?" >>"$out/muon-quality.log"
) &
export CUDA_VISIBLE_DEVICES=0
(cd .before && PYTHONPATH=/tmp/site:$PWD taskset -c 0-23 timeout 175 bash -c "$(declare -f mr); mr $HEADLINE --json $out/7b-before.json") >"$out/7b-before.log" 2>&1
taskset -c 0-23 timeout 175 bash -c "$(declare -f mr); mr $HEADLINE --json $out/7b-after.json" >"$out/7b-after.log" 2>&1
taskset -c 0-23 timeout 190 bash -c "$(declare -f mr); mr $HEADLINE --optimizer muon --json $out/7b-muon.json" >"$out/7b-muon.log" 2>&1
wait
for f in "$out"/7b-*.log "$out"/muon-*.log; do echo "== $f"; grep -E "^(bench|step|executor|timed|predicted|plan)|tokens/s|Error|error|passed|failed|rc=" "$f" | tail -12; done
