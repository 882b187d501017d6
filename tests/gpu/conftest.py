"""GPU tests: each starts with the memory of earlier tests' engines returned (engines hold reference
cycles, so they are freed by the garbage collector, not when the last name goes)."""
import gc

import pytest
import torch


@pytest.fixture(autouse=True)
def free_cuda_memory():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    yield
