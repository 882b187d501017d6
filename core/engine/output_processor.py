"""Turns the scheduler's token updates into ``RequestOutput``s: detokenization, stop strings,
logprobs, and the fan-in of a request's ``n`` samples (each sample runs as its own sequence)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from kvforge.errors import RequestFailure, is_device_error
from kvforge.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from kvforge.request import Request
from kvforge.scheduler import ModelRunnerOutput, TokenLogprobs
from kvforge.tokenizer import IncrementalDetokenizer


@dataclass
class SeqState:
    """One sample of a request."""

    request: Request
    index: int
    parent: "ParentState"
    detokenizer: IncrementalDetokenizer | None
    text: str = ""  # text so far (cut at a stop string)
    logprobs: list[dict[int, Logprob]] | None = None
    sent_tokens: int = 0
    sent_text: int = 0
    sent_logprobs: int = 0
    reported_finish: bool = False
    num_detokenized: int = 0  # output tokens handed to the detokenizer


@dataclass
class ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    delta: bool
    metrics: RequestMetrics
    final_only: bool = False  # report only the finished output (offline generate: no per-step copies)
    seqs: list[SeqState] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    stop: list[str] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(s.request.finished for s in self.seqs)


class OutputProcessor:
    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.parents: dict[str, ParentState] = {}
        self.seqs: dict[str, SeqState] = {}  # sequence (scheduler) request id -> state
        self.pending_finished: list[Request] = []  # ended outside a step's update (failed grammar)
        # token id -> its text alone, for logprob entries (prompt logprobs decode k + 1 ids a position);
        # at most one string per vocabulary entry
        self.token_texts: dict[int, str] = {}

    def add(self, parent: ParentState, children: list[Request]) -> None:
        params = children[0].sampling_params
        if params.prompt_logprobs is not None:
            parent.prompt_logprobs = [None]
        parent.stop = list(params.stop or [])
        for i, req in enumerate(children):
            detok = None
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, params.skip_special_tokens)
            seq = SeqState(req, i, parent, detok, logprobs=[] if params.logprobs is not None else None)
            parent.seqs.append(seq)
            self.seqs[req.request_id] = seq
        self.parents[parent.request_id] = parent

    def remove(self, request_id: str) -> list[str]:
        """Forget a request; returns the sequence ids to abort in the scheduler."""
        parent = self.parents.pop(request_id, None)
        if parent is None:
            return []
        for s in parent.seqs:
            self.seqs.pop(s.request.request_id, None)
        return [s.request.request_id for s in parent.seqs]

    def process(self, updated: list[Request], runner_out: ModelRunnerOutput, finish: Any,
                fail: Any) -> list[RequestOutput]:
        """``finish(seq_id, stop_string)`` ends a sequence whose text hit a stop string;
        ``fail(seq_id, RequestFailure)`` ends a request whose detokenization or stop check raised."""
        now = time.time()
        touched: dict[str, ParentState] = {}
        for req in self.pending_finished:
            seq = self.seqs.get(req.request_id)
            if seq is not None:
                touched[seq.parent.request_id] = seq.parent
        self.pending_finished = []
        for rid, (first_pos, entries) in runner_out.prompt_logprobs.items():
            seq = self.seqs.get(rid)
            if seq is not None and seq.parent.prompt_logprobs is not None:
                plp = seq.parent.prompt_logprobs
                for j, e in enumerate(entries):
                    if first_pos + j == len(plp):  # positions recomputed after preemption are skipped
                        plp.append(self._logprob_dict(e))
        for req in updated:
            seq = self.seqs.get(req.request_id)
            if seq is None:
                continue
            parent = seq.parent
            m = parent.metrics
            if m.first_token_time is None:
                m.first_token_time = now
            m.last_token_time = now
            if seq.logprobs is not None:
                seq.logprobs.extend(self._logprob_dict(e) for e in runner_out.logprobs.get(req.request_id, ()))
            try:
                self._update_text(seq, finish)
            except Exception as exc:
                if is_device_error(exc):
                    raise
                fail(req.request_id, RequestFailure.from_exception(exc, "detokenization"))
            if seq.logprobs is not None:  # one entry per token kept (a stop may have cut the step's tokens)
                del seq.logprobs[len(req.output_token_ids):]
            touched[parent.request_id] = parent
        outputs = []
        for parent in touched.values():
            if parent.finished:
                parent.metrics.finished_time = now
                self.remove(parent.request_id)
            elif parent.final_only:
                continue
            outputs.append(self.make_output(parent))
        return outputs

    def _update_text(self, seq: SeqState, finish: Any) -> None:
        """Detokenize the step's new tokens; with stop strings, one token at a time, so that a stop
        string found in a step of several tokens cuts the token list right after the one completing it."""
        req = seq.request
        if seq.detokenizer is None:
            return
        new = req.output_token_ids[seq.num_detokenized:]
        if not seq.parent.stop:
            seq.num_detokenized += len(new)
            seq.text += seq.detokenizer.add(new) + (seq.detokenizer.flush() if req.finished else "")
            return
        for token in new:
            seq.num_detokenized += 1
            last = seq.num_detokenized == len(req.output_token_ids)
            before = len(seq.text)
            seq.text += seq.detokenizer.add([token]) + (seq.detokenizer.flush() if last and req.finished else "")
            if len(seq.text) > before and self._check_stop_strings(seq, before, finish):
                del req.output_token_ids[seq.num_detokenized:]  # tokens after the stop string are dropped
                return

    @staticmethod
    def _check_stop_strings(seq: SeqState, before: int, finish: Any) -> bool:
        """Whether a stop string ends in the text added after ``before``; then cut the text there and
        finish the sequence."""
        req, stops = seq.request, seq.parent.stop
        # search only where a stop string could newly end: the new text and what could precede it
        start = max(0, before - max(len(s) for s in stops) + 1)
        hit = None
        for s in stops:
            i = seq.text.find(s, start)
            if i != -1 and (hit is None or i < hit[0]):
                hit = (i, s)
        if hit is None:
            return False
        i, s = hit
        keep = req.sampling_params.include_stop_str_in_output
        seq.text = seq.text[:i + len(s) if keep else i]
        if not req.finished:
            finish(req.request_id, s)
        else:  # it finished this step for another reason; the stop string still wins
            from kvforge.request import RequestStatus
            req.stop_reason = s
            req.status = RequestStatus.FINISHED_STOPPED
        return True

    def _logprob_dict(self, e: TokenLogprobs) -> dict[int, Logprob]:
        def dec(t: int) -> str | None:
            if self.tokenizer is None:
                return None
            text = self.token_texts.get(t)
            if text is None:
                text = self.token_texts[t] = self.tokenizer.decode([t])
            return text

        d = {t: Logprob(v, r + 1, dec(t)) for r, (t, v) in enumerate(zip(e.top_ids, e.top_logprobs))}
        if e.token_id not in d:
            d[e.token_id] = Logprob(e.logprob, e.rank, dec(e.token_id))
        else:
            d[e.token_id].rank = e.rank
        return d

    def make_output(self, parent: ParentState) -> RequestOutput:
        completions = []
        for seq in parent.seqs:
            req = seq.request
            finish = req.status.value if req.finished else None
            text, ids, lps = seq.text, req.output_token_ids, seq.logprobs
            if parent.delta:
                if finish is None and parent.stop:
                    # hold back what could be the start of a stop string
                    text = text[:max(seq.sent_text, len(text) - max(len(s) for s in parent.stop) + 1)]
                if (len(ids) == seq.sent_tokens and len(text) == seq.sent_text
                        and (finish is None or seq.reported_finish)):
                    continue
                text, ids = text[seq.sent_text:], ids[seq.sent_tokens:]
                lps = lps[seq.sent_logprobs:] if lps is not None else None
                seq.sent_text += len(text)
                seq.sent_tokens += len(ids)
                seq.sent_logprobs += len(lps) if lps is not None else 0
                seq.reported_finish = finish is not None
            else:
                ids = list(ids)
                lps = list(lps) if lps is not None else None
            completions.append(CompletionOutput(seq.index, text, ids, finish, req.stop_reason, lps))
        first = parent.seqs[0].request
        error = next((s.request.error for s in parent.seqs if s.request.error is not None), None)
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, completions,
                             parent.finished, first.num_cached_tokens, parent.metrics,
                             parent.prompt_logprobs, error)
