#!/usr/bin/env bash
# The runs behind the README's performance figures, on one GPU machine (H100 80GB, 128 GiB host).
# Each line is independent; each takes 1-5 minutes. Ray, and for the DeepSpeed baseline DeepSpeed
# and its dependencies, must be installed (pip install "ray[default]" deepspeed).
set -euo pipefail
B="megatrain-ray bench"
out=${1:-bench-results}
mkdir -p "$out"

# the two ceilings the step is built from: one 7B decoder layer's fwd+bwd, and the host AdamW
$B --model qwen2.5-7b --parts --seq-len 4096 --micro-batch 1
# 1.5B (fits on the GPU), beside plain PyTorch, FSDP2 CPU offload and DeepSpeed ZeRO-3 offload
$B --model qwen2.5-1.5b --seq-len 4096 --micro-batch 1 --grad-accum 4 --steps 3 --warmup 1 \
   --baseline plain fsdp2_offload deepspeed_offload --json "$out/qwen2.5-1.5b-baselines.json"
$B --model qwen2.5-1.5b --seq-len 4096 --micro-batch 1 --grad-accum 16 --steps 2 --warmup 1 --json "$out/qwen2.5-1.5b.json"
# 7B (does not fit on the GPU with fp32 AdamW)
$B --model qwen2.5-7b --seq-len 4096 --micro-batch 1 --grad-accum 16 --steps 2 --warmup 1 \
   --loss-chunk-tokens 2048 --json "$out/qwen2.5-7b.json"
# long context: 7B at 128k tokens, 1.5B at 512k tokens (activations parked in host memory)
$B --model qwen2.5-7b --seq-len 131072 --micro-batch 1 --grad-accum 1 --steps 1 --warmup 1 \
   --loss-chunk-tokens 2048 --json "$out/qwen2.5-7b-128k.json"
$B --model qwen2.5-1.5b --seq-len 524288 --micro-batch 1 --grad-accum 1 --steps 1 --warmup 0 \
   --loss-chunk-tokens 4096 --offload-activations on --json "$out/qwen2.5-1.5b-512k.json"
