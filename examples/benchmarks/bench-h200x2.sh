#!/usr/bin/env bash
# Two GPUs fed by one set of host stores (megatrain_ray/README.md, "Several GPUs"), on a machine with two H200s
# (nvidia-h200-x2: 32 cores, 256 GiB of host memory that reads about 31 GiB at start and grows as
# it is used). Qwen2.5-7B with the one-GPU headline's 131,072 tokens per GPU per step: one GPU,
# then two, one after the other on the same machine. Each line builds its own 99 GiB of host state.
set -euo pipefail
# NVLink multicast stays off on this machine; the GPU workers (Ray actors) inherit these.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# Ray's memory monitor kills workers past 95% of MemTotal, which here grows only as memory is used:
# off, so that it cannot kill a store while the state fills. The stated store memory replaces the
# small MemAvailable in the placement.
export RAY_memory_monitor_refresh_ms=${RAY_memory_monitor_refresh_ms:-0}
out=${1:-bench-results-h200x2}
mkdir -p "$out"
COMMON="--model qwen2.5-7b --seq-len 4096 --micro-batch 4 --steps 3 --warmup 1 --loss-chunk-tokens 2048 --store-memory-gib 200"

# each run prints the plan first ("plan:"): GPU memory per device, host reads, what bounds the step
megatrain-ray bench $COMMON --num-gpus 1 --grad-accum 8 --json "$out/qwen2.5-7b-1gpu.json" 2>&1 | tee "$out/qwen2.5-7b-1gpu.log"
megatrain-ray bench $COMMON --num-gpus 2 --grad-accum 16 --json "$out/qwen2.5-7b-2gpu.json" 2>&1 | tee "$out/qwen2.5-7b-2gpu.log"
