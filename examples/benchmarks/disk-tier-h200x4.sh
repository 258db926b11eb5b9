#!/usr/bin/env bash
# The disk tier (runtime.disk_dir) on the 4-GPU H200 machine (512 GiB of RAM, 235 GiB of disk), one GPU
# (part c also on the one-GPU H200: 128 GiB of RAM, 64 GiB of disk).
# Three parts, each one command under 10 minutes:
#   a  the disk's own speed under DISK_DIR, by dd with O_DIRECT (and fio where installed), and the tier's
#      own (disk_tier_speed.py: 8 blocks of Mistral-Large in the 6-byte mode, 23 GB, cycled through its
#      window): about 3 minutes at 2-3 GB/s.
#   b  the largest dense model RAM + disk hold in the 6-byte mode (bf16 master, int8 moments): Mistral-Large's
#      shape (12288 wide, 1.4 B parameters a block) with the most blocks (80 = 112 B, 72 = 100 B, 64, 56)
#      that `plan` says fit, then one step (warm-up 0: compilation included) at GA micro-batches of 4096
#      tokens (default 8) and its whole update, timed: the step with its update, tokens/s, the disk's
#      exposed time, beside the plan's (disk_step_summary.py). LAYERS=72 skips the search (the bench
#      prints its plan), which the one 600 s call needs. Measured 2026-11-28 at 72 blocks: the workers'
#      build 233 s (400 GiB of /dev/shm touched and registered), the forward and backward 61 s; the
#      update's disk I/O 136.6 GB (plan: 123 s at 2.2 GB/s): about 430 s in all, 40 s of it Python and
#      Ray; the bench stops at BENCH_S (default 540 s) so that its log and summary still come back.
#   c  a home machine: the GPU capped at 10 GiB, the stores at 64 GiB, the tier on: the largest preset
#      `plan` says trains there (the 6-byte and the 8-byte fp32-master/int8 modes; the larger of the
#      two), 2 steps (1 warm-up, 1 timed), tokens/s beside plan's (disk_step_summary.py; before the bench,
#      host_add_probe.py times the host's add of one vocabulary-sized gradient share, ~15 s). Runs on any of
#      these machines, the one-GPU H200 (128 GiB RAM, 64 GiB disk) too: the compute copy and the gradient
#      stay in RAM (4 bytes a parameter in the 6-byte mode), so 64 GiB holds about 14 B parameters, whose
#      moments take about 28 GB of disk (2 bytes a parameter). Sizes: two plans (a few seconds each at
#      this size), 64 GiB touched and registered (~25 s at ~3 s per 8 GiB), the tier's files allocated
#      (28 GB), the first weights, the warm-up step (compilation) and the timed one, then the update's
#      drain (28 GB read and written at ~2.2 GB/s, ~25 s): about 5 minutes; the bench stops at BENCH_S
#      (default 480 s) so that its log and summary come back within one 550 s call.
#   d  layers fully on disk (their compute copy and gradient too: StorePlan.disk_compute_layers), where the
#      store's RAM is short even with every layer's optimizer state on disk: MODEL (default qwen2.5-7b) in
#      the 6-byte mode, the GPU capped at 10 GiB, the stores at STORE_GIB (default 16: the 7B's 4 bytes a
#      parameter with its moments on disk are 28 GiB), `plan` first (its "keep their compute copy there
#      too" line, the GB read and written a step), then 2 steps (1 warm-up, 1 timed) with tokens/s beside
#      plan's. Defaults sized for the one-GPU H200 (64 GiB of disk): `plan` (described: 60 GiB of disk at 2.2
#      GB/s) puts 21 of the 7B's 30 layers fully on disk, 32.6 GiB of files, 44.8 GB read and 54.6 GB written a
#      step where the disk binds (93.8 GB read when every read took the whole file; measured 2026-11-29: 45.5 and 54.6);
#      the bench's disk line sets the whole step's measured bytes beside those: some 5 minutes in all. The 30B-class home machine on the
#      4-GPU one (235 GiB of disk): MODEL=qwen2.5-32b STORE_GIB=64 (about 200 GB of files; a step reads
#      several hundred GB, so it may need BENCH_S beyond one call's 600 s: run plan's figures first).
# Usage from the repository root: bash examples/benchmarks/disk-tier-h200x4.sh a|b|c|d OUT_DIR [DISK_DIR]
# DISK_DIR: a directory on the machine's local disk (default /var/tmp/megatrain-disk-tier); GA=16 for
# more tokens a step (b prints the tokens a step that hide the disk: "hidden from N tokens a step").
set -uo pipefail
part=${1:?a, b, c or d}
out=${2:?OUT_DIR}
disk=${3:-/var/tmp/megatrain-disk-tier}
mkdir -p "$out" "$disk"
source examples/benchmarks/device-setup.sh
export RAY_memory_monitor_refresh_ms=0 CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
ga=${GA:-8}
{ date -u; df -h "$disk" /dev/shm; free -g; nproc; } >"$out/$part-machine.txt" 2>&1

