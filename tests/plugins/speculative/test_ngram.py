"""``ngram`` (prompt lookup): the longest earlier match of the context's suffix proposes what followed it."""
from __future__ import annotations

import numpy as np
import pytest

from kvforge.plugins.speculative.ngram import NgramDrafter, propose_ngram
from kvforge.request import Request
from kvforge.sampling_params import SamplingParams
from kvforge.spec_decode.drafter import DraftBatch


def _ctx(*tokens):
    return np.array(tokens, dtype=np.int64)


def test_the_longest_suffix_match_proposes_what_followed_it():
    # suffix [7, 8, 9] occurred at 1..3 followed by 4, 5; the shorter [8, 9] also at 10..11 followed by 6
    ctx = _ctx(0, 7, 8, 9, 4, 5, 1, 2, 3, 0, 8, 9, 6, 7, 8, 9)
    assert propose_ngram(ctx, 3, 1, 3) == [4, 5, 1]
    # with a max of 2 the latest match of [8, 9] wins (it is at 10..11, followed by 6)
    assert propose_ngram(ctx, 3, 1, 2) == [6, 7, 8]


def test_no_match_or_too_short_a_match_proposes_nothing():
    assert propose_ngram(_ctx(1, 2, 3, 4), 4, 1, 3) == []
    assert propose_ngram(_ctx(5, 1, 9, 5), 4, 2, 3) == []  # only a 1-token match
    assert propose_ngram(_ctx(5, 1, 9, 5), 4, 1, 3) == [1, 9, 5]


def test_drafts_stop_at_the_end_of_the_context_and_at_k():
    ctx = _ctx(1, 2, 3, 1, 2)
    assert propose_ngram(ctx, 5, 1, 2) == [3, 1, 2]
    assert propose_ngram(ctx, 1, 1, 2) == [3]
    assert propose_ngram(ctx, 0, 1, 2) == []


def test_a_batch_matches_each_context_alone():
    rng = np.random.default_rng(0)
    reqs = []
    for i, n in enumerate(rng.integers(1, 60, size=40)):
        r = Request(str(i), rng.integers(0, 5, size=int(n)).tolist(), SamplingParams())
        r.output_token_ids = rng.integers(0, 5, size=int(rng.integers(0, 9))).tolist()
        reqs.append(r)
    ks = [int(k) for k in rng.integers(0, 6, size=40)]
    d = NgramDrafter(num_speculative_tokens=5, prompt_lookup_min=2, prompt_lookup_max=4)
    together = d.propose(DraftBatch(reqs, ks)).token_ids
    assert together == [propose_ngram(np.array(r.all_token_ids), k, 2, 4) for r, k in zip(reqs, ks)]
    assert sum(map(len, together)) > 0


def test_the_drafter_follows_a_growing_output_and_skips_placeholders():
    """The drafter keeps each context as a growing array: new tokens are appended, a placeholder (a
    token still in flight) is not read, and an output that got shorter is read afresh."""
    r = Request("a", [5, 6, 7, 1, 2], SamplingParams())
    d = NgramDrafter(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=2)
    rng = np.random.default_rng(2)
    for step in range(40):
        r.output_token_ids += rng.integers(0, 8, size=int(rng.integers(1, 4))).tolist()
        r.num_placeholders = 1 if step % 3 == 0 else 0
        if step == 20:
            del r.output_token_ids[-5:]
        known = r.all_token_ids[:r.num_tokens - r.num_placeholders]
        assert d.propose(DraftBatch([r], [3])).token_ids == [propose_ngram(np.array(known), 3, 1, 2)]
    d.release(["a"])
    assert not d._contexts


def test_brute_force_agrees_on_random_contexts():
    rng = np.random.default_rng(1)
    for _ in range(200):
        ctx = rng.integers(0, 4, size=int(rng.integers(2, 30)))
        got = propose_ngram(ctx, 3, 1, 3)
        want = []
        for n in range(3, 0, -1):  # longest suffix first, its latest earlier occurrence
            if n >= len(ctx):
                continue
            suffix = list(ctx[-n:])
            starts = [i for i in range(len(ctx) - n) if list(ctx[i:i + n]) == suffix]
            if starts:
                s = starts[-1] + n
                want = list(ctx[s:s + 3])
                break
        assert got == want, (ctx.tolist(), got, want)


def test_the_drafter_reads_prompt_and_output():
    r = Request("a", [1, 2, 3, 4], SamplingParams())
    r.output_token_ids = [1, 2]
    d = NgramDrafter(num_speculative_tokens=2, prompt_lookup_min=2, prompt_lookup_max=3)
    assert d.propose(DraftBatch([r], [2])).token_ids == [[3, 4]]


@pytest.mark.parametrize("opts,match", [
    (dict(prompt_lookup_min=0), "prompt_lookup_min must be an integer >= 1"),
    (dict(prompt_lookup_min=4, prompt_lookup_max=2), "must be <= prompt_lookup_max"),
    (dict(num_speculative_tokens=0), "num_speculative_tokens must be an integer >= 1"),
])
def test_bad_options_are_value_errors(opts, match):
    with pytest.raises(ValueError, match=match):
        NgramDrafter(**{"num_speculative_tokens": 2, **opts})
