#!/usr/bin/env bash
# The GPU tests on a two-GPU machine in two halves side by side (the model parity tests on GPU 0, the
# rest on GPU 1), then the tests that need both GPUs (data parallel, the rollout on a GPU of its own). Usage: bash examples/benchmarks/gpu-tests-two-gpus.sh OUT_DIR
set -uo pipefail
out=${1:?OUT_DIR}
source examples/benchmarks/device-setup.sh
(CUDA_VISIBLE_DEVICES=0 python3 -m pytest -q -m gpu tests/models -p no:cacheprovider --durations=8 >"$out/gpu-tests-models.log" 2>&1; echo "models rc=$?" >>"$out/gpu-tests-models.log") &
CUDA_VISIBLE_DEVICES=1 python3 -m pytest -q -m gpu tests --ignore=tests/models --deselect tests/streaming/test_data_parallel.py \
  -p no:cacheprovider --durations=8 >"$out/gpu-tests-rest.log" 2>&1; echo "rest rc=$?" >>"$out/gpu-tests-rest.log"
python3 -m pytest -q -m gpu tests/streaming/test_data_parallel.py \
  tests/rl/test_grpo_run.py::test_a_grpo_run_rolls_out_on_a_gpu_of_its_own_one_version_behind -p no:cacheprovider >"$out/gpu-tests-two-gpus.log" 2>&1; echo "two-gpus rc=$?" >>"$out/gpu-tests-two-gpus.log"
wait
tail -n 15 "$out"/gpu-tests-*.log
