"""vLLM's offline scheduling defaults on large GPUs: ``LLM`` (``EngineConfig.create(offline=True)``) on a
CUDA GPU of 70 GiB or more (not an A100) runs up to 1,024 requests and 16,384 tokens a step unless told
otherwise; smaller GPUs, the CPU and the server keep 256 and 8,192. The GPU is described to torch.cuda's
query functions here (this machine has none)."""
from types import SimpleNamespace

import pytest
import torch

from kvforge.config import LARGE_GPU_OFFLINE, EngineConfig, offline_scheduling_defaults

GIB = 2**30


@pytest.fixture
def gpu(monkeypatch):
    def describe(name: str, gib: float, count: int = 1) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda i: SimpleNamespace(name=name, total_memory=int(gib * GIB)))
    return describe


def test_a_large_gpu_gets_vllms_offline_defaults(gpu):
    gpu("NVIDIA H200", 139.8)
    config = EngineConfig.create(offline=True, model="dummy:tiny", device="cuda")
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (1024, 16384) == tuple(LARGE_GPU_OFFLINE.values())
    assert offline_scheduling_defaults("cuda:0") == LARGE_GPU_OFFLINE


def test_what_the_user_sets_wins_over_the_large_gpu_defaults(gpu, tmp_path):
    gpu("NVIDIA H100 80GB HBM3", 79.1)
    config = EngineConfig.create(offline=True, model="dummy:tiny", max_num_seqs=64)
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (64, 16384)
    path = tmp_path / "engine.toml"
    path.write_text("max_num_batched_tokens = 2048\n")
    config = EngineConfig.create(path, offline=True, model="dummy:tiny")
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (1024, 2048)


@pytest.mark.parametrize("name, gib, device", [("NVIDIA A100-SXM4-80GB", 79.2, "auto"),
                                               ("NVIDIA L40S", 44.5, "auto"),
                                               ("NVIDIA H200", 139.8, "cpu"),
                                               ("NVIDIA H200", 139.8, "cuda:3")])  # no such GPU: the checks name it
def test_other_devices_keep_the_dataclass_defaults(gpu, name, gib, device):
    gpu(name, gib)
    config = EngineConfig.create(offline=True, model="dummy:tiny", device=device)
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (256, 8192)


def test_the_server_keeps_the_dataclass_defaults_on_a_large_gpu(gpu):
    gpu("NVIDIA H200", 139.8)
    config = EngineConfig.create(model="dummy:tiny")  # what kvforge serve builds
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (256, 8192)
