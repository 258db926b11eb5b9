"""Fixtures every test folder shares, and the `gpu` marker's skip on machines without CUDA.

Shared helpers (whole-model autograd training, small configs, the transformers checks) live in
tests/helpers/, importable as `helpers.*`: pyproject's pytest `pythonpath` puts tests/ on the path."""

import os
from pathlib import Path

# OpenMP threads that wait sleep instead of spinning, in this process and in every process it starts
# (the Ray heads and their actors, the commands it runs), read when torch loads libgomp, so before
# `import torch`. The suite runs two test processes and their runs' actors on two cores: a thread
# spinning for the end of another's parallel region holds a core that the other process wants, for
# nothing. Measured on the 2-core box (-n 2 --dist loadfile, one after the other): 1,493 CPU-s and
# 809 s spinning (torch's default), 1,255 CPU-s and 689 s passive. The arithmetic is the same.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402

MiB = 1024**2

if torch.cuda.is_available():
    # One test process compiles the decoder blocks of many tiny models (a run compiles one), and
    # dynamo counts every model's graphs of a family's one block function together: the limit a
    # compiled block raises for its own model (streaming/compiled.py) does not cover the graphs of
    # the models tested before it, past which a block would run eager and the test would not test
    # the compiled block. tests/models/test_generic_family.py checks a run's own limit on the CPU.
    torch._dynamo.config.recompile_limit = 64


# The seconds the longest test modules take on a 2-core box (the README's `-n 2 --dist loadfile`,
# measured 2026-11-29 with --durations=0, OpenMP waits passive), longest first: each module runs in
# one process, and xdist hands the next module to whichever process is free, so that the two end
# together only if the long ones start first (xdist's own order, by count of tests, left the
# job_submit module near the end). A schedule only: a module missing here, or a figure gone stale,
# changes the order, never what runs. pytest_configure keeps xdist from reordering it.
MODULE_SECONDS = {
    "models/test_generic_family.py": 141, "runtime/test_multinode.py": 101, "runtime/test_job_submit.py": 100,
    "runtime/test_faults.py": 95, "entry/test_run_lifecycle.py": 95, "rl/test_grpo_run.py": 79,
    "models/test_image_text.py": 69, "streaming/test_data_parallel.py": 57, "bench/test_bench.py": 56,
    "entry/test_quick_start.py": 54, "runtime/test_stops_keep_steps.py": 53, "runtime/test_disk_compute_run.py": 47,
    "runtime/test_disk_tier_run.py": 43, "entry/test_image_text_recipe.py": 40, "runtime/test_ray_runtime.py": 34,
    "files/test_checkpoint_resume.py": 26, "models/test_families_parity.py": 25, "models/test_moe_parity.py": 20,
    "runtime/test_step_plan.py": 17, "host/test_lean_state.py": 16, "runtime/test_plan_facts.py": 14,
    "rl/test_rollout_copies.py": 13, "bench/test_baselines.py": 13, "models/test_model_table.py": 12,
}
TESTS = Path(__file__).parent


def module_seconds(item) -> int:
    return MODULE_SECONDS.get(Path(item.fspath).relative_to(TESTS).as_posix(), 0)


def pytest_configure(config):
    """xdist's --no-loadscope-reorder, where xdist runs (not an addopts: the GPU machine has no xdist)."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: -module_seconds(item))  # stable: a module's tests keep their order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def ray_head():
    """One Ray head of this machine for the whole test session, started when a module first asks
    for it: 2 CPUs and a small object store, the CI box's size. Starting a head costs seconds;
    joining a running one, a fraction of one.

    Ray's own local head (the node `ray.init(address="local")` starts) kept apart from any driver's
    connection, so that ray.shutdown() in a module leaves it running. Not cluster_utils.Cluster
    nor `ray start`: those write the machine's ray_current_cluster file, which a `megatrain-ray
    train` that a test (or anyone on the machine) starts would then join instead of starting its
    own. Its processes end with the session, or with this process through Ray's reaper."""
    from ray._private.node import Node
    from ray._private.parameter import RayParams

    head = Node(RayParams(num_cpus=2, object_store_memory=150 * MiB, include_dashboard=False),
                head=True, shutdown_at_exit=True, spawn_reaper=True)
    yield head.address
    head.kill_all_processes(check_alive=False, allow_graceful=True, wait=True)


@pytest.fixture(scope="module")
def local_ray(ray_head):
    """This process connected to the session's Ray head for one test module, and disconnected after
    it: a module that starts a cluster of its own (ray.cluster_utils.Cluster), or checks that a
    command refused before Ray started, finds this process not connected, whatever ran before.
    The module's actors and workers end with its connection."""
    ray.init(address=ray_head)
    yield
    ray.shutdown()


@pytest.fixture
def joining_env(ray_head) -> dict[str, str]:
    """The environment of a command a test starts (`megatrain-ray` in a subprocess) that joins the
    session's Ray head instead of starting a Ray of its own. RAY_AUTH_MODE=disabled: the head runs
    without token authentication, and a driver that turns it on (megatrain-ray does, with a token
    in ~/.ray) has its actors refused by such a head (Ray 2.60: SchedulingCancelled)."""
    return {**os.environ, "RAY_ADDRESS": ray_head, "RAY_AUTH_MODE": "disabled"}
