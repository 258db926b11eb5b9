#!/usr/bin/env bash
# Muon against AdamW at Qwen2.5-7B, 4 x 8 x 4,096 = 131,072 tokens a step, one H200 (nvidia-h200:
# 128 GiB of host memory), in one call: the same bench with optim.name adamw, then muon (its
# Newton-Schulz on the GPU in the update phase: megatrain_ray/README.md, "Muon"), each on fresh
# stores; then Muon's tokens/s over AdamW's (target >= 0.95) and each run's host bytes a parameter.
# Each run starts its stores, compiles and times 2 steps after 1 of warm-up (about 2 minutes).
#   source examples/benchmarks/device-setup.sh && bash examples/benchmarks/muon-7b.sh OUT
set -euo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export RAY_memory_monitor_refresh_ms=${RAY_memory_monitor_refresh_ms:-0}
out=${1:-bench-results-muon-7b}
mkdir -p "$out"
# the stores may take this much each (a machine whose memory grows as it is used reads too little free)
COMMON="--model qwen2.5-7b --seq-len 4096 --micro-batch 4 --grad-accum 8 --steps 2 --warmup 1 --loss-chunk-tokens 2048 --store-memory-gib ${STORE_GIB:-110}"
run() { python3 -c 'import sys; from megatrain_ray.cli import main; sys.exit(main())' "$@"; }
for opt in adamw muon; do
  run bench $COMMON --optimizer "$opt" --json "$out/qwen2.5-7b-$opt.json" 2>&1 | tee "$out/qwen2.5-7b-$opt.log"
done
python3 - "$out" <<'PY'
import json, sys
from pathlib import Path
runs = {opt: json.loads((Path(sys.argv[1]) / f"qwen2.5-7b-{opt}.json").read_text()) for opt in ("adamw", "muon")}
rate = {}
for opt, d in runs.items():
    m = d["runs"][0]["median"]  # bench/run.py: the timed steps' medians
    rate[opt] = m["tokens_per_s"]
    print(f"{opt}: {rate[opt]:.0f} tokens/s, step {m['seconds']:.2f} s, compute {m['compute_s']:.2f} s, "
          f"host state {m['host_state_bytes'] / 2**30:.1f} GiB = {m['host_state_bytes'] / d['params']:.2f} bytes/param")
print(f"Muon / AdamW tokens/s: {rate['muon'] / rate['adamw']:.3f} (target >= 0.95)")
PY
