#!/usr/bin/env bash
# The runs behind the reports in this folder and the README's performance table, on one GPU machine (H100 80GB, 128 GiB host).
# Each line is independent and takes 2-8 minutes; a line with several --seq-len values is a sweep
# on one set of stores (the host state is built once). Ray, and for the DeepSpeed baseline DeepSpeed
# and its dependencies, must be installed (pip install "ray[default]" deepspeed).
set -euo pipefail
B="megatrain-ray bench"
out=${1:-bench-results}
mkdir -p "$out"
# Shapes of the scaling table: 65,536 tokens a step at seq 1024, 4096 and 16384, then one sequence a step.
SWEEP="--seq-len 1024 4096 16384 1024 4096 16384 --micro-batch 4 1 1 1 1 1 --grad-accum 16 16 4 1 1 1"

# the ceilings the step is built from: one 7B decoder layer's fwd+bwd, and the host AdamW (one pass
# against torch's three passes, per thread count)
$B --model qwen2.5-7b --parts --seq-len 4096 --micro-batch 1 --optimizer-threads 4 8 12 14 16 \
   --json "$out/qwen2.5-7b-parts.json"

# 7B (does not fit on the GPU with fp32 AdamW): the headline shape first, then the scaling table
$B --model qwen2.5-7b --seq-len 4096 1024 4096 16384 1024 4096 16384 \
   --micro-batch 4 4 1 1 1 1 1 --grad-accum 8 16 16 4 1 1 1 \
   --steps 3 --warmup 1 --loss-chunk-tokens 2048 --json "$out/qwen2.5-7b-sweep.json"
# 7B GPU memory with 8 micro-batches kept on the device (17.6 GiB, 2026-11-22), and parked in host
# memory (11.7 GiB), then 16 parked micro-batches, which the GPU actor refuses on this machine
$B --model qwen2.5-7b --seq-len 4096 --micro-batch 1 --grad-accum 8 --steps 2 --warmup 1 \
   --loss-chunk-tokens 2048 --json "$out/qwen2.5-7b-x8.json"
$B --model qwen2.5-7b --seq-len 4096 --micro-batch 1 --grad-accum 8 16 --steps 3 --warmup 1 \
   --loss-chunk-tokens 2048 --offload-activations on --json "$out/qwen2.5-7b-parked.json"
# the same 131,072 tokens a step as 1 x 32, 2 x 16 and 4 x 8 micro-batches
$B --model qwen2.5-7b --seq-len 4096 --micro-batch 1 2 4 --grad-accum 32 16 8 --steps 2 --warmup 1 \
   --loss-chunk-tokens 2048 --json "$out/qwen2.5-7b-131k-tokens-per-step.json"
$B --model qwen2.5-3b $SWEEP --steps 3 --warmup 1 --json "$out/qwen2.5-3b-sweep.json"
$B --model qwen2.5-1.5b $SWEEP --steps 3 --warmup 1 --json "$out/qwen2.5-1.5b-sweep.json"

# side by side with the baselines, same model, batch and data
$B --model qwen2.5-1.5b --seq-len 4096 --grad-accum 16 --steps 3 --warmup 1 --baseline plain \
   --json "$out/qwen2.5-1.5b-plain.json"
$B --model qwen2.5-1.5b --seq-len 4096 --grad-accum 4 --steps 3 --warmup 1 \
   --baseline plain fsdp2_offload deepspeed_offload --json "$out/qwen2.5-1.5b-x4-baselines.json"
$B --model qwen2.5-3b --seq-len 4096 --grad-accum 16 --steps 2 --warmup 1 --baseline plain deepspeed_offload \
   --json "$out/qwen2.5-3b-x16-baselines.json"
$B --model qwen2.5-3b --seq-len 4096 --grad-accum 4 --steps 2 --warmup 1 \
   --baseline plain fsdp2_offload deepspeed_offload --json "$out/qwen2.5-3b-x4-baselines.json"

# Gemma 3 and Phi-4-mini (issue #19), random init, 65,536 tokens a step, beside the Llama-family
# qwen2.5-3b at the same shape (4096 x 1 x 16, also in its sweep above): first one decoder layer
# each (Gemma 3: layer 1 slides over a 1024-token window, layer 6 is global), then the pipeline
$B --model gemma-3-4b --parts --seq-len 4096 --micro-batch 1 --parts-layers 1 6 --optimizer-threads 14 \
   --json "$out/gemma-3-4b-parts.json"
$B --model phi-4-mini --parts --seq-len 4096 --micro-batch 1 --optimizer-threads 14 --json "$out/phi-4-mini-parts.json"
$B --model qwen2.5-3b --parts --seq-len 4096 --micro-batch 1 --optimizer-threads 14 --json "$out/qwen2.5-3b-parts.json"
$B --model gemma-3-4b --seq-len 4096 --micro-batch 1 --grad-accum 16 --steps 2 --warmup 1 \
   --json "$out/gemma-3-4b-64k.json"
