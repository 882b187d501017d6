"""An engine gives back what it holds once shut down (issue 35): the weights, the KV cache and the
drafter's, whether the ``LLM`` is shut down, left by a ``with`` block, or dropped. On the GPU the same is
measured in device memory (``tests/gpu/test_memory_release_gpu.py``); here weak references show that
nothing is kept alive."""
from __future__ import annotations

import gc
import weakref

import pytest

from kvforge import LLM, SamplingParams

ENGINE = dict(device="cpu", max_model_len=64, num_gpu_blocks_override=16)
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def _held(llm: LLM) -> dict[str, weakref.ref]:
    worker = llm.llm_engine.executor.driver
    held = {"weights": weakref.ref(next(worker.model.parameters())), "kv_cache": weakref.ref(worker.kv_caches[0])}
    if llm.llm_engine.spec is not None:
        drafter = llm.llm_engine.spec.drafter
        held["draft_weights"] = weakref.ref(next(drafter.model.parameters()))
        held["draft_kv_cache"] = weakref.ref(drafter.kv_caches[0])
    return held


def _gone(held: dict[str, weakref.ref]) -> dict[str, bool]:
    gc.collect()
    return {name: ref() is None for name, ref in held.items()}


@pytest.mark.parametrize("spec", [None, {"method": "draft_model", "model": "dummy:tiny", "num_speculative_tokens": 2}],
                         ids=["plain", "draft-model"])
def test_shutdown_gives_back_the_weights_and_kv_caches_while_the_llm_is_still_referenced(spec):
    llm = LLM("dummy:tiny", speculative_config=spec, **ENGINE)
    assert llm.generate(["hello"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    held = _held(llm)
    assert not any(_gone(held).values())  # alive while the engine runs
    llm.shutdown()
    assert all(_gone(held).values()), _gone(held)
    llm.shutdown()  # idempotent


def test_leaving_a_with_block_shuts_the_engine_down():
    with LLM("dummy:tiny", **ENGINE) as llm:
        assert llm.generate(["hello"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        held = _held(llm)
    assert all(_gone(held).values())


def test_a_dropped_llm_is_collected_with_everything_it_holds():
    llm = LLM("dummy:tiny", **ENGINE)
    llm.generate(["hello"], GREEDY, use_tqdm=False)
    held = _held(llm) | {"engine": weakref.ref(llm.llm_engine)}
    del llm
    assert all(_gone(held).values()), _gone(held)


def test_an_async_engine_releases_only_the_engine_it_owns():
    """A front end built from a config owns its engine and gives its memory back at shutdown; one that
    wraps a borrowed engine (an ``LLM``'s) leaves it to its owner, which can still generate."""
    from kvforge.config import EngineConfig
    from kvforge.engine.async_engine import AsyncLLMEngine

    llm = LLM("dummy:tiny", **ENGINE)
    borrowed = AsyncLLMEngine(llm.llm_engine)
    borrowed.start()
    borrowed.shutdown()
    assert llm.generate(["hello"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids  # still the LLM's
    held = _held(llm)
    llm.shutdown()
    assert all(_gone(held).values())

    owner = AsyncLLMEngine.from_config(EngineConfig.create(None, model="dummy:tiny", **ENGINE))
    owner.start()
    worker = owner.engine.executor.driver
    held = {"weights": weakref.ref(next(worker.model.parameters())), "kv_cache": weakref.ref(worker.kv_caches[0])}
    del worker
    owner.shutdown()
    assert all(_gone(held).values())
