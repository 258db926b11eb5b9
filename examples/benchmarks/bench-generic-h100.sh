#!/usr/bin/env bash
# Models run through transformers' own modules (model.implementation transformers) on one GPU machine
# (H100 80GB, 128 GiB host): Qwen2.5-7B both ways at 131,072 tokens a step, one right after the other
# (the transformers path is held to 90% of the native family's tokens/s), then a hybrid (Qwen3-Next
# shape: linear and full attention, 32 experts) and a latent-attention model (DeepSeek-V3 shape: MLA,
# 32 routed experts and a shared one), both about 3.9 B parameters, random initialisation
# (examples/models/). Each line takes a few minutes; the Qwen3-Next line runs the linear attention's
# PyTorch fallback unless flash-linear-attention and causal-conv1d are installed, uncompiled: compiling
# the fallback's chunk loop took over 200 s without finishing (2026-11-24-h100-generic.md).
set -euo pipefail
B="megatrain-ray bench"
out=${1:-bench-results}
mkdir -p "$out"
STEP="--seq-len 4096 --micro-batch 4 --grad-accum 8 --steps 3 --warmup 2"

$B --model qwen2.5-7b $STEP --json "$out/qwen2.5-7b-native.json"
$B --model qwen2.5-7b --implementation transformers $STEP --json "$out/qwen2.5-7b-transformers.json"

# what plan measures of each layer kind before it plans (planning/probe.py)
megatrain-ray plan examples/tiny.yaml --set model.preset=examples/models/qwen3-next-3b.json \
  --set data.seq_len=4096 --set train.micro_batch_size=2 --set model.compute_dtype=bfloat16 --set executor.device=cuda
$B --model examples/models/qwen3-next-3b.json --seq-len 4096 --micro-batch 2 --grad-accum 8 --steps 3 --warmup 2 \
   --no-compile --json "$out/qwen3-next-3.9b.json"
$B --model examples/models/deepseek-v3-4b.json --seq-len 4096 --micro-batch 2 --grad-accum 8 --steps 3 --warmup 2 \
   --json "$out/deepseek-v3-3.9b.json"

# the GPU checks of the family: bf16 and compiled against transformers' autocast, the probe's working set
python -m pytest -p no:cacheprovider -m gpu tests/models/test_generic_family.py
