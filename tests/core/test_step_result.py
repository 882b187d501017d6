"""One owner of a request's life (issue 35): the scheduler applies a step's tokens and answers with a
typed ``StepResult``; it alone writes a finished status and frees blocks. The output processor only
decides stop strings, beam search only asks the scheduler."""
from __future__ import annotations

import sys

import pytest

from kvforge import BeamSearchParams, SamplingParams
from kvforge.engine.output_processor import OutputProcessor, ParentState, StopString
from kvforge.errors import RequestFailure
from kvforge.outputs import RequestMetrics
from kvforge.plugins.kv_cache.paged import PagedKVCacheManager
from kvforge.plugins.scheduling.fcfs import FCFSScheduler
from kvforge.request import Request, RequestStatus
from kvforge.scheduler import ModelRunnerOutput
from kvforge.step_result import Failed, Finished, NewTokens, StepResult


def make(num_blocks=32, block_size=4):
    kv = PagedKVCacheManager(num_blocks=num_blocks, block_size=block_size)
    return FCFSScheduler(kv_cache=kv, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=num_blocks * block_size)


def req(rid, n=6, max_tokens=4, **params):
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens, **params), max_tokens=max_tokens)


def step(s, tokens):
    """Schedule, launch (advance) and apply one step; ``tokens``: request id -> the tokens it samples
    (an ``n > 1`` request's forks sample in the step that finishes sample 0's prompt)."""
    out = s.schedule()
    s.advance(out)
    return out, s.update(out, ModelRunnerOutput(dict(tokens)))


def test_max_tokens_finishes_with_length_and_frees_the_blocks():
    s = make()
    a = req("a", max_tokens=2)
    s.add(a)
    _, first = step(s, {"a": [7]})
    assert first.new_tokens == [NewTokens(a, [7])] and first.finished == [] and first.failed == []
    assert s.kv_cache.stats().num_used_blocks > 0
    _, last = step(s, {"a": [8]})
    assert last.new_tokens == [NewTokens(a, [8])]
    assert [(f.request_id, f.reason, f.stop_reason) for f in last.finished] == [("a", "length", None)]
    assert a.output_token_ids == [7, 8] and a.status == RequestStatus.FINISHED_LENGTH
    assert s.kv_cache.stats().num_used_blocks == 0 and "a" not in s.requests and not s.has_unfinished()


def test_a_stop_token_cuts_the_step_and_names_itself():
    """A step of several tokens (accepted drafts) stops at the first stop token; the rest are dropped."""
    s = make()
    a = req("a", max_tokens=10, stop_token_ids=[9])
    s.add(a)
    step(s, {"a": [7]})
    a.draft_token_ids = [5, 9, 4]
    out, result = step(s, {"a": [5, 9, 4, 3]})
    assert out.draft_token_ids == {"a": [5, 9, 4]}
    assert result.new_tokens == [NewTokens(a, [5, 9])] and a.output_token_ids == [7, 5, 9]
    assert [(f.reason, f.stop_reason) for f in result.finished] == [("stop", 9)]
    assert s.kv_cache.stats().num_used_blocks == 0


def test_n_samples_start_as_forks_in_the_result():
    s = make()
    a, b = req("a#0", max_tokens=1), req("a#1", max_tokens=3)
    b.fork_of = a
    a.forks.append(b)
    s.add(a)
    s.add(b)
    _, result = step(s, {"a#0": [7], "a#1": [8]})
    assert result.new_tokens == [NewTokens(a, [7]), NewTokens(b, [8])]
    assert [f.request_id for f in result.finished] == ["a#0"]  # b has 2 tokens to go
    assert s.running == [b] and b.status == RequestStatus.RUNNING


def test_stop_and_fail_end_requests_through_the_scheduler():
    s = make()
    a, b, c = req("a", max_tokens=8), req("b", max_tokens=8), req("c", max_tokens=8)
    for r in (a, b, c):
        s.add(r)
    step(s, {"a": [7], "b": [7], "c": [7]})
    step(s, {"a": [8], "b": [8], "c": [8]})
    end = s.stop(a, "zz", num_output_tokens=1)  # the stop string was complete after the first token
    assert end == Finished(a, RequestStatus.FINISHED_STOPPED, "zz") and end.reason == "stop"
    assert a.output_token_ids == [7] and a.stop_reason == "zz" and "a" not in s.requests
    failure = RequestFailure("broken", 400)
    assert s.fail_requests(["b", "unknown"], failure) == [Failed(b, failure)]
    assert b.status == RequestStatus.FINISHED_ERROR and b.error is failure
    assert s.running == [c]
    s.abort(["c"])
    assert s.kv_cache.stats().num_used_blocks == 0


def test_a_stop_string_wins_over_a_token_level_end_of_the_same_step():
    s = make()
    a = req("a", max_tokens=2)
    s.add(a)
    step(s, {"a": [7]})
    _, result = step(s, {"a": [8]})
    assert result.finished[0].reason == "length"
    assert s.stop(a, "zz").reason == "stop" and a.stop_reason == "zz" and a.output_token_ids == [7, 8]


