"""Two engines on one GPU in one process (several models behind one server): ``gpu_memory_utilization`` is each
engine's own share, so the second gets as much KV cache as the first, not what the first left over; and a
share larger than what is free gives the cache the free memory, not an out-of-memory error later."""
import pytest
import torch

from kvforge import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ENGINE = {"max_num_seqs": 16, "max_model_len": 512, "enforce_eager": True}
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def test_second_engine_gets_its_own_share_and_both_answer():
    engines = []
    try:
        engines += [LLM(None, gpu_memory_utilization=0.2, **ENGINE)]
        engines += [LLM(None, gpu_memory_utilization=0.2, **ENGINE)]
        a, b = (e.llm_engine.num_blocks for e in engines)
        assert a > 1000 and abs(a - b) <= 0.05 * a, (a, b)  # the same share, within what profiling moves
        want, got = (e.generate(["The capital of France is"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
                     for e in engines)
        assert list(got) == list(want)
        # a third engine asking for more than is left gets what is free (the first two hold ~40%), and runs
        engines += [LLM(None, gpu_memory_utilization=0.9, **ENGINE)]
        assert engines[2].llm_engine.num_blocks > 0 and torch.cuda.mem_get_info()[0] > 0
        assert engines[2].generate(["The capital of France is"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == want
    finally:
        for llm in engines:
            llm.shutdown()
        torch.cuda.empty_cache()
