"""Every front end the server can hold is an ``EngineClient`` (``kvforge.engine.client``)."""
from __future__ import annotations

import inspect

import pytest

from kvforge.engine.async_engine import AsyncLLMEngine
from kvforge.engine.client import EngineClient, protocol_members
from kvforge.engine.data_parallel import DataParallelEngine
from kvforge.engine.process import EngineProcessClient

FRONT_ENDS = [AsyncLLMEngine, EngineProcessClient, DataParallelEngine]
#: what each front end sets in its constructor rather than on the class
INSTANCE_ATTRIBUTES = {"config", "error", "dead", "max_model_len", "vocab_size", "modalities", "tokenizer",
                       "model_source"}


@pytest.mark.parametrize("front_end", FRONT_ENDS, ids=lambda c: c.__name__)
def test_each_front_end_has_every_member_with_the_protocol_s_parameters(front_end):
    members = protocol_members()
    assert {"add_request", "abort", "get_stats", "add_lora", "shutdown", "dead", "is_running"} <= members
    for name in sorted(members - INSTANCE_ATTRIBUTES):
        assert hasattr(front_end, name), f"{front_end.__name__} lacks {name}"
        want = getattr(EngineClient, name)
        got = getattr(front_end, name)
        if callable(want):
            want_params = list(inspect.signature(want).parameters)
            assert list(inspect.signature(got).parameters)[:len(want_params)] == want_params, name
            assert inspect.iscoroutinefunction(got) == inspect.iscoroutinefunction(want), name


def test_an_in_process_engine_is_an_engine_client_at_run_time():
    from kvforge.config import EngineConfig

    engine = AsyncLLMEngine.from_config(EngineConfig.create(None, model="dummy:tiny", device="cpu", max_model_len=64,
                                                            num_gpu_blocks_override=8))
    try:
        assert isinstance(engine, EngineClient)
        for name in INSTANCE_ATTRIBUTES:
            assert hasattr(engine, name), name
    finally:
        engine.shutdown()
