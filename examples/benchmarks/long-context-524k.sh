#!/usr/bin/env bash
# Long context on one H200 (nvidia-h200: 16 cores, 128 GiB of host memory): Qwen2.5-7B, one sequence
# a step, at 131,072 and 262,144 tokens, the plan's step beside the measured one at each length, so
# that attention's quadratic term (9 of its matmuls a token per layer over seq/2 keys: forward,
# recompute, flash attention's backward) is checked where it is most of the step. The plan for these
# (planning/prediction.py, ATTENTION_*): 43 s and 149 s a step on the H100's rates, which the H200 shares;
# 524,288 tokens 547 s (it once said 403). 524,288 tokens does not fit this machine: 99 GiB of host
# state beside 116 GiB of parked activations (the two-GPU machine's 256 GiB holds it: LENGTHS=524288
# there, about 11 minutes, over one call's limit).
#
# One bench session for both lengths (the stores are built once, about a minute for the 7B), one
# timed step each without a warm-up (the first's set-up counts in the first length), eager
# (--no-compile: attention dominates); about 300 s in all. Usage from the repository root:
#   bash examples/benchmarks/long-context-524k.sh OUT_DIR
# On the CPU the same logic with a tiny model (no step time is predicted there):
#   MODEL=tiny-qwen2 LENGTHS="256 512" STORE_GIB=4 bash examples/benchmarks/long-context-524k.sh /tmp/lc
set -uo pipefail
out=${1:?OUT_DIR}
mkdir -p "$out"
if ls .whl*/*.whl >/dev/null 2>&1; then
  source examples/benchmarks/device-setup.sh  # the GPU machine: its wheels, NVLink multicast off, `mr`
else
  mr() { ${PYTHON:-python3} -c 'import sys; from megatrain_ray.cli import main; sys.exit(main())' "$@"; }
fi
# Ray's memory monitor kills workers past 95% of MemTotal, which on the GPU machine grows only as memory
# is used: off; the stated store memory replaces the small MemAvailable there
export RAY_memory_monitor_refresh_ms=0
free -g | head -2
# shellcheck disable=SC2086  # LENGTHS: one argument per length
timeout "${BENCH_TIMEOUT:-540}" bash -c "$(declare -f mr); mr bench --model ${MODEL:-qwen2.5-7b} \
  --seq-len ${LENGTHS:-131072 262144} --micro-batch 1 --grad-accum 1 --steps 1 --warmup 0 --no-compile \
  --loss-chunk-tokens 2048 --store-memory-gib ${STORE_GIB:-112} --json '$out/long-context.json'" \
  >"$out/long-context.log" 2>&1
echo "rc=$?" >>"$out/long-context.log"
grep -E "^(bench|executor|step|start-up|timed|predicted)|^-- seq|boundary activations|refused|Error|rc=" "$out/long-context.log"
${PYTHON:-python3} - "$out/long-context.json" <<'EOF'
import json, sys

try:
    runs = json.load(open(sys.argv[1]))["runs"]
except (OSError, ValueError, KeyError) as e:
    sys.exit(f"no results: {e}")
for run in runs:
    seq = run["shape"]["seq_len"]
    if "refused" in run:
        print(f"seq {seq}: refused: {run['refused']}")
        continue
    m = run["median"]
    measured = run["shape"]["seq_len"] * run["shape"]["micro_batch"] * run["shape"]["grad_accum"] / m["tokens_per_s"]
    p = m["predicted"]
    plan = f"plan {p['step_s']:.1f} s, measured / plan {measured / p['step_s']:.2f}" if p else "no plan (no GPU)"
    print(f"seq {seq}: measured {measured:.1f} s a step ({m['tokens_per_s']:.0f} tokens/s, "
          f"{m['model_tflops']:.0f} model TFLOP/s, peak GPU {m.get('peak_gpu_gib', float('nan')):.1f} GiB); {plan}")
EOF
