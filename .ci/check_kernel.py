"""CI: load or build the host AdamW kernel for this machine, as a user's first run does in the
background, and fail where it does not build: the tests of the kernel would otherwise run torch's
fallback (helpers/kernel.py fails them too, with MEGATRAIN_REQUIRE_NATIVE_KERNEL=1)."""

import sys

from megatrain_ray.host.adamw_kernel import _build_name, _cache_dir, native_kernel

if native_kernel() is None:
    print("FAILED: the host AdamW kernel did not build on this machine (the warning above says why: a C++ "
          "compiler, ninja and torch's headers are needed)", file=sys.stderr)
    sys.exit(1)
print(f"host AdamW kernel: {_cache_dir() / (_build_name() + '.so')}")
