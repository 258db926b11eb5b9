import pytest
import torch

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
