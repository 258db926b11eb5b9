"""Fixtures every test folder shares, and the `gpu` marker's skip on machines without CUDA.

Shared helpers (plain PyTorch training, small configs, the transformers checks) live in
tests/helpers/, importable as `helpers.*`: pyproject's pytest `pythonpath` puts tests/ on the path."""

import pytest
import ray
import torch

MiB = 1024**2

if torch.cuda.is_available():
    # One test process compiles the decoder blocks of many tiny shapes (a run compiles one or two);
    # past torch._dynamo's recompile limit a block would run eager and the test would not test the
    # compiled block.
    torch._dynamo.config.recompile_limit = 64


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def local_ray():
    """A real Ray cluster of this machine for one test module: 2 CPUs and a small object store, the
    CI box's size. address="local": a cluster of its own even where another runs here (`ray start`)."""
    ray.init(address="local", num_cpus=2, object_store_memory=150 * MiB, include_dashboard=False)
    yield
    ray.shutdown()
