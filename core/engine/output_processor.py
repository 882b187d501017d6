"""Turns the scheduler's step results into ``RequestOutput``s: detokenization, stop strings,
logprobs, and the fan-in of a request's ``n`` samples (each sample runs as its own sequence).

It writes no request state. A stop string needs the detokenized text, so the processor decides it,
but the scheduler applies it: a step's outputs are made in two calls, with the engine in between:

    detokenize(result) -> TextDecisions   text, logprobs, metrics; the stop strings reached
    (engine) Scheduler.stop(...) for each stop, fail_request(...) for each failed detokenization
    make_outputs(result, decisions) -> list[RequestOutput]
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from kvforge.errors import RequestFailure, is_device_error
from kvforge.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from kvforge.request import Request
from kvforge.scheduler import ModelRunnerOutput, TokenLogprobs
from kvforge.step_result import StepResult
from kvforge.tokenizer import IncrementalDetokenizer


@dataclass(slots=True)
class StopString:
    """A sequence's text reached a stop string: the engine has the scheduler end it (status ``"stop"``,
    ``stop_reason`` the string) and keep its first ``num_output_tokens`` output tokens, up to the one
    that completed the string."""

    request: Request
    stop: str
    num_output_tokens: int


@dataclass
class TextDecisions:
    """What detokenizing a step decided, for the engine to have the scheduler apply before the outputs
    are made."""

    time: float  # when the step's outputs were made (time.time()): its token and finished times
    stops: list[StopString] = field(default_factory=list)
    failures: list[tuple[str, RequestFailure]] = field(default_factory=list)  # detokenization raised


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

    def detokenize(self, result: StepResult, runner_out: ModelRunnerOutput) -> TextDecisions:
        """The first half of a step's outputs: the metrics, logprobs and text of every sequence that
        took tokens, and the stop strings its text reached (the scheduler applies them). A sequence
        whose detokenization or stop check raised is reported in ``failures``."""
        decisions = TextDecisions(time.time())
        now = decisions.time
        for rid, (first_pos, entries) in runner_out.prompt_logprobs.items():
            seq = self.seqs.get(rid)
            if seq is not None and seq.parent.prompt_logprobs is not None:
                plp = seq.parent.prompt_logprobs
                for j, e in enumerate(entries):
                    if first_pos + j == len(plp):  # positions recomputed after preemption are skipped
                        plp.append(self._logprob_dict(e))
        for new in result.new_tokens:
            seq = self.seqs.get(new.request_id)
            if seq is None:
                continue
            m = seq.parent.metrics
            if m.first_token_time is None:
                m.first_token_time = now
            m.last_token_time = now
            if seq.logprobs is not None:
                seq.logprobs.extend(self._logprob_dict(e) for e in runner_out.logprobs.get(new.request_id, ()))
            try:
                stop = self._update_text(seq)
            except Exception as exc:
                if is_device_error(exc):
                    raise
                decisions.failures.append((new.request_id, RequestFailure.from_exception(exc, "detokenization")))
            else:
                if stop is not None:
                    decisions.stops.append(stop)
        return decisions

    def make_outputs(self, result: StepResult, decisions: TextDecisions) -> list[RequestOutput]:
        """The second half, once the scheduler applied the stops: an output for every request that
        took tokens or failed (only the finished one for ``final_only``); finished requests are
        forgotten."""
        touched: dict[str, ParentState] = {}
        for failed in result.failed:
            seq = self.seqs.get(failed.request_id)
            if seq is not None:
                touched[seq.parent.request_id] = seq.parent
        for new in result.new_tokens:
            seq = self.seqs.get(new.request_id)
            if seq is None:
                continue
            if seq.logprobs is not None:  # one entry per token kept (a stop may have cut the step's tokens)
                del seq.logprobs[len(seq.request.output_token_ids):]
            touched[seq.parent.request_id] = seq.parent
        outputs = []
        for parent in touched.values():
            if parent.finished:
                parent.metrics.finished_time = decisions.time
                self.remove(parent.request_id)
            elif parent.final_only:
                continue
            outputs.append(self.make_output(parent))
        return outputs

    def _update_text(self, seq: SeqState) -> StopString | None:
        """Detokenize the step's new tokens; with stop strings, one token at a time, so that a stop
        string found in a step of several tokens cuts the token list right after the one completing it."""
        req = seq.request
        if seq.detokenizer is None:
            return None
        new = req.output_token_ids[seq.num_detokenized:]
        if not seq.parent.stop:
            seq.num_detokenized += len(new)
            seq.text += seq.detokenizer.add(new) + (seq.detokenizer.flush() if req.finished else "")
            return None
        for token in new:
            seq.num_detokenized += 1
            last = seq.num_detokenized == len(req.output_token_ids)
            before = len(seq.text)
            seq.text += seq.detokenizer.add([token]) + (seq.detokenizer.flush() if last and req.finished else "")
            stop = self._check_stop_strings(seq, before) if len(seq.text) > before else None
            if stop is not None:  # the tokens after the stop string are dropped
                return StopString(req, stop, seq.num_detokenized)
        return None

    @staticmethod
    def _check_stop_strings(seq: SeqState, before: int) -> str | None:
        """The stop string that ends first in the text added after ``before``, if any; the text is cut
        there (after it with ``include_stop_str_in_output``)."""
        stops = seq.parent.stop
        # search only where a stop string could newly end: the new text and what could precede it
        start = max(0, before - max(len(s) for s in stops) + 1)
        hit = None
        for s in stops:
            i = seq.text.find(s, start)
            if i != -1 and (hit is None or i < hit[0]):
                hit = (i, s)
        if hit is None:
            return None
        i, s = hit
        keep = seq.request.sampling_params.include_stop_str_in_output
        seq.text = seq.text[:i + len(s) if keep else i]
        return s

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
