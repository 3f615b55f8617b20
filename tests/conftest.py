"""Shared fixtures."""

import pytest
import torch


@pytest.fixture
def one_thread():
    """Tiny matmuls on a shared 2-core machine: extra threads only add contention."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