$B --model phi-4-mini --seq-len 4096 --micro-batch 1 --grad-accum 16 --steps 2 --warmup 1 \
   --json "$out/phi-4-mini-64k.json"
$B --model qwen2.5-3b --seq-len 4096 --micro-batch 1 --grad-accum 16 --steps 3 --warmup 1 \
   --json "$out/qwen2.5-3b-64k.json"

# long context: 7B at 128k tokens, 1.5B at 512k tokens (activations parked in host memory)
$B --model qwen2.5-7b --seq-len 131072 --micro-batch 1 --grad-accum 1 --steps 1 --warmup 1 \
   --loss-chunk-tokens 2048 --json "$out/qwen2.5-7b-128k.json"
$B --model qwen2.5-1.5b --seq-len 524288 --micro-batch 1 --grad-accum 1 --steps 1 --warmup 0 \
   --loss-chunk-tokens 4096 --offload-activations on --json "$out/qwen2.5-1.5b-512k.json"

# mixture of experts, qwen3-moe-7b (7.0 B parameters, 1.4 B active a token; 2026-11-23-h100.md, "Mixture of
# experts"): its layer (64 experts, top 8) beside a dense layer with as many active parameters
# (intermediate 8 x 768), at the training run's micro-batch (4 x 4096 tokens); then training at
# 65,536 tokens a step (model TFLOP/s on active parameters)
$B --model qwen3-moe-7b --parts --seq-len 4096 --micro-batch 4 --optimizer-threads 14 \
   --json "$out/qwen3-moe-7b-parts-4x4096.json"
$B --model qwen3-moe-7b --seq-len 4096 --micro-batch 4 --grad-accum 4 --steps 3 --warmup 1 \
   --loss-chunk-tokens 2048 --json "$out/qwen3-moe-7b-65k.json"

# RAM nodes (#12): every layer on a RAM-node raylet of this machine (`--ram-nodes 1` starts a head
# and one raylet offering megatrain_ram, no dashboard; the layers cross the TCP transport, no
# network), each right after the same shape on the shared-memory path. Target: 90% of its tokens/s.
# The 7B's 99 GiB of state sits on the raylet; the GPU node adds a window of 4 layers (6.7 GiB).
$B --model qwen2.5-1.5b --seq-len 4096 --micro-batch 1 --grad-accum 16 --steps 6 --warmup 2 \
   --json "$out/qwen2.5-1.5b-65k-shm.json"
$B --model qwen2.5-1.5b --seq-len 4096 --micro-batch 1 --grad-accum 16 --steps 6 --warmup 2 --ram-nodes 1 \
   --json "$out/qwen2.5-1.5b-65k-ram-node.json"
# the 7B with few tokens a step (issue #14: 98,304 = 96 x 1024, MegaTrain's shape, then 65,536; the
# host optimizer's in-pipeline G params/s is printed per shape), then the headline shape, on one set
# of stores; the last shape is the shared-memory half of the 7B RAM-node pair that follows
$B --model qwen2.5-7b --seq-len 1024 1024 4096 --micro-batch 8 8 4 --grad-accum 12 8 8 --steps 3 --warmup 1 \
   --loss-chunk-tokens 2048 --json "$out/qwen2.5-7b-98k-65k-131k-shm.json"
$B --model qwen2.5-7b --seq-len 4096 --micro-batch 4 --grad-accum 8 --steps 3 --warmup 1 \
   --loss-chunk-tokens 2048 --ram-nodes 1 --json "$out/qwen2.5-7b-131k-ram-node.json"

# Issue #14, with the tiled one-pass kernel (2026-11-23, results *-tiles.* and qwen2.5-3b-65k-*):
# the kernel's thread scheduling and buffer placement probed alone (host-adamw-probe.log came from
# an earlier form of the probe), the host AdamW alone per thread count, then the 7B at 98,304 and
# 65,536 tokens a step
python examples/benchmarks/host_adamw_probe.py > "$out/host-adamw-probe.log"
$B --model qwen2.5-7b --parts --seq-len 4096 --micro-batch 1 --optimizer-threads 8 12 14 16 \
   --json "$out/qwen2.5-7b-parts-tiles.json"
$B --model qwen2.5-7b --seq-len 1024 1024 --micro-batch 8 8 --grad-accum 12 8 --steps 3 --warmup 1 \
   --loss-chunk-tokens 2048 --json "$out/qwen2.5-7b-98k-65k-tiles.json"
