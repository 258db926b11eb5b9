"""torch's CPU threads for a test that checks how work splits across them."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def three_threads():
    """Three threads for the test: more than a small CI machine's cores is fine, the split is what matters."""
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    yield
    torch.set_num_threads(before)
