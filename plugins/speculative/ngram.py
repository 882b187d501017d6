"""``ngram``: prompt-lookup drafting. The longest suffix of the context (prompt + output) that also
occurred earlier proposes the tokens that followed its latest earlier occurrence.

One batched numpy pass per step: the contexts are right-aligned in a ``[B, L]`` array, and for every
position i the length of the common suffix of ``context[:i + 1]`` and ``context`` (capped at
``prompt_lookup_max``) is built with ``prompt_lookup_max`` vectorised comparisons. O(context) per
request, no Python loop over tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvforge.drafter import DraftBatch, Drafter, DraftProposal


@dataclass
class NgramOptions:
    #: shortest suffix that may propose drafts
    prompt_lookup_min: int = 1
    #: longest suffix tried (the longest match wins)
    prompt_lookup_max: int = 4

    def __post_init__(self) -> None:
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max "
                             f"({self.prompt_lookup_max})")


class NgramDrafter(Drafter):
    name = "ngram"
    Options = NgramOptions

    def __init__(self, *, prompt_lookup_min: int = 1, prompt_lookup_max: int = 4, **kwargs):
        super().__init__(**kwargs)
        opts = NgramOptions(prompt_lookup_min, prompt_lookup_max)
        self.nmin, self.nmax = opts.prompt_lookup_min, opts.prompt_lookup_max

    def propose(self, batch: DraftBatch) -> DraftProposal:
        contexts = [np.asarray(r.all_token_ids, dtype=np.int64) for r in batch.requests]
        return DraftProposal(propose_ngram(contexts, batch.num_draft_tokens, self.nmin, self.nmax))


def propose_ngram(contexts: list[np.ndarray], ks: list[int], nmin: int, nmax: int) -> list[list[int]]:
    """For each context, up to ``ks[b]`` tokens that followed the latest earlier occurrence of its
    longest suffix of ``nmin..nmax`` tokens; [] where no such suffix occurred before."""
    B = len(contexts)
    if B == 0:
        return []
    L = max(len(c) for c in contexts)
    if L < 2:
        return [[] for _ in contexts]
    a = np.full((B, L), -1, dtype=np.int64)  # right-aligned; -1 never equals a token
    for b, c in enumerate(contexts):
        a[b, L - len(c):] = c
    # match[b, i]: common suffix length of a[b, :i + 1] and a[b, :], for the earlier positions i < L - 1
    match = np.zeros((B, L - 1), dtype=np.int64)
    alive = np.ones((B, L - 1), dtype=bool)
    for j in range(min(nmax, L - 1)):
        tail = a[:, L - 1 - j]  # the suffix's token j from the end
        same = np.zeros((B, L - 1), dtype=bool)
        same[:, j:] = a[:, :L - 1 - j] == tail[:, None]
        same &= (tail >= 0)[:, None]
        alive &= same
        match += alive
    match[match < nmin] = 0
    best = match.max(axis=1)
    latest = L - 2 - np.argmax(match[:, ::-1] == best[:, None], axis=1)
    out = []
    for b in range(B):
        k = ks[b]
        if best[b] == 0 or k <= 0:
            out.append([])
        else:
            start = latest[b] + 1
            out.append(a[b, start:min(start + k, L)].tolist())
    return out
