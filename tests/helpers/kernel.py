"""Which host AdamW path a test runs: the tests of the native kernel must run the kernel, not the
torch fallback it is compared with (which would then be compared with itself)."""

from __future__ import annotations

import os

import pytest

from megatrain_ray.host.adamw_kernel import native_kernel

REQUIRE = "MEGATRAIN_REQUIRE_NATIVE_KERNEL"  # .ci/run sets it to 1, after checking the kernel built


def path_of(one_pass: bool) -> str:
    """The path host/adamw.py's adamw_step must report for `one_pass`: "torch" for the fallback;
    "native" for the kernel, which must be built here: where it cannot be (no compiler), a test of
    it is skipped, saying so, or fails where $MEGATRAIN_REQUIRE_NATIVE_KERNEL is 1 (CI)."""
    if not one_pass:
        return "torch"
    if native_kernel() is None:
        why = ("the host AdamW kernel did not build here (its warning says why): a test of it would run torch's "
               "fallback and compare that with itself")
        if os.environ.get(REQUIRE) == "1":
            pytest.fail(why)
        pytest.skip(why)
    return "native"