# ours at 65,536 tokens, then DeepSpeed ZeRO-3 offload at each split of the same tokens (its best is
# kept and named); one split per fresh process, which can also run alone, as FSDP2 did here
$B --model qwen2.5-3b --seq-len 4096 --micro-batch 1 --grad-accum 16 --steps 2 --warmup 1 \
   --baseline deepspeed_offload --baseline-splits 4x4,8x2,16x1 --json "$out/qwen2.5-3b-65k-ours-deepspeed.json"
for split in "16 1" "8 2"; do
  set -- $split
  python -m megatrain_ray.bench.baseline_process --name fsdp2_offload --model qwen2.5-3b --seq-len 4096 \
     --micro-batch "$1" --grad-accum "$2" --steps 2 --warmup 1 > "$out/qwen2.5-3b-65k-fsdp2-$1x$2.json"
done

# Issue #14, kept forward graphs (executor.keep_graphs; 2026-11-23, results *-kept.* and
# gpu-tests-kept-graphs-*.log): the GPU tests under the default (auto) keep_graphs, the 7B at
# 98,304 tokens recomputing every block and then keeping what fits, and at 65,536; the 3B at 65,536
# tokens recomputing, keeping (1 x 16) and keeping at 4 x 4, then DeepSpeed at its best split
python -m pytest -q -m gpu -s tests/planning/test_planner.py tests/streaming/test_gpu_trainer.py tests/models/test_moe_parity.py \
   tests/models/test_transformers_parity.py tests/models/test_families_parity.py tests/streaming/test_eval.py > "$out/gpu-tests-kept-graphs.log"
$B --model qwen2.5-7b --seq-len 1024 --micro-batch 8 --grad-accum 12 12 8 --keep-graphs 0 auto auto --steps 3 \
   --warmup 1 --loss-chunk-tokens 2048 --json "$out/qwen2.5-7b-98k-kept.json"
$B --model qwen2.5-3b --seq-len 4096 --micro-batch 1 1 4 --grad-accum 16 16 4 --keep-graphs 0 auto auto --steps 3 \
   --warmup 1 --json "$out/qwen2.5-3b-65k-kept.json"
python -m megatrain_ray.bench.baseline_process --name deepspeed_offload --model qwen2.5-3b --seq-len 4096 \
   --micro-batch 16 --grad-accum 1 --steps 2 --warmup 1 > "$out/qwen2.5-3b-65k-deepspeed-16x1-after-kept.log"

# Issue #14, the 3B step against DeepSpeed's best (2026-11-23, late evening; results
# qwen2.5-3b-65k-4x4-*, *-after-compiled-head.log, qwen2.5-3b-kept-block-probe.log, gpu-tests-head-budget-*.log):
# what one kept block holds per activation budget; ours at 4 x 4 with loss chunks of 2,048 tokens,
# auto and 15 kept, then DeepSpeed at its best split; ours with 15 kept, then FSDP2 at its best
# measured split; a profiled step and where its GPU time went; the GPU tests
python examples/benchmarks/probe_kept_block.py --model qwen2.5-3b --micro-batch 4 --seq-len 4096 --budgets 1.0 0.8 0.6 0.4 \
   > "$out/qwen2.5-3b-kept-block-probe.log"
$B --model qwen2.5-3b --seq-len 4096 4096 --micro-batch 4 --grad-accum 4 --keep-graphs auto 15 --steps 3 --warmup 1 \
   --loss-chunk-tokens 2048 --json "$out/qwen2.5-3b-65k-4x4-compiled-head.json"
python -m megatrain_ray.bench.baseline_process --name deepspeed_offload --model qwen2.5-3b --seq-len 4096 \
   --micro-batch 16 --grad-accum 1 --steps 2 --warmup 1 > "$out/qwen2.5-3b-65k-deepspeed-16x1-after-compiled-head.log"
$B --model qwen2.5-3b --seq-len 4096 --micro-batch 4 --grad-accum 4 --keep-graphs 15 --steps 3 --warmup 1 \
   --loss-chunk-tokens 2048 --json "$out/qwen2.5-3b-65k-4x4-keep15-before-fsdp2.json"
python -m megatrain_ray.bench.baseline_process --name fsdp2_offload --model qwen2.5-3b --seq-len 4096 \
   --micro-batch 16 --grad-accum 1 --steps 2 --warmup 1 > "$out/qwen2.5-3b-65k-fsdp2-16x1-after-compiled-head.log"
$B --model qwen2.5-3b --seq-len 4096 --micro-batch 4 --grad-accum 4 --keep-graphs auto --steps 1 --warmup 1 \
   --loss-chunk-tokens 2048 --profile "$out/profile"
