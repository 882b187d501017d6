"""``ngram``: prompt-lookup drafting. The longest suffix of the context (prompt + output) that also
occurred earlier proposes the tokens that followed its latest earlier occurrence.

Per request and step: one vectorised comparison of the context with its last token gives the
candidate positions, then at most ``prompt_lookup_max - 1`` comparisons over the surviving candidates
only extend the match backwards. O(context) per request, no Python loop over tokens. Each request's
context lives in a numpy buffer of the drafter's that grows by the step's new tokens (no list is
converted per step).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvforge.spec_decode.drafter import DraftBatch, Drafter, DraftProposal


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
        self._contexts: dict[str, tuple[np.ndarray, int, int]] = {}  # id -> (buffer, prompt length, output cached)

    def propose(self, batch: DraftBatch) -> DraftProposal:
        return DraftProposal([propose_ngram(self._context(r), k, self.nmin, self.nmax) if k > 0 else []
                              for r, k in zip(batch.requests, batch.num_draft_tokens)])

    def release(self, request_ids) -> None:
        for rid in request_ids:
            self._contexts.pop(rid, None)

    def _context(self, req) -> np.ndarray:
        """The request's prompt + known output as a numpy view, grown in place by the new tokens."""
        out = req.output_token_ids
        n_out = len(out) - req.num_placeholders  # a placeholder is not a token yet
        buf, n_prompt, cached = self._contexts.get(req.request_id, (None, 0, -1))
        if buf is None or cached > n_out:
            prompt = req.prompt_token_ids
            n_prompt, cached = len(prompt), 0
            buf = np.empty(max(64, 2 * (n_prompt + n_out)), dtype=np.int64)
            buf[:n_prompt] = prompt
        n = n_prompt + n_out
        if n > len(buf):
            grown = np.empty(2 * n, dtype=np.int64)
            grown[:n_prompt + cached] = buf[:n_prompt + cached]
            buf = grown
        if n_out > cached:
            buf[n_prompt + cached:n] = out[cached:n_out]
        self._contexts[req.request_id] = (buf, n_prompt, n_out)
        return buf[:n]


def propose_ngram(context: np.ndarray, k: int, nmin: int, nmax: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the context's longest suffix
    of ``nmin..nmax`` tokens; [] where no such suffix occurred before."""
    n = len(context)
    if n < 2 or k <= 0:
        return []
    cand = np.flatnonzero(context[:n - 1] == context[n - 1])  # earlier ends of a 1-token match
    best = cand[-1] if nmin <= 1 and len(cand) else -1
    for j in range(1, min(nmax, n - 1)):  # extend the surviving matches one token backwards
        cand = cand[cand >= j]
        cand = cand[context[cand - j] == context[n - 1 - j]]
        if not len(cand):
            break
        if j + 1 >= nmin:
            best = cand[-1]
    if best < 0:
        return []
    return context[best + 1:best + 1 + k].tolist()
