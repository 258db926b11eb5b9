#!/usr/bin/env bash
# N GPUs of one host fed by one set of host stores (megatrain_ray/README.md, "Several GPUs"): the same
# tokens per GPU a step on 1, 2 and 4 GPUs (those the machine has), one `megatrain-ray bench` after the
# other in one call (each builds its own host state), then the scaling against one GPU and the plan's
# prediction (planning/scaling.py).
#   bash examples/benchmarks/scale-gpus.sh 7b|32b|tiny [OUT_DIR]
# 7b:   Qwen2.5-7B, fp32 master and moments (14 bytes a parameter: 99 GiB), 131,072 tokens a GPU
#       (4 x 4,096 x 8 micro-batches); about 2 minutes a GPU count on H200s.
# 32b:  Qwen2.5-32B (its config.json, written here; random weights), the 6-byte state (bf16 master,
#       int8 moments: 183 GiB; fp32 would be 427 GiB), 65,536 tokens a GPU (4 x 4,096 x 4), one
#       timed step after one untimed (STEPS=1): about 4 minutes a GPU count, 1 and 2 GPUs in one
#       call of under 10 minutes; on four GPUs run GPUS="1 2" and GPUS=4 as two calls.
# tiny: a tiny model on the CPU (CPU workers for GPUs): the script's own check, no GPU figure.
# GPUS="1 2 4" sets the counts (default: 1, 2 and 4, those visible); STEPS the timed steps.
set -euo pipefail
shape=${1:?give the shape: 7b, 32b or tiny}
out=${2:-scale-gpus-results}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
out=$(cd "$out" && pwd)
# NVLink multicast stays off on these machines; the GPU workers (Ray actors) inherit these.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# Ray's memory monitor kills workers past 95% of MemTotal, which on these VMs grows only as memory is
# used: off; the stated store memory replaces the small MemAvailable in the placement.
export RAY_memory_monitor_refresh_ms=${RAY_memory_monitor_refresh_ms:-0}

device=auto seq=4096 chunk=(--loss-chunk-tokens 2048)
case "$shape" in
  7b) model=qwen2.5-7b mb=4 ga=8 modes=fp32/fp32 memory=(--store-memory-gib 200) steps=${STEPS:-2} ;;
  32b)
    model="$out/qwen2.5-32b/config.json" mb=4 ga=4 modes=bf16/int8 memory=(--store-memory-gib 210) steps=${STEPS:-1}
    mkdir -p "$out/qwen2.5-32b"
    cat > "$model" <<'JSON'
{"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 152064, "hidden_size": 5120,
 "intermediate_size": 27648, "num_hidden_layers": 64, "num_attention_heads": 40, "num_key_value_heads": 8,
 "max_position_embeddings": 32768, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "tie_word_embeddings": false,
 "hidden_act": "silu", "torch_dtype": "bfloat16", "use_sliding_window": false}
JSON
    ;;
  tiny) model=tiny-llama mb=2 ga=2 modes=fp32/fp32 memory=() steps=${STEPS:-2} device=cpu seq=64 chunk=() ;;
  *) echo "unknown shape $shape: 7b, 32b or tiny" >&2; exit 2 ;;
esac
if [[ -n "${GPUS:-}" ]]; then
  counts=$GPUS
elif [[ $device == cpu ]]; then
  counts="1 2"
else
  visible=$(nvidia-smi -L | wc -l)
  counts=$(for n in 1 2 4; do if (( n <= visible )); then echo -n "$n "; fi; done)
fi

for n in $counts; do
  echo "== $shape on $n GPU(s): $((mb * seq * ga)) tokens a GPU, $((mb * seq * ga * n)) a step"
  megatrain-ray bench --model "$model" --device "$device" --seq-len "$seq" --micro-batch "$mb" \
    --grad-accum $((ga * n)) --num-gpus "$n" --optim-modes "$modes" --steps "$steps" --warmup 1 \
    "${chunk[@]}" "${memory[@]}" --json "$out/$shape-${n}gpu.json" 2>&1 | tee "$out/$shape-${n}gpu.log" ||
    echo "the $n-GPU run exited non-zero: see $out/$shape-${n}gpu.log"
done
python "$here/scaling_table.py" "$out"/"$shape"-*gpu.json
