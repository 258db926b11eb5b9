# Sourced at the start of a call on the offline GPU machine (Python 3.12, torch, no Ray): installs the
# wheels carried in .whl (Ray: bash ../shared/device/prepare-wheels.sh) and, where the call carries
# them, .whl-tf (a newer transformers) or .whl-ds (DeepSpeed built with DS_BUILD_OPS=0 and the
# packages it needs); the three together exceed what one call may carry. Keeps NVLink multicast off
# and defines `mr`, the megatrain-ray command run from this checkout.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  $(ls .whl*/*.whl) || exit
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mr() { python3 -c 'import sys; from megatrain_ray.cli import main; sys.exit(main())' "$@"; }
# Scripts that call `megatrain-ray` and `python` by name find them on PATH.
mkdir -p /tmp/bin
printf '#!/bin/sh\nexec python3 -c "import sys; from megatrain_ray.cli import main; sys.exit(main())" "$@"\n' >/tmp/bin/megatrain-ray
chmod +x /tmp/bin/megatrain-ray
command -v python >/dev/null || ln -sf "$(command -v python3)" /tmp/bin/python
export PATH=/tmp/bin:$PATH
