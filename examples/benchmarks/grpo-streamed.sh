#!/usr/bin/env bash
# GRPO at the Qwen2.5-32B shape on one H100 80GB (256 GiB host), its rollout streamed: the bf16
# copy (61 GiB) does not fit beside the KV cache and the training step, so the run keeps as many
# decoder layers resident as fit and streams the others from the stores' page-locked compute copies
# at every decode step (it prints how many, and the step's share of the GPU). Random weights
# (qwen2.5-14b with Qwen2.5-32B's MLP width and 64 layers), 8 completions per prompt of 256-token
# prompts, 128 new tokens, the 6-byte host state (bf16 master, int8 moments: about 197 GB), the
# loss in chunks of 1024 tokens (the step's GPU share at its default 4096 would cost the rollout 10
# resident layers).
#   bash examples/benchmarks/grpo-streamed.sh [OUT_DIR] [PROMPTS_PER_STEP] [STEPS]
# NEW_TOKENS=N changes the completions' length. Prints the resident layers, the rollout's and the
# update's tokens/s and the seconds per step, as grpo-7b-h100.sh does (its script runs it).
# A decode step moves every streamed layer host to device once, for all the step's sequences at
# once: on an H100 the split keeps 46 of 64 layers resident and streams 16.3 GiB a decode step,
# measured at 365 ms (about 48 GB/s, 79.9 s a GRPO step; examples/benchmarks/2026-11-26-day.md, where
# the same split was given to an H200, whose 140 GiB hold the whole copy). More sequences
# (PROMPTS_PER_STEP) raise the tokens/s until their KV cache takes the room of resident layers.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
SHAPE="Qwen2.5-32B" NEW_TOKENS=${NEW_TOKENS:-128} \
MODEL_SETS="--set model.preset=qwen2.5-14b --set model.overrides.intermediate_size=27648 --set model.overrides.num_layers=64 --set optim.master=bf16 --set optim.moments=int8 --set executor.loss_chunk_tokens=1024" \
  bash "$here/grpo-7b-h100.sh" "${1:-grpo-streamed-results}" "${2:-16}" "${3:-2}"