python examples/benchmarks/trace_summary.py "$out"/profile/seq4096-mb4/rank-0/trace.json > "$out/qwen2.5-3b-65k-4x4-profile-summary.log"
python -m pytest -q -m gpu -s tests/planning/test_planner.py tests/streaming/test_gpu_trainer.py tests/models/test_moe_parity.py \
   tests/models/test_transformers_parity.py tests/models/test_families_parity.py tests/streaming/test_eval.py tests/streaming/test_compiled.py \
   > "$out/gpu-tests-head-budget.log"

# Issue #14 (2026-11-23, night; results qwen2.5-3b-65k-4x4-auto14-keep17.*, *-embedding-step*,
# *-auto-before-deepspeed.*, qwen2.5-3b-65k-16k-final.*, *-deepspeed-16x1-final.log, gpu-tests-final-*.log):
# kept blocks as planned at 0.7 (auto: 14) and 17; the embedding's AdamW step on the host, then on
# the GPU, at a host-bound 16,384 tokens; ours with the defaults then DeepSpeed at its best split
# (twice, on two machines); the GPU tests
$B --model qwen2.5-3b --seq-len 4096 4096 --micro-batch 4 --grad-accum 4 --keep-graphs auto 17 --steps 3 --warmup 1 \
   --loss-chunk-tokens 2048 --json "$out/qwen2.5-3b-65k-4x4-auto14-keep17.json"
for where in host device; do
  $B --model qwen2.5-3b --seq-len 4096 --micro-batch 1 --grad-accum 4 --steps 4 --warmup 1 --loss-chunk-tokens 2048 \
     --embedding-step $where --json "$out/qwen2.5-3b-16k-embedding-step-$where.json"
done
$B --model qwen2.5-3b --seq-len 4096 --micro-batch 4 --grad-accum 4 --steps 4 --warmup 1 --loss-chunk-tokens 2048 \
   --json "$out/qwen2.5-3b-65k-4x4-auto-before-deepspeed.json"
python -m megatrain_ray.bench.baseline_process --name deepspeed_offload --model qwen2.5-3b --seq-len 4096 \
   --micro-batch 16 --grad-accum 1 --steps 2 --warmup 1 > "$out/qwen2.5-3b-65k-deepspeed-16x1-after-auto.log"
$B --model qwen2.5-3b --seq-len 4096 4096 --micro-batch 4 1 --grad-accum 4 4 --steps 4 --warmup 1 \
   --loss-chunk-tokens 2048 --json "$out/qwen2.5-3b-65k-16k-final.json"
python -m megatrain_ray.bench.baseline_process --name deepspeed_offload --model qwen2.5-3b --seq-len 4096 \
   --micro-batch 16 --grad-accum 1 --steps 2 --warmup 1 > "$out/qwen2.5-3b-65k-deepspeed-16x1-final.log"
python -m pytest -q -m gpu -s tests/models/test_moe_parity.py tests/models/test_transformers_parity.py > "$out/gpu-tests-moe-transformers-parity.log"
python -m pytest -q -m gpu -s tests/models/test_moe_parity.py tests/models/test_families_parity.py tests/streaming/test_eval.py \
   tests/planning/test_planner.py tests/streaming/test_gpu_trainer.py > "$out/gpu-tests-final-1.log"
python -m pytest -q -m gpu -s tests/planning/test_planner.py tests/streaming/test_gpu_trainer.py -k "peak or embedding" \
   > "$out/gpu-tests-final-2.log"

# Issue #14 (2026-11-23, last session; results qwen2.5-3b-65k-4x4-contexts-from-host.*,
# qwen2.5-3b-65k-deepspeed-16x1-after-contexts-from-host.log, gpu-tests-embedding-step-slow-compute.log):
# each micro-batch's context told from the host's copy of the batch whether rows pack documents
# (no GPU round trip before the first layer); ours with the defaults, then DeepSpeed at its best split;
# run twice (the second sitting's files end in -2); the GPU tests of the families and the trainer
$B --model qwen2.5-3b --seq-len 4096 --micro-batch 4 --grad-accum 4 --steps 4 --warmup 1 --loss-chunk-tokens 2048 \
   --json "$out/qwen2.5-3b-65k-4x4-contexts-from-host.json"
python -m megatrain_ray.bench.baseline_process --name deepspeed_offload --model qwen2.5-3b --seq-len 4096 \
   --micro-batch 16 --grad-accum 1 --steps 2 --warmup 1 > "$out/qwen2.5-3b-65k-deepspeed-16x1-after-contexts-from-host.log"
python -m pytest -q -m gpu tests/streaming/test_gpu_trainer.py -k embedding_stepped > "$out/gpu-tests-embedding-step-slow-compute.log"
python -m pytest -q -m gpu tests/models/test_families_parity.py tests/streaming/test_gpu_trainer.py tests/streaming/test_compiled.py tests/streaming/test_eval.py \
   > "$out/gpu-tests-contexts-from-host.log"
