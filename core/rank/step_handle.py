"""``StepHandle``: a launched step, from its device results to the host's ``ModelRunnerOutput``."""
from __future__ import annotations

import os
import time
from typing import Any, Callable

import torch

from kvforge.errors import RequestFailure
from kvforge.rank.input_buffers import HostInputs, d2h
from kvforge.scheduler import ModelRunnerOutput, TokenLogprobs

#: seconds between two looks at the ranks' health while the driver waits for a step
CHECK_EVERY_S = 0.1


def wait_event(event: torch.cuda.Event, check: Callable[[], None]) -> None:
    """Wait for ``event`` (yielding the core between looks), calling ``check`` every ``CHECK_EVERY_S``."""
    next_check = time.monotonic() + CHECK_EVERY_S
    while not event.query():
        if time.monotonic() >= next_check:
            check()
            next_check = time.monotonic() + CHECK_EVERY_S
        os.sched_yield()


class StepHandle:
    """A launched step: its sampled tokens on the device (for the next step's placeholders) and, once
    :meth:`result` has waited for them, on the host."""

    def __init__(self, buf: HostInputs | None, device: torch.device):
        self.buf, self.device = buf, device
        self.tokens: torch.Tensor | None = None  # [num_sampled] int64 on the device
        self.sample_reqs: list = []
        self.logprobs: tuple | None = None  # (requests, tensors of logprob_tensors)
        self.prompt_logprobs: tuple | None = None  # (spans, tensors)
        self.errors: dict[str, RequestFailure] = {}  # requests whose sampling failed (known at launch)
        # a step that verified drafts: [B, K + 2], request b's emitted tokens then their count
        self.verified: torch.Tensor | None = None
        self.logprob_rows: list[int] | None = None  # with drafts: rows of logprobs per request of self.logprobs
        self.event: torch.cuda.Event | None = None
        self._sampled: torch.Tensor | None = None  # what the host gets of ``tokens`` (NO_TOKEN where none)
        self._host: dict[str, Any] = {}
        self._result: ModelRunnerOutput | None = None

    @classmethod
    def done(cls, result: ModelRunnerOutput) -> "StepHandle":
        h = cls(None, torch.device("cpu"))
        h._result = result
        return h

    def set_tokens(self, tokens: torch.Tensor, reqs: list, sampled: torch.Tensor | None = None) -> None:
        """``tokens``: valid ids for the device to read; ``sampled`` (default ``tokens``): what the host
        gets, with ``NO_TOKEN`` for rows where nothing could be sampled."""
        self.tokens, self.sample_reqs = tokens, reqs
        self._sampled = tokens if sampled is None else sampled

    def set_verified(self, rows: torch.Tensor, reqs: list) -> None:
        """A step that verified drafts: row b is request b's emitted tokens, then their count
        (``VerifiedTokens.packed``). Such a step is never left in flight, so no later step reads its
        tokens on the device."""
        self.sample_reqs, self._sampled = reqs, None
        self.verified = rows

    def finish(self) -> None:
        """Queue the copies of the results to the host (pinned memory on CUDA) and mark their end."""
        cuda = self.device.type == "cuda"
        if self.verified is not None:
            self._host["verified"] = d2h(self.verified)
        elif self.tokens is not None:
            if self.buf is None:
                raise RuntimeError("a step that sampled tokens has no staging set to copy them into")
            dst = self.buf.tensors["sampled"][:len(self.sample_reqs)]
            dst.copy_(self._sampled if self._sampled is not None else self.tokens, non_blocking=cuda)
            self._host["tokens"] = dst
        for key in ("logprobs", "prompt_logprobs"):
            part = getattr(self, key)
            if part is not None:
                self._host[key] = {name: d2h(t) for name, t in part[1].items()}
        if cuda:
            self.event = torch.cuda.Event()
            self.event.record()

    def result(self, check: Callable[[], None] | None = None) -> ModelRunnerOutput:
        """Wait for the step (only for its own work: later steps may already be queued) and convert.
        ``check`` (several ranks): called every ``CHECK_EVERY_S`` while waiting, raises if a rank is gone
        (a step whose collectives wait for a dead peer never ends on the device)."""
        if self._result is not None:
            return self._result
        if self.event is not None:
            if check is None:
                self.event.synchronize()
            else:
                wait_event(self.event, check)
        res = ModelRunnerOutput()
        if self.verified is not None:
            res.sampled_token_ids = {r.request_id: row[:row[-1]] for r, row in
                                     zip(self.sample_reqs, self._host["verified"].tolist())}
        elif self.tokens is not None:
            res.sampled_token_ids = {r.request_id: [t] for r, t in zip(self.sample_reqs, self._host["tokens"].tolist())}
        if self.logprobs is not None:
            reqs, entries = self.logprobs[0], logprob_entries(self._host["logprobs"])
            counts = self.logprob_rows or [1] * len(reqs)
            start = 0
            for req, c in zip(reqs, counts):
                n = req.sampling_params.logprobs
                mine = entries[start:start + min(c, len(res.sampled_token_ids.get(req.request_id, ())))]
                start += c
                for entry in mine:
                    entry.top_ids, entry.top_logprobs = entry.top_ids[:n], entry.top_logprobs[:n]
                res.logprobs[req.request_id] = mine
        if self.prompt_logprobs is not None:
            spans = self.prompt_logprobs[0]
            entries = logprob_entries(self._host["prompt_logprobs"])
            pos = 0
            for r, start, n in spans:
                mine = entries[pos:pos + n]
                pos += n
                for e in mine:
                    e.top_ids = e.top_ids[:r.sampling_params.prompt_logprobs]
                    e.top_logprobs = e.top_logprobs[:r.sampling_params.prompt_logprobs]
                res.prompt_logprobs[r.request_id] = (start + 1, mine)  # entry j: prompt position start + 1 + j
        self._result = res
        self.buf = None
        return res


def logprob_tensors(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> dict[str, torch.Tensor]:
    """Log-softmax of raw logits [rows, vocab]: each row's chosen token's value and rank, and the top k
    (device tensors; :func:`logprob_entries` reads their host copies)."""
    lp = torch.log_softmax(logits, dim=-1)  # [rows, vocab]
    chosen = lp.gather(1, tokens[:, None]).squeeze(1)
    # an int32 count (a vocabulary fits): summing the [rows, vocab] comparison into int64 took half of
    # this function's time on a CPU, and int32 sums it about 1.5x faster
    rank = (lp > chosen[:, None]).sum(dim=1, dtype=torch.int32) + 1
    out = {"tokens": tokens, "chosen": chosen, "rank": rank}
    if k > 0:
        out["top_v"], out["top_i"] = lp.topk(k, dim=-1)
    return out


def logprob_entries(t: dict[str, torch.Tensor]) -> list[TokenLogprobs]:
    tokens = t["tokens"].tolist()
    if "top_v" in t:
        top_v, top_i = t["top_v"].tolist(), t["top_i"].tolist()
    else:
        top_v = top_i = [[] for _ in tokens]
    return [TokenLogprobs(tok, c, rk, ti, tv) for tok, c, rk, ti, tv in
            zip(tokens, t["chosen"].tolist(), t["rank"].tolist(), top_i, top_v)]