def test_driven_requests_take_their_tokens_from_their_caller():
    """Beam search's contract: no placeholder, no sampled token applied; forks share blocks; the
    caller's tokens make the next step."""
    s = make(block_size=4)
    a = req("a", n=8, max_tokens=10)
    s.add_driven(a)
    out, result = step(s, {"a": [7]})
    assert result == StepResult() and a.output_token_ids == [] and a.num_computed_tokens == 8
    assert s.schedule().is_empty  # nothing to compute until the caller appends a token
    child = Request("b", list(a.prompt_token_ids), a.sampling_params, max_tokens=10)
    s.fork(a, child)
    assert s.running == [a, child] and s.requests["b"] is child and set(s.driven_ids) == {"a", "b"}
    assert s.kv_cache.block_table("b") == s.kv_cache.block_table("a")
    assert all(s.kv_cache.ref_count(blk) == 2 for blk in s.kv_cache.block_table("a"))
    with pytest.raises(ValueError, match="already in use"):
        s.fork(a, child)
    assert s.append_tokens(a, [5]) is None and s.append_tokens(child, [6]) is None
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}
    s.abort(["a", "b"])
    assert not s.driven_ids and s.kv_cache.stats().num_used_blocks == 0


def test_append_tokens_ends_a_driven_request_at_its_limit():
    s = make()
    a = req("a", max_tokens=1)
    s.add_driven(a)
    step(s, {"a": [7]})
    end = s.append_tokens(a, [5])
    assert end is not None and end.reason == "length" and s.kv_cache.stats().num_used_blocks == 0


def test_the_output_processor_decides_a_stop_string_without_writing_the_request(tiny_llm):
    tok = tiny_llm.get_tokenizer()
    ids = tok.encode(" one two three four", add_special_tokens=False)
    stop = tok.decode(ids[1:2]).strip()  # "two"
    r = Request("a", [1, 2, 3], SamplingParams(stop=[stop]), max_tokens=16, output_token_ids=list(ids),
                status=RequestStatus.RUNNING)
    proc = OutputProcessor(tok)
    proc.add(ParentState("a", None, [1, 2, 3], False, RequestMetrics(arrival_time=0.0)), [r])
    decisions = proc.detokenize(StepResult([NewTokens(r, list(ids))]), ModelRunnerOutput())
    assert decisions.stops == [StopString(r, stop, 2)] and decisions.failures == []
    assert r.status == RequestStatus.RUNNING and r.output_token_ids == ids and r.stop_reason is None


@pytest.fixture
def status_writers(monkeypatch):
    """The modules that set a request's ``status``, ``stop_reason`` or ``error``."""
    writers: set[str] = set()

    def record(self, name, value):
        if name in ("status", "stop_reason", "error"):
            writers.add(sys._getframe(1).f_globals["__name__"])
        object.__setattr__(self, name, value)

    monkeypatch.setattr(Request, "__setattr__", record)
    return writers


#: where a request's end may be written: the scheduler's base class, a policy (admission), and the
#: dataclass's own __init__ (a new request)
OWNERS = {"kvforge.scheduler", "kvforge.plugins.scheduling.fcfs", "kvforge.request"}


def test_only_the_scheduler_ends_requests_in_the_engine(tiny_llm, status_writers, monkeypatch, check_no_blocks):
    engine = tiny_llm.llm_engine
    greedy = dict(temperature=0, ignore_eos=True)
    # a stop string completed by the last token allowed: the stop string wins over the length limit
    for n in range(4, 16):
        ref = tiny_llm.generate("the stop test", SamplingParams(max_tokens=n, **greedy), use_tqdm=False)[0].outputs[0]
        last_text = tiny_llm.get_tokenizer().decode(ref.token_ids[-1:])
        stop = ref.text[-2:]
        if len(stop) == 2 and last_text and ref.text.endswith(last_text) and ref.text.find(stop) == len(ref.text) - 2:
            break
    else:
        pytest.fail("no output of 4 to 15 tokens ends in a stop string found nowhere before")
    stops = []
    real_stop = engine.scheduler.stop

    def spy(req, stop_reason=None, **kwargs):
        stops.append((req.request_id, stop_reason, kwargs.get("num_output_tokens")))
        return real_stop(req, stop_reason, **kwargs)

    monkeypatch.setattr(engine.scheduler, "stop", spy)
    status_writers.clear()
    outs = tiny_llm.generate(["the stop test", "count with me"],
                             [SamplingParams(max_tokens=n, stop=[stop], **greedy),
                              SamplingParams(max_tokens=5, n=2, temperature=1.0, seed=3, ignore_eos=True)],
                             use_tqdm=False)
    first = outs[0].outputs[0]
    assert (first.finish_reason, first.stop_reason, first.text) == ("stop", stop, ref.text[:-2])
    assert first.token_ids == ref.token_ids
    assert [c.finish_reason for c in outs[1].outputs] == ["length", "length"]
    assert stops == [(outs[0].request_id, stop, n)]
    assert "kvforge.scheduler" in status_writers and status_writers <= OWNERS, status_writers
    check_no_blocks(engine)


def test_beam_search_ends_its_beams_through_the_scheduler(tiny_llm, status_writers, check_no_blocks):
    status_writers.clear()
    out = tiny_llm.beam_search([list(range(200, 240))], BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True))
    assert len(out[0].sequences) == 3
    assert "kvforge.scheduler" in status_writers and status_writers <= OWNERS, status_writers
    assert not tiny_llm.llm_engine.scheduler.driven_ids
    check_no_blocks(tiny_llm.llm_engine)
