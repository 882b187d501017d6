"""The typed messages of the engine core process boundary (``kvforge.engine.messages``)."""
from __future__ import annotations

import pickle

import pytest

from kvforge.engine.messages import (
    ENGINE_CALLS,
    AddLora,
    CallReply,
    CheckStructuredOutputs,
    GetStats,
    ListLoras,
    PromptCache,
    PromptSent,
    RemoveLora,
)
from kvforge.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput

PROMPT_IDS = list(range(512))


def _delta(rid: str, step: int, finished: bool = False, plp=None) -> RequestOutput:
    out = CompletionOutput(0, f"t{step}", [1000 + step], "length" if finished else None)
    return RequestOutput(rid, "a prompt", PROMPT_IDS, [out], finished, 16, RequestMetrics(1.0, 2.0), plp)


def test_a_streamed_request_s_prompt_crosses_once_and_every_output_is_rebuilt_equal():
    sent, cache = PromptSent(), PromptCache()
    plp = [None, {5: Logprob(-0.5, 1, "x")}]
    outs = [_delta("r", 0, plp=plp), _delta("r", 1, plp=plp), _delta("r", 2, finished=True, plp=plp)]
    deltas = [sent.delta(o) for o in outs]
    assert deltas[0].prompt_token_ids == PROMPT_IDS and deltas[0].prompt_logprobs == plp
    assert all(d.prompt_token_ids is None and d.prompt_logprobs is None for d in deltas[1:])
    first, later = (len(pickle.dumps(d)) for d in deltas[:2])
    assert later * 3 < first  # the prompt was most of a delta
    rebuilt = [cache.output(pickle.loads(pickle.dumps(d))) for d in deltas]
    assert rebuilt == outs
    assert not sent._logprobs and not cache._prompts  # both forget a finished request


def test_prompt_logprobs_that_grow_after_the_first_delta_are_sent_again():
    sent, cache = PromptSent(), PromptCache()
    short, longer = [None], [None, {3: Logprob(-1.0, 1)}]
    outs = [_delta("r", 0, plp=short), _delta("r", 1, plp=longer), _delta("r", 2, plp=longer)]
    deltas = [sent.delta(o) for o in outs]
    assert [d.prompt_logprobs for d in deltas] == [short, longer, None]
    assert [cache.output(d) for d in deltas] == outs


def test_interleaved_requests_and_an_abort_leave_nothing_behind():
    sent, cache = PromptSent(), PromptCache()
    a0, b0 = sent.delta(_delta("a", 0)), sent.delta(_delta("b", 0))
    assert cache.output(a0) == _delta("a", 0) and cache.output(b0) == _delta("b", 0)
    sent.forget("a")
    cache.forget("a")
    assert cache.output(sent.delta(_delta("b", 1, finished=True))) == _delta("b", 1, finished=True)
    assert not sent._logprobs and not cache._prompts


class _Engine:
    def get_stats(self):
        return {"n": 1}

    def check_structured_outputs(self, so):
        raise ValueError(f"bad {so}")

    def add_lora(self, r):
        return r == "lora"

    def remove_lora(self, i):
        return i == 3

    def list_loras(self):
        return ["x"]


def test_each_call_runs_its_own_engine_method_and_nothing_else():
    engine = _Engine()
    assert GetStats().apply(engine) == {"n": 1}
    assert AddLora("lora").apply(engine) is True and RemoveLora(3).apply(engine) is True
    assert ListLoras().apply(engine) == ["x"]
    with pytest.raises(ValueError, match="bad c"):
        CheckStructuredOutputs("c").apply(engine)
    assert set(ENGINE_CALLS) == {GetStats, CheckStructuredOutputs, AddLora, RemoveLora, ListLoras}


def test_a_failed_call_s_reply_raises_an_exception_whatever_came_back():
    error = ValueError("lora_request: bad")
    assert CallReply(1, False, error).error is error
    odd = CallReply(2, False, "not an exception").error
    assert isinstance(odd, RuntimeError) and "not an exception" in str(odd)
