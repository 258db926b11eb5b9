"""torch's CPU threads for a test: how work splits across them, or a tiny model's speed."""

from __future__ import annotations

import contextlib

import pytest
import torch


@contextlib.contextmanager
def torch_threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture
def three_threads():
    """Three threads for the test: more than a small CI machine's cores is fine, the split is what matters."""
    with torch_threads(3):
        yield


@pytest.fixture
def one_thread():
    """One thread: a tiny model's matmuls are faster so than fighting over a shared machine's cores."""
    with torch_threads(1):
        yield
