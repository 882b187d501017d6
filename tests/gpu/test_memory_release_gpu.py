"""An engine gives its device memory back (issue 35): after ``shutdown()``, on leaving a ``with`` block,
and once a dropped ``LLM`` is collected, the device's free memory is back where it was before the engine
was built (weights, a KV cache sized by ``gpu_memory_utilization``, CUDA graphs and their pool, a draft
model's own). Engines built one after another in one process each get the whole device again."""
import gc

import pytest
import torch

from kvforge import LLM, SamplingParams

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
#: what may stay: the CUDA context's own allocations grow a little on first use of a kernel library
SLACK = 1 << 30


def _free() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def _available() -> int:
    """Free device memory, counting the blocks torch's allocator caches unused (a new engine takes them)."""
    return _free() + torch.cuda.memory_reserved() - torch.cuda.memory_allocated()


def _run(llm: LLM) -> None:
    assert llm.llm_engine.cuda_graph_capture_s is not None  # graphs and their pool were made
    outs = llm.generate([list(range(100, 164))] * 8, GREEDY, use_tqdm=False)  # a dummy model: token ids
    assert all(len(o.outputs[0].token_ids) == 16 for o in outs)


@pytest.mark.parametrize("how", ["shutdown", "with", "del"])
def test_device_memory_returns_after_the_engine_is_gone(how):
    LLM("dummy:llama-3.2-1b", gpu_memory_utilization=0.5, max_model_len=2048).shutdown()  # warm the libraries
    before, allocated = _free(), torch.cuda.memory_allocated()
    kw = dict(gpu_memory_utilization=0.6, max_model_len=2048,
              speculative_config={"method": "draft_model", "model": "dummy:llama-3.2-1b",
                                  "num_speculative_tokens": 2})
    if how == "with":
        with LLM("dummy:llama-3.2-1b", **kw) as llm:
            _run(llm)
            used = before - _free()
    else:
        llm = LLM("dummy:llama-3.2-1b", **kw)
        _run(llm)
        used = before - _free()
        if how == "shutdown":
            llm.shutdown()
        else:
            del llm
            gc.collect()
    assert used > 0.4 * torch.cuda.get_device_properties(0).total_memory  # the engine held its share
    assert torch.cuda.memory_allocated() <= allocated + (64 << 20)
    assert _available() >= before - SLACK, (before, _available())
    if how != "del":  # shut down (not only collected): the cached blocks went back to the device too
        assert _free() >= before - SLACK, (before, _free())


def test_two_engines_in_a_row_each_get_the_whole_share():
    sizes = []
    for _ in range(2):
        with LLM("dummy:llama-3.2-1b", gpu_memory_utilization=0.8, max_model_len=2048) as llm:
            _run(llm)
            sizes.append(llm.llm_engine.num_blocks)
    assert sizes[1] >= 0.98 * sizes[0], sizes
