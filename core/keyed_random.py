"""Counter-based random draws for seeded requests, keyed by what they are for, not by how many came before.

A seeded request promises the same tokens whatever else is batched with it, however many drafts a
step verifies, however its prompt is chunked and whatever the speculation policy does. A stream
generator (one ``torch.Generator`` per request) cannot keep that promise: a step that verifies k
drafts consumes other draws than a plain step, so the next token's draw depends on the history of
the steps. Here every draw is a pure function of a key::

    key = mix(mix(mix(seed + GAMMA) + position) + purpose)      (per row, on the host, numpy uint64)
    bits(key, v) = mix(key + (v + 1) * GAMMA)                     (per vocabulary entry, on the device)

``mix`` is splitmix64's finalizer (Steele, Lea and Flood, 2014) and the per-entry stage is
splitmix64's own stream with state ``key``, so the bits of different keys and entries are
independent for every practical purpose (tests/core/test_keyed_random.py checks the marginals and
the independence of neighbouring seeds and positions). ``position`` is the token's index in the
request's output (0 for the first generated token); ``purpose`` keeps apart draws with different
jobs at the same position (:data:`TOKEN`: the token's own draw; :data:`DRAFT`: a drafter's draw that
must be independent of it).

The token at output position p of a seeded row is ``argmax(probs / E)`` with ``E[v]`` an Exp(1)
draw from ``bits(key, v)`` (the exponential race, equivalent to drawing from ``probs``). Integer
arithmetic in torch wraps on overflow on every device, so CPU and CUDA give the same bits (and, on
the same probabilities, the same tokens). Cost: about 15 elementwise kernels over ``[rows, vocab]``
int64; on the CPU faster than torch's ``exponential_``, on an H200 165 us for 8 rows of a 49,152-token
vocabulary and 1.0 ms for 256 (torch's fused global draw: 25 and 90 us). Unseeded rows never pay it.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Sequence

import numpy as np
import torch

#: purposes: the token's own draw at an output position (the sampler, and the rejection sampler, which
#: compares the drafts with it); a drafter that wants its draws independent of the token's uses DRAFT.
#: NOTE: a drafter that wants its drafts accepted often draws them with TOKEN at the draft's position:
#: ``argmax(q / E)`` and ``argmax(p / E)`` with the same E agree with probability >= (1 - TV) / (1 + TV)
#: (the Gumbel coupling), against sum q * p for independent draws.
TOKEN, DRAFT = 0, 1

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15  # splitmix64's increment (2^64 / golden ratio)
_MUL1, _MUL2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _signed(c: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits (torch has no uint64 arithmetic)."""
    return c - (1 << 64) if c >= 1 << 63 else c


def _mix_np(z: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer over uint64 arrays (numpy array arithmetic wraps without warning)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_MUL1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_MUL2)
    return z ^ (z >> np.uint64(31))


def row_keys(seeds: Sequence[int], positions: Sequence[int] | np.ndarray, purpose: int = TOKEN) -> np.ndarray:
    """[n] int64 keys of n rows from their seeds (Python ints, taken modulo 2^64: the request seeds of
    [-2^63, 2^64 - 1]), output positions (>= 0) and one purpose. Vectorised on the host: a few numpy
    operations whatever n (the caller copies the keys to the device with the step's other inputs)."""
    s = np.fromiter((int(x) & _MASK64 for x in seeds), dtype=np.uint64, count=len(seeds))
    z = _mix_np(s + np.uint64(_GAMMA))
    z = _mix_np(z + np.asarray(positions, dtype=np.int64).astype(np.uint64))
    return _mix_np(z + np.uint64(purpose)).view(np.int64)


@lru_cache(maxsize=8)
def _offsets(vocab_size: int, device: torch.device) -> torch.Tensor:
    """[vocab] int64: (v + 1) * GAMMA, the per-entry step of the splitmix64 stream (built once)."""
    v = np.arange(1, vocab_size + 1, dtype=np.uint64) * np.uint64(_GAMMA)
    return torch.from_numpy(v.view(np.int64)).to(device)


def _shr(z: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic: it copies the sign bit)."""
    return (z >> n).bitwise_and_((1 << (64 - n)) - 1)


def keyed_bits(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[n, vocab] int64: ``mix(key + (v + 1) * GAMMA)``, splitmix64's stream of each key.
    keys: [n] int64 on the device."""
    z = keys[:, None] + _offsets(vocab_size, keys.device)[None, :]  # [n, vocab]
    z ^= _shr(z, 30)
    z *= _signed(_MUL1)
    z ^= _shr(z, 27)
    z *= _signed(_MUL2)
    z ^= _shr(z, 31)
    return z


def keyed_exponentials(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[n, vocab] float32 Exp(1) draws ``-log1p(-w)``, ``w`` uniform in (0, 1] from 63 of the bits.

    NOTE: never 0, so ``probs / E`` is never 0 / 0 (a NaN that argmax would pick, a masked token). The
    int64 -> float32 conversion keeps 24 significant bits at every scale, so small w, the small E that
    win the race, are as fine as float32 allows; w rounds up to 1 (E = inf, a token that cannot win)
    only past E ~ 16.6, which has probability 6e-8."""
    w = _shr(keyed_bits(keys, vocab_size), 1).float().add_(0.5).mul_(-(2.0 ** -63))  # -w
    return w.log1p_().neg_()


def keyed_draw(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """[n] int64: row i's token ``argmax(probs[i] / E[i])``, E keyed by ``keys[i]`` (distributed as
    ``probs[i]``). probs: [n, vocab] float32."""
    return (probs / keyed_exponentials(keys, probs.shape[-1])).argmax(dim=-1)
