#!/usr/bin/env bash
# Qwen2.5-7B at 131,072 tokens a step with the stores on the GPU node (shared memory), then with every
# layer on two RAM-node raylets of this machine (TCP), one after the other on GPU 0: the ratio, each
# store's AdamW rate per thread, and each run's start-up line. Usage from the repository root:
#   bash examples/benchmarks/ram-nodes-h100.sh OUT_DIR        (STEPS=2 in the environment: 2 timed steps, not 3)
set -uo pipefail
out=${1:?OUT_DIR}
source examples/benchmarks/device-setup.sh
export CUDA_VISIBLE_DEVICES=0
SHAPE="--model qwen2.5-7b --seq-len 4096 --micro-batch 4 --grad-accum 8 --steps ${STEPS:-3} --warmup 1 --loss-chunk-tokens 2048"
nproc; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
mr bench $SHAPE --json "$out/7b-local.json" >"$out/7b-local.log" 2>&1
mr bench $SHAPE --ram-nodes 2 --json "$out/7b-ram-nodes-2.json" >"$out/7b-ram-nodes-2.log" 2>&1
for f in 7b-local 7b-ram-nodes-2; do
  echo "== $f"
  grep -E "^(local cluster|store on|executor device|step|start-up|timed|host optimizer|from RAM)|RAM node .* cores|Error" "$out/$f.log"
done
python3 - "$out" <<'PY'
import json, sys
runs = {name: json.load(open(f"{sys.argv[1]}/{name}.json"))["runs"][0]["median"] for name in ("7b-local", "7b-ram-nodes-2")}
local, ram = runs["7b-local"]["tokens_per_s"], runs["7b-ram-nodes-2"]["tokens_per_s"]
print(f"tokens/s: local {local:.0f}, RAM nodes {ram:.0f}: {ram / local:.3f} of local")
for name, m in runs.items():
    for s in m["optimizer_per_store"]:
        print(f"{name}: {s['node']} {s['params'] / 1e9:.2f} B params, {s['gparams_per_s']:.2f} G params/s on "
              f"{s['threads']} threads ({s['gparams_per_s_per_thread'] or 0:.3f} a thread)")
PY
