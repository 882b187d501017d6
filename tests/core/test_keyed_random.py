"""Keyed draws (``kvforge.keyed_random``): splitmix64 bit for bit, the target distribution over seeds and
positions, independence between neighbouring keys, and the same bits on every device."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvforge import keyed_random as kr

V = 6
P = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.10, 0.00])
N = 200_000
TV_BOUND = 0.01  # as tests/core/test_rejection_sampler.py: the expected TV at N draws is about 0.002


def _splitmix64(state: int, i: int) -> int:
    """The reference: splitmix64's i-th output (1-based) from ``state``, in Python integers."""
    m = (1 << 64) - 1
    z = (state + i * 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


def _tv(tokens: torch.Tensor, p: torch.Tensor) -> float:
    counts = torch.bincount(tokens.flatten(), minlength=len(p)).float()
    return 0.5 * (counts / counts.sum() - p).abs().sum().item()


def test_bits_are_splitmix64_streams_of_the_row_keys():
    seeds, positions = [0, 1, 2 ** 64 - 1, -1, -2 ** 63, 12345], [0, 5, 3, 3, 7, 100_000]
    keys = kr.row_keys(seeds, positions, kr.TOKEN)
    assert keys[2] == keys[3] and len(set(keys.tolist())) == 5  # seeds are taken modulo 2^64
    bits = kr.keyed_bits(torch.from_numpy(keys), 40).numpy().view(np.uint64)
    for key, row in zip(keys.view(np.uint64).tolist(), bits.tolist()):
        assert row == [_splitmix64(key, v + 1) for v in range(40)]
    z = _splitmix64(12345, 1)  # the key: mix(mix(mix(seed + G) + position) + purpose)
    z = _splitmix64(z + 100_000, 0)
    assert keys.view(np.uint64)[5] == _splitmix64(z + kr.TOKEN, 0)
    assert kr.row_keys([7], [3], kr.DRAFT)[0] not in kr.row_keys([7, 7, 8], [3, 4, 3], kr.TOKEN)


def test_exponentials_are_exp1_and_never_zero():
    e = kr.keyed_exponentials(torch.from_numpy(kr.row_keys(range(2000), [0] * 2000)), 1000)
    assert (e > 0).all() and torch.isfinite(e).float().mean() == 1.0
    assert abs(e.mean().item() - 1) < 0.005 and abs(e.var().item() - 1) < 0.02
    assert abs((e > 1).float().mean().item() - np.exp(-1)) < 0.003  # the tail of Exp(1)


@pytest.mark.parametrize("over", ["seeds", "positions"])
def test_keyed_draws_follow_the_target_over_seeds_and_positions(over):
    seeds = list(range(N)) if over == "seeds" else [42] * N
    positions = [3] * N if over == "seeds" else list(range(N))
    tokens = kr.keyed_draw(P.expand(N, V), torch.from_numpy(kr.row_keys(seeds, positions)))
    assert _tv(tokens, P) < TV_BOUND and not (tokens == 5).any()  # p = 0: never drawn


@pytest.mark.parametrize("pair", ["positions p, p + 1", "seeds s, s + 1", "purposes"])
def test_neighbouring_keys_draw_independently(pair):
    """The joint distribution of two draws with keys one step apart is p x p (36 cells)."""
    s = np.arange(N)
    a = kr.row_keys(s.tolist(), np.zeros(N, dtype=np.int64), kr.TOKEN)
    if pair == "positions p, p + 1":
        b = kr.row_keys(s.tolist(), np.ones(N, dtype=np.int64), kr.TOKEN)
    elif pair == "seeds s, s + 1":
        b = kr.row_keys((s + 1).tolist(), np.zeros(N, dtype=np.int64), kr.TOKEN)
    else:
        b = kr.row_keys(s.tolist(), np.zeros(N, dtype=np.int64), kr.DRAFT)
    probs = P.expand(N, V)
    x, y = kr.keyed_draw(probs, torch.from_numpy(a)), kr.keyed_draw(probs, torch.from_numpy(b))
    assert _tv(x * V + y, torch.outer(P, P).flatten()) < 2 * TV_BOUND


@pytest.mark.gpu
def test_the_bits_and_the_draws_are_the_same_on_cuda():
    keys = torch.from_numpy(kr.row_keys(range(64), range(64)))
    assert torch.equal(kr.keyed_bits(keys.cuda(), 49_152).cpu(), kr.keyed_bits(keys, 49_152))
    probs = torch.softmax(torch.randn(64, 49_152), dim=-1)
    assert torch.equal(kr.keyed_draw(probs.cuda(), keys.cuda()).cpu(), kr.keyed_draw(probs, keys))
