"""The Responses store is bounded by count and by bytes: the oldest responses go first, a response larger
than the whole budget is not kept, and a conversation that could not be kept is refused before any work
(issue 34: 40 reasoning items of 12 MiB were kept whole, in a store bounded only by count)."""
import pytest

from kvforge.server.errors import APIError
from kvforge.server.response_store import ResponseStore, json_bytes
from kvforge.server.responses_api import _stored_size, _Turn
from kvforge.server.responses_protocol import ReasoningItem, ResponsesRequest
from kvforge.server.tools import ToolPlan


def body(i: int, pad: int = 0) -> dict:
    return {"id": f"resp_{i}", "pad": "x" * pad}


def test_the_store_keeps_the_most_recent_within_its_count():
    store = ResponseStore(capacity=2)
    for i in range(3):
        assert store.put(body(i), [])
    assert store.get("resp_0") is None and [store.get(f"resp_{i}").body["id"] for i in (1, 2)] == ["resp_1", "resp_2"]
    assert store.total_bytes == 2 * json_bytes(body(0))


def test_the_store_drops_the_oldest_past_its_bytes_and_counts_each_size_once():
    one = json_bytes(body(0, pad=1000))
    store = ResponseStore(max_bytes=3 * one)
    for i in range(5):
        assert store.put(body(i, pad=1000), [])
        assert store.total_bytes == min(i + 1, 3) * one <= store.max_bytes
    assert [r for r in ("resp_0", "resp_1", "resp_2", "resp_3", "resp_4") if store.get(r)] == [
        "resp_2", "resp_3", "resp_4"]
    # a larger one pushes out as many of the oldest as it needs
    assert store.put(body(5, pad=2000), [])
    assert [r for r in ("resp_3", "resp_4", "resp_5") if store.get(r)] == ["resp_4", "resp_5"]
    assert store.total_bytes == one + json_bytes(body(5, pad=2000))


def test_items_count_with_the_body_and_a_continuation_counts_its_history_from_the_record():
    item = ReasoningItem(type="reasoning", content=[{"type": "reasoning_text", "text": "y" * 500}])
    store = ResponseStore()
    assert store.put(body(0), [item])
    first = store.get("resp_0")
    assert first.items_bytes == json_bytes(item) > 500 and first.size == first.items_bytes + json_bytes(body(0))
    assert store.measure([item, item], first) == 2 * first.items_bytes


def test_a_response_larger_than_the_whole_budget_is_not_kept_and_nothing_is_dropped_for_it():
    store = ResponseStore(max_bytes=5000)
    assert store.put(body(0, pad=100), [])
    before = store.total_bytes
    assert not store.put(body(1, pad=6000), [])
    assert store.get("resp_1") is None and store.get("resp_0") is not None and store.total_bytes == before


def test_a_stored_conversation_over_the_byte_budget_is_a_400_naming_input_before_any_work():
    store = ResponseStore(max_bytes=2000)
    req = ResponsesRequest(input=[{"type": "reasoning", "content": [{"type": "reasoning_text", "text": "z" * 3000}]},
                                  {"role": "user", "content": "hi"}])
    with pytest.raises(APIError) as err:
        _stored_size(req, req.items(), None, store)
    assert err.value.status == 400 and err.value.param == "input"
    assert "over its limit of 2000" in err.value.message
    unstored = req.model_copy(update={"store": False})
    assert _stored_size(unstored, unstored.items(), None, store) is None


def test_a_turn_whose_output_pushes_it_over_the_budget_is_not_kept():
    req = ResponsesRequest(input="hi")
    store = ResponseStore(max_bytes=3000)
    turn = _Turn(req, "m", ToolPlan("none"), None, 1, req.items(), store, None)
    turn.keep(turn.finished([{"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
                              "content": [{"type": "output_text", "text": "w" * 3000, "annotations": []}]}],
                            "stop", 1, 0, 0))
    assert len(store) == 0 and store.total_bytes == 0
    short = _Turn(req, "m", ToolPlan("none"), None, 1, req.items(), store, None)
    short.keep(short.finished([], "stop", 1, 0, 0))
    assert store.get(short.id) is not None and store.total_bytes == store.get(short.id).size
