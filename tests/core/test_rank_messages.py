"""The typed messages between the driver and its ranks (``kvforge.rank.messages``) and the packed step
(``kvforge.rank.step_codec``): a packed step comes back equal to the engine's, a running request
travels as its slot, each typed call is exactly one ``Worker`` method call, and executors written for
method names still get names."""
from __future__ import annotations

import inspect
import pickle
import random
import re
from dataclasses import fields
from typing import Any

import numpy as np
import pytest

from kvforge.kv_tier import TierTransfers
from kvforge.lora.request import LoRARequest
from kvforge.rank import messages
from kvforge.rank.executor import Executor, RankCallError, check_calls, takes_typed_calls
from kvforge.rank.messages import (
    AddLora,
    BatchState,
    CallDone,
    CallMethod,
    CaptureCudaGraphs,
    DetermineNumBlocks,
    FailedCall,
    InitializeCache,
    InitializeKVTier,
    InitializeSwapSpace,
    RankCall,
    RemoveLora,
    StartProfile,
    StopProfile,
    answer,
    as_call,
)
from kvforge.rank.step_codec import StepDecoder, StepEncoder, pack_ints, unpack_ints
from kvforge.rank.step_input import StepInput
from kvforge.rank.worker import Worker

TYPED_CALLS = [
    DetermineNumBlocks(num_blocks_override=None, kv_cache_memory_gib=0.5, gpu_memory_utilization=0.9,
                       max_num_batched_tokens=512, max_num_seqs=8, max_model_len=256),
    InitializeCache(64, 512, 8, 256),
    CaptureCudaGraphs(8, 256, (1, 4)),
    InitializeSwapSpace(0.25),
    InitializeKVTier(("cpu", "disk")),
    BatchState(),
    StartProfile(),
    StopProfile("/tmp/traces"),
    AddLora(LoRARequest("sql", 1, "/adapters/sql")),
    RemoveLora(1),
]


