"""Fixtures of the bench tests."""
import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    # NOTE: on a shared 2-core machine a second OpenMP thread that gets descheduled stalls every op;
    # one thread keeps these runs fast and steady
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
