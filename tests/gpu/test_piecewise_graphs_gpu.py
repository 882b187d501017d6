"""Mixed steps (prompt chunks with decode tokens) replayed as piecewise CUDA graphs compute the eager
steps' tokens (GPU machine; kvforge.rank.piecewise_graphs)."""
import gc

import pytest
import torch

from kvforge import LLM, SamplingParams

pytestmark = pytest.mark.gpu

LENGTHS = (5, 300, 17, 64, 1, 900, 33, 128, 250, 77)


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(100, vocab - 100, (n,), generator=gen).tolist() for n in LENGTHS]


def _run(model: str | None, piecewise: int | None, **kw) -> tuple[list[list[int]], dict[int, int], object]:
    llm = LLM(model, max_piecewise_graph_tokens=piecewise, **kw)
    pw = llm.llm_engine.runner.worker.piecewise
    prompts = _prompts(llm.llm_engine.model_config.vocab_size)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    replays = dict(pw.replays) if pw is not None else {}
    sizes = list(pw.sizes) if pw is not None else []
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return tokens, replays, sizes


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_mixed_steps_on_piecewise_graphs_give_the_eager_tokens_in_float32(backend):
    # the real default model in float32, a 192-token budget: ten prompts of 1..900 tokens arrive at once,
    # so most steps mix a prompt chunk with decode tokens; decode graphs are the same on both sides, the
    # only difference is whether those mixed steps replay piecewise graphs (torch: no decode graphs at all)
    kw = dict(dtype="float32", attention_backend=backend, num_gpu_blocks_override=1024, max_num_seqs=8,
              max_model_len=2048, max_num_batched_tokens=192)
    eager, none, _ = _run(None, 0, **kw)
    assert none == {}
    graphs, replays, sizes = _run(None, None, **kw)
    assert sizes[-1] == 192
    assert sum(LENGTHS) // 192 <= sum(replays.values())  # every prompt token went through a piecewise step
    assert graphs == eager


def test_mixed_steps_on_piecewise_graphs_in_bf16_match_up_to_near_ties():
    # an 8B-like shape in bf16 (Llama-3.2-1B, random weights): padded rows change cuBLAS's choice of
    # kernel, so logits agree to rounding; tokens are compared only up to the first near-tie
    kw = dict(attention_backend="triton", num_gpu_blocks_override=2048, max_num_seqs=8, max_model_len=2048,
              max_num_batched_tokens=512)
    eager, _, _ = _run("dummy:llama-3.2-1b", 0, **kw)
    graphs, replays, sizes = _run("dummy:llama-3.2-1b", None, **kw)
    assert sizes[-1] == 512 and sum(replays.values()) >= sum(LENGTHS) // 512
    same = sum(g == e for g, e in zip(graphs, eager))
    prefix = [next((i for i, (a, b) in enumerate(zip(g, e)) if a != b), len(e)) for g, e in zip(graphs, eager)]
    assert same >= len(LENGTHS) // 2 and min(prefix) >= 1, prefix
