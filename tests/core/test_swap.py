"""The CPU swap pool: KV blocks survive a round trip through the runner's swap functions bit-exactly."""
import pytest
import torch

from kvforge.attention import as_bytes
from kvforge.plugins.attention.torch_backend import TorchAttentionBackend
from kvforge.rank.swap import copy_blocks_each
from kvforge.rank.worker import Worker

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


class HeadMajorBackend(TorchAttentionBackend):
    """Another block layout, [2, num_blocks, kv_heads, block_size, head_size]: swapping must follow it."""

    def kv_cache_shape(self, num_blocks):
        return (2, num_blocks, self.num_kv_heads, self.block_size, self.head_size)


class SwapRig:
    """The worker's KV cache and its swap methods, without a model."""

    bytes_per_block = Worker.bytes_per_block
    initialize_swap_space = Worker.initialize_swap_space
    swap_blocks = Worker.swap_blocks

    def __init__(self, attn, num_layers, num_blocks):
        self.attn, self.num_layers, self.extra_bytes_per_block = attn, num_layers, 0
        self.swap_space = self.kv_tier = None
        self.kv_caches = attn.allocate_kv_cache(num_blocks, num_layers)


def runner(device, backend=TorchAttentionBackend, num_blocks=8, dtype=torch.float16, kv_cache_dtype=None):
    attn = backend(num_heads=4, num_kv_heads=2, head_size=8, scale=1.0, block_size=4, dtype=dtype,
                   device=torch.device(device), kv_cache_dtype=kv_cache_dtype)
    r = SwapRig(attn, 3, num_blocks)
    # 6 CPU blocks: bytes_per_block = 2 * 4 * 2 * 8 * itemsize * 3 layers
    assert r.initialize_swap_space(6 * r.bytes_per_block() / 2**30) == 6
    for cache in r.kv_caches:
        cache.copy_(torch.randn(cache.shape, dtype=torch.float32).to(cache.dtype))
    return r


def same_bytes(a, b):
    """Bit-equal (an FP8 cache compares as bytes: PyTorch has no float8 ``equal`` on the CPU)."""
    return torch.equal(as_bytes(a), as_bytes(b))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", [TorchAttentionBackend, HeadMajorBackend])
@pytest.mark.parametrize("kv_cache_dtype", [None, torch.float8_e4m3fn], ids=["fp16", "fp8"])
def test_swap_round_trip_is_bit_exact(device, backend, kv_cache_dtype):
    r = runner(device, backend, kv_cache_dtype=kv_cache_dtype)
    src = [5, 1, 6]
    before = [c[:, src].clone() for c in r.kv_caches]
    r.swap_blocks([(5, 0), (1, 4), (6, 2)], [])
    for c in r.kv_caches:  # the device blocks are reused by others
        c[:, src] = -1
    r.swap_blocks([], [(0, 3), (4, 0), (2, 7)])
    if device == "cuda":
        torch.cuda.synchronize()
    pool = r.swap_space.caches[0]
    assert pool.shape == r.attn.kv_cache_shape(6) and pool.is_pinned() == (device == "cuda")
    assert pool.dtype == r.kv_caches[0].dtype == r.attn.kv_cache_dtype
    for c, b in zip(r.kv_caches, before):
        assert same_bytes(c[:, [3, 0, 7]], b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_cache_dtype", [None, torch.float8_e4m3fn], ids=["fp16", "fp8"])
def test_one_step_swapping_out_and_in_reads_every_source_first(device, kv_cache_dtype):
    """A swap-out into the CPU block a swap-in of the same step reads, and a swap-in into the device
    block a swap-out of the same step reads: both copies see the data from before the step."""
    r = runner(device, kv_cache_dtype=kv_cache_dtype)
    r.swap_blocks([(2, 1)], [])  # block 2 waits in CPU block 1
    old_cpu = [c[:, 2].clone() for c in r.kv_caches]
    old_dev = [c[:, 4].clone() for c in r.kv_caches]
    # this step: block 4 goes out to CPU block 1 (just released by the swap-in), the swap-in lands in block 4
    r.swap_blocks([(4, 1)], [(1, 4)])
    r.swap_blocks([], [(1, 6)])
    if device == "cuda":
        torch.cuda.synchronize()
    for c, a, b in zip(r.kv_caches, old_cpu, old_dev):
        assert same_bytes(c[:, 4], a) and same_bytes(c[:, 6], b)


def test_per_block_copies_match_the_gather_form():
    a = torch.randn(2, 5, 4, 3)
    b = torch.zeros(2, 7, 4, 3)
    copy_blocks_each(b, [6, 0], a, [1, 4])
    assert torch.equal(b[:, [6, 0]], a[:, [1, 4]]) and not b[:, 1:6].any()


def test_no_pool_refuses_swapping():
    r = runner("cpu")
    r.initialize_swap_space(0)
    with pytest.raises(ValueError, match="swap_space=0"):
        r.swap_blocks([(0, 0)], [])
    r.swap_blocks([], [])  # nothing to do: fine


def test_swap_space_option_and_flag():
    from kvforge.cli import build_parser, engine_kwargs
    from kvforge.config import EngineConfig

    assert EngineConfig().swap_space == 4.0 and EngineConfig(swap_space=0).swap_space == 0
    for bad in (-1, float("inf"), float("nan"), True, "4"):
        with pytest.raises(ValueError, match="swap_space"):
            EngineConfig(swap_space=bad)
    args = build_parser().parse_args(["generate", "hi", "--swap-space", "0.5"])
    assert engine_kwargs(args)["swap_space"] == 0.5