# The run's compute copies and gradient buffers live in /dev/shm: 4 bytes a parameter in the 6-byte mode.
shm_room() {  # GiB free in /dev/shm
  df -BG --output=avail /dev/shm | tail -1 | tr -dc 0-9
}

case $part in
a)
  f="$disk/dd-probe"
  { echo "== dd, 16 GiB in 8 MiB blocks, O_DIRECT"
    dd if=/dev/zero of="$f" bs=8M count=2048 oflag=direct conv=fsync 2>&1 | tail -1
    dd if="$f" of=/dev/null bs=8M iflag=direct 2>&1 | tail -1
    rm -f "$f"
    if command -v fio >/dev/null; then
      echo "== fio, 16 GiB, 8 MiB blocks, 8 in flight, O_DIRECT"
      fio --name=w --filename="$f" --size=16g --bs=8m --rw=write --direct=1 --ioengine=libaio --iodepth=8 \
          --end_fsync=1 | grep -E "WRITE:"
      fio --name=r --filename="$f" --size=16g --bs=8m --rw=read --direct=1 --ioengine=libaio --iodepth=8 | grep -E "READ:"
      rm -f "$f"
    else
      echo "(fio not installed)"
    fi
  } >"$out/a-disk.txt" 2>&1
  python3 examples/benchmarks/disk_tier_speed.py --dir "$disk" --model mistral-large-123b --layers 8 --mode bf16/int8 \
    --cycles 2 --json "$out/a-tier.json" >"$out/a-tier.txt" 2>&1
  cat "$out/a-disk.txt" "$out/a-tier.txt"
  ;;
b)
  cfg="$out/b.yaml"
  cat >"$cfg" <<EOF
model: {preset: mistral-large-123b, compute_dtype: bfloat16}
data: {source: synthetic, seq_len: 4096}
optim: {master: bf16, moments: int8}
train: {steps: 1, micro_batch_size: 1, grad_accum: $ga}
runtime: {disk_dir: $disk, num_gpus: 1}
EOF
  need=$(( ${LAYERS:-80} * 14 / 10 * 4 ))  # GiB of /dev/shm: 4 bytes a parameter, 1.4 B a block
  [ "$(shm_room)" -lt "$need" ] && echo "warning: /dev/shm has $(shm_room) GiB free, the compute copies need about $need GiB"
  layers=${LAYERS:-}
  if [ -z "$layers" ]; then  # the search: a minute a plan, which the one-call timing cannot spare
    for n in 80 72 64 56; do
      mr plan "$cfg" --set model.overrides.num_layers=$n >"$out/b-plan-$n.log" 2>&1
      if tail -1 "$out/b-plan-$n.log" | grep -qx fits; then layers=$n; break; fi
    done
    if [ -z "$layers" ]; then echo "plan: none of 80..56 blocks fits"; tail -3 "$out"/b-plan-*.log; exit 1; fi
    echo "plan: $layers blocks fit (/dev/shm has $(shm_room) GiB free)"
    grep -E "largest|B params|store on|disk tier|predicted step|tokens per step" "$out/b-plan-$layers.log"
  fi
  timeout "${BENCH_S:-540}" megatrain-ray bench --model mistral-large-123b --layers "$layers" --optim-modes bf16/int8 \
    --disk-dir "$disk" --num-gpus 1 --seq-len 4096 --micro-batch 1 --grad-accum "$ga" --steps 1 --warmup 0 \
    --json "$out/b-bench.json" >"$out/b-bench.log" 2>&1
  echo "bench exit $? after $SECONDS s of the script"
  grep -E "^bench:|disk tier|predicted step|tokens per step|executor device|^step |timed:|tokens/s|Error|refused" \
    "$out/b-bench.log" | tail -20
  [ -f "$out/b-bench.json" ] && python3 examples/benchmarks/disk_step_summary.py "$out/b-bench.json"
  ;;
c)
  cfg="$out/c.yaml"
  cat >"$cfg" <<EOF