def assert_same_step(got: StepInput, want: StepInput) -> None:
    for f in fields(StepInput):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if isinstance(b, np.ndarray):
            assert isinstance(a, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape, f.name
            assert np.array_equal(a, b) and a.flags.writeable, f.name
        else:
            assert a == b, f.name


def _random_step(rng: random.Random, live: list[str], next_id: list[int]) -> StepInput:
    """A step over some live requests, new ones joining and some dropped (finished or preempted)."""
    for _ in range(rng.randint(0, 3)):
        live.append(f"{next_id[0]:032x}:cmpl-{rng.getrandbits(64):016x}")
        next_id[0] += 1
    dropped = rng.sample(live, k=min(len(live), rng.randint(0, 2)))
    if rng.random() < 0.2:
        dropped.append("never-scheduled")  # a request that ended before the ranks heard of it
    scheduled = [r for r in live if r not in dropped or rng.random() < 0.3]  # dropped, then back (preempted)
    for r in dropped:
        if r in live and r not in scheduled:
            live.remove(r)
    n = len(scheduled)

    def ints(lo: int, hi: int, size: int) -> np.ndarray:
        return np.array([rng.randint(lo, hi) for _ in range(size)], dtype=np.int64)

    big = rng.choice([100, 30_000, 70_000, 2**40])
    return StepInput(
        req_ids=scheduled, num_computed=ints(0, 4000, n), query_lens=ints(1, 3, n), input_ids=ints(-1, big, n),
        table_updates=[(r, rng.randint(0, 3), [rng.randint(0, 9000) for _ in range(rng.randint(0, 3))])
                       for r in scheduled if rng.random() < 0.3],
        dropped=dropped, blocks_to_copy=[(1, 2)] if rng.random() < 0.1 else [],
        graph_key=(32, 1) if rng.random() < 0.5 else None,
        sample_rows=ints(0, 200, n) if rng.random() < 0.3 else None, num_sample_rows=n, compute_logits=bool(n),
        prompt_rows=ints(-big, big, rng.choice([0, 70, 300])) if rng.random() < 0.4 else None,  # long: bytes
        fill_dst=ints(0, 100, 2) if rng.random() < 0.3 else None, fill_src=np.array([3, 1], dtype=np.int32),
        num_prev_tokens=n, lora_ids=ints(-(2**62), 2**62, n) if rng.random() < 0.2 else None,
        # the late, rarely set fields: left off the wire at their defaults, kept when set (an empty mm_free too)
        mm_free=rng.choice([None, [], [7]]), rope_offsets=ints(-9, 0, n) if rng.random() < 0.2 else None,
        lookahead=ints(0, 5, n) if rng.random() < 0.2 else None,
        tier=TierTransfers(saves=[(0, 3, 1)], loads=[(1, -5, 4)], drops=[(1, 7)],
                           tokens=[(1, 7, (1, 2))]) if rng.random() < 0.2 else None)


@pytest.mark.parametrize("max_ids", [1 << 16, 5])
def test_every_packed_step_comes_back_equal_to_the_engine_s(max_ids):
    """Ids joining, dropped, dropped and scheduled again, unknown when dropped; arrays of every width,
    empty, None, and not int64 (sent as they are); ``max_ids=5``: the encoder starts over often."""
    rng = random.Random(0)
    encoder, decoders = StepEncoder(max_ids=max_ids), [StepDecoder(), StepDecoder()]
    live: list[str] = []
    next_id = [0]
    for _ in range(300):
        step = _random_step(rng, live, next_id)
        wire = pickle.dumps(encoder.encode(step), pickle.HIGHEST_PROTOCOL)
        for decoder in decoders:  # every rank gets the same bytes
            assert_same_step(decoder.decode(pickle.loads(wire)), step)


def test_a_running_request_travels_as_its_slot():
    ids = [f"{i:032x}:cmpl-{i:032x}" for i in range(32)]
    step = StepInput(req_ids=ids, num_computed=np.arange(32, dtype=np.int64) + 100,
                     query_lens=np.ones(32, dtype=np.int64), input_ids=np.full(32, 31_000, dtype=np.int64),
                     num_sample_rows=32, compute_logits=True)
    encoder = StepEncoder()
    first, second = encoder.encode(step), encoder.encode(step)
    assert [rid for _, rid in first.new_ids] == ids and second.new_ids == ()
    wire = pickle.dumps(second, pickle.HIGHEST_PROTOCOL)
    assert ids[0].encode() not in wire
    # 32 slots, 32 positions, 32 ones, 32 token ids: about a byte or two each, and little else
    assert len(wire) < 400 < len(pickle.dumps(("exec", step), pickle.HIGHEST_PROTOCOL)) / 5


def test_long_int_arrays_travel_in_the_narrowest_type_that_holds_them_short_ones_as_lists():
    for values, size in [([0, 127, -128], 1), ([300, -5], 2), ([70_000], 4), ([2**40, -1], 8), ([2**63 - 1], 8)]:
        a = np.array(values * 64, dtype=np.int64)  # 64 values or more: long enough to pack
        packed = pack_ints(a)
        assert isinstance(packed, tuple) and packed[0] == size and len(packed[1]) == size * len(a)
        assert np.array_equal(unpack_ints(packed), a) and unpack_ints(packed).dtype == np.int64
    short = np.array([5, -(2**62), 31_000], dtype=np.int64)
    assert pack_ints(short) == [5, -(2**62), 31_000] and np.array_equal(unpack_ints([5, -(2**62), 31_000]), short)
    assert unpack_ints([]).dtype == np.int64 and unpack_ints([]).shape == (0,)
    assert pack_ints(np.zeros(3, dtype=np.int32)) is None and pack_ints(np.zeros((2, 2), dtype=np.int64)) is None


class RecordingWorker:
    """Records the one Worker method a call makes."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, inspect.BoundArguments]] = []

    def __getattr__(self, name: str) -> Any:
        method = getattr(Worker, name)

        def record(*args: Any, **kwargs: Any) -> str:
            self.calls.append((name, inspect.signature(method).bind(None, *args, **kwargs)))
            return f"{name} done"
        return record


@pytest.mark.parametrize("call", TYPED_CALLS, ids=lambda c: type(c).__name__)
def test_each_typed_call_is_one_worker_method_call_and_its_string_form(call):
    typed, named = RecordingWorker(), RecordingWorker()
    assert call.apply(typed) == f"{call.worker_method} done" == call.name + " done"
    name, args, kwargs = call.as_method()
    CallMethod(name, args, kwargs).apply(named)
    assert len(typed.calls) == 1 and [c[0] for c in named.calls] == [typed.calls[0][0]] == [name]
    for calls in (typed.calls, named.calls):
        calls[0][1].apply_defaults()
    assert typed.calls[0][1].arguments == named.calls[0][1].arguments  # the same arguments, bound by name
    assert pickle.loads(pickle.dumps(call)) == call and name.encode() not in pickle.dumps(call)


def test_every_typed_call_is_tested():
    typed = {c for c in vars(messages).values()
             if isinstance(c, type) and issubclass(c, RankCall) and c not in (RankCall, CallMethod)}
    assert typed == {type(c) for c in TYPED_CALLS}


def test_collective_rpc_arguments_become_one_call():
    assert as_call("batch_state", (), {}) == CallMethod("batch_state")
    assert as_call("stop_profile", ("/t",), {"row_limit": 3}) == CallMethod("stop_profile", ("/t",), {"row_limit": 3})
    assert as_call(BatchState(), (), {}) == BatchState()
    with pytest.raises(TypeError, match=r"collective_rpc\(StopProfile\(...\)\) takes no further arguments"):
        as_call(StopProfile(), ("/t",), {})


def test_a_rank_answers_a_failed_call_with_its_message_and_rank_and_raises_a_device_error():
    class Failing:
        def batch_state(self) -> dict[str, int]:
            raise OSError("unreadable")

        def remove_lora(self, lora_int_id: int) -> bool:
            raise MemoryError("host memory")

    worker: Any = Failing()
    assert answer(BatchState(), worker, 3) == FailedCall("OSError: unreadable", 3)
    with pytest.raises(MemoryError):  # the device's (or the process's): the rank ends
        answer(RemoveLora(1), worker, 3)
    assert answer(CallMethod("batch_state"), RecordingWorker(), 1) == CallDone("batch_state done")
    with pytest.raises(RankCallError, match=r"^rank 2: remove_lora failed: OSError: unreadable$"):
        check_calls(RemoveLora(1).name, {0: True, 2: answer(BatchState(), worker, 2), 1: True})


class TypedExecutor(Executor):
    """An executor of one fake rank, recording what its collective_rpc is given."""

    typed_calls = True
    given: list[object]

    def __init__(self) -> None:
        self.given = []

    def collective_rpc(self, call: RankCall[Any] | str, *args: Any, **kwargs: Any) -> list[Any]:
        self.given.append(call)
        return [as_call(call, args, kwargs).apply(RecordingWorker())]  # type: ignore[arg-type]  # a fake worker

    def execute_model(self, step, prev_tokens=None, prompt_sink=None):  # pragma: no cover - not stepped
        return None


class NamesExecutor(TypedExecutor):
    """A plugin's executor written before typed calls: its collective_rpc records method names."""

    recorded: list[str] = []

    def collective_rpc(self, method, *args, **kwargs):  # type: ignore[override]  # the old signature
        self.recorded.append(method)
        return super().collective_rpc(method, *args, **kwargs)


def test_the_engine_s_calls_reach_an_executor_written_for_names_as_names():
    typed, names = TypedExecutor(), NamesExecutor()
    assert takes_typed_calls(TypedExecutor) and not takes_typed_calls(NamesExecutor)
    for call in (DetermineNumBlocks(None, None, 0.9, 8, 2, 64), StopProfile("/t")):
        assert typed.call(call) == names.call(call) == [f"{call.worker_method} done"]
    assert typed.given == [DetermineNumBlocks(None, None, 0.9, 8, 2, 64), StopProfile("/t")]
    assert names.recorded == names.given == ["determine_num_blocks", "stop_profile"]  # the string form throughout


def test_the_docs_list_every_typed_call():
    """docs/distributed.md names the calls (Messages to the ranks): a new call type must join the list."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "distributed.md").read_text()
    bullet = text[text.index("- **Calls.** Each call is a `RankCall` type of its own ("):]
    listed = re.findall(r"`(\w+)`", bullet[:bullet.index(") whose `apply(worker)`")])
    assert set(listed) - {"RankCall"} == {type(c).__name__ for c in TYPED_CALLS}