model: {preset: qwen2.5-7b, compute_dtype: bfloat16}
data: {source: synthetic, seq_len: 4096}
optim: {master: bf16, moments: int8}
train: {steps: 2, micro_batch_size: 1, grad_accum: $ga}
executor: {gpu_memory_gib: 10}
runtime: {disk_dir: $disk, store_memory_gib: 64, num_gpus: 1}
EOF
  mr plan "$cfg" >"$out/c-plan.log" 2>&1
  # the largest preset per mode, as plan prints it: "  optim.master=M optim.moments=N: PRESET (X B params): ..."
  pick=$(grep -E "^  optim.master=(bf16 optim.moments=int8|fp32 optim.moments=int8): [a-z0-9.-]+ \(" "$out/c-plan.log" \
         | sed -E 's/^  optim.master=([a-z0-9]+) optim.moments=([a-z0-9]+): ([^ ]+) \(([0-9.]+) B params.*/\4 \3 \1\/\2/' \
         | sort -g | tail -1)
  if [ -z "$pick" ]; then echo "plan names no preset for a home machine"; cat "$out/c-plan.log"; exit 1; fi
  read -r params model mode <<<"$pick"
  echo "plan: the largest preset for 10 GiB of GPU, 64 GiB of RAM and the disk: $model ($params B params) in $mode"
  grep -E "^  optim.master" "$out/c-plan.log"
  mr plan "$cfg" --set model.preset="$model" --set optim.master="${mode%/*}" --set optim.moments="${mode#*/}" \
    >"$out/c-plan-$model.log" 2>&1
  grep -E "store on|disk tier|predicted step|tokens per step|fits|does not" "$out/c-plan-$model.log"
  # the host side of the gradients a 10 GiB GPU sums in host memory, on this CPU (a few seconds)
  python3 examples/benchmarks/host_add_probe.py --model "$model" --repeats 1 >"$out/c-host-add.txt" 2>&1
  cat "$out/c-host-add.txt"
  timeout "${BENCH_S:-480}" megatrain-ray bench --model "$model" --optim-modes "$mode" --gpu-memory-gib 10 --store-memory-gib 64 \
    --disk-dir "$disk" --num-gpus 1 --seq-len 4096 --micro-batch 1 --grad-accum "$ga" --steps 1 --warmup 1 \
    --json "$out/c-bench.json" >"$out/c-bench.log" 2>&1
  echo "bench exit $? after $SECONDS s of the script"
  grep -E "^bench:|disk tier|predicted step|executor device|^step |timed:|tokens/s|Error|refused" "$out/c-bench.log" | tail -20
  [ -f "$out/c-bench.json" ] && python3 examples/benchmarks/disk_step_summary.py "$out/c-bench.json"
  ;;
d)
  model=${MODEL:-qwen2.5-7b}
  store=${STORE_GIB:-16}
  cfg="$out/d.yaml"
  cat >"$cfg" <<EOF
model: {preset: $model, compute_dtype: bfloat16}
data: {source: synthetic, seq_len: 4096}
optim: {master: bf16, moments: int8}
train: {steps: 2, micro_batch_size: 1, grad_accum: $ga}
executor: {gpu_memory_gib: 10}
runtime: {disk_dir: $disk, store_memory_gib: $store, num_gpus: 1}
EOF
  mr plan "$cfg" >"$out/d-plan.log" 2>&1
  grep -E "store on|disk tier|compute copy there too|predicted step|tokens per step|fits|does not|refused" "$out/d-plan.log"
  if ! tail -1 "$out/d-plan.log" | grep -qx fits; then echo "plan: $model does not fit"; tail -5 "$out/d-plan.log"; exit 1; fi
  timeout "${BENCH_S:-540}" megatrain-ray bench --model "$model" --optim-modes bf16/int8 --gpu-memory-gib 10 \
    --store-memory-gib "$store" --disk-dir "$disk" --num-gpus 1 --seq-len 4096 --micro-batch 1 \
    --grad-accum "$ga" --steps 1 --warmup 1 --json "$out/d-bench.json" >"$out/d-bench.log" 2>&1
  echo "bench exit $? after $SECONDS s of the script"
  grep -E "^bench:|disk tier|compute copy|predicted step|executor device|^step |timed:|tokens/s|Error|refused" "$out/d-bench.log" | tail -20
  [ -f "$out/d-bench.json" ] && python3 examples/benchmarks/disk_step_summary.py "$out/d-bench.json"
  ;;
*)
  echo "part a, b, c or d"; exit 2 ;;
esac
