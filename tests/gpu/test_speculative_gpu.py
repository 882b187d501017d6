"""Speculative decoding on CUDA with the triton backend: verification steps replay CUDA graphs of
1 + k query tokens, the draft model's decode steps replay its own, and greedy output (float32, so
that kernels summing in another order cannot flip a near tie) is the output without speculation."""
import pytest

from kvforge import LLM, SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = ["Repeat this line exactly: the quick brown fox jumps over the lazy dog. The quick brown fox",
           "def add(a, b):\n    return a + b\n\ndef add(a, b):\n", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
           "The capital of France is Paris. The capital of France is", "Hello! Hello! Hello! Hello!",
           "Copy the list: apples, pears, plums, apples, pears,", "a b c d e f g a b c d e f g a b c",
           "Once upon a time, in a small village by the sea,"]
K = 4


def _run(spec, **kw):
    llm = LLM(device="cuda", dtype="float32", attention_backend="triton", gpu_memory_utilization=0.3,
              max_model_len=1024, max_num_seqs=16, speculative_config=spec, **kw)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def plain_tokens():
    return _run(None)[1]


def test_ngram_on_cuda_graphs_gives_the_greedy_output(plain_tokens, check_no_blocks):
    llm, tokens = _run({"method": "ngram", "num_speculative_tokens": K, "policy": "fixed"})
    assert tokens == plain_tokens
    graphs = llm.llm_engine.runner.graphs
    assert any(q == 1 + K and n > 0 for (_, q), n in graphs.replays.items()), graphs.replays
    assert llm.llm_engine.runner.num_graph_verifications > 0  # greedy: verified inside the graphs
    assert llm.llm_engine.get_stats()["spec_decode"]["num_accepted_tokens"] > 0
    check_no_blocks(llm.llm_engine)


def test_sampled_requests_are_verified_by_the_sampler_and_reproducible():
    spec = {"method": "ngram", "num_speculative_tokens": K, "policy": "fixed"}
    llm = LLM(device="cuda", dtype="float32", attention_backend="triton", gpu_memory_utilization=0.3,
              max_model_len=1024, max_num_seqs=16, speculative_config=spec)
    params = [SamplingParams(temperature=0.8, seed=7 + i, max_tokens=32, ignore_eos=True) for i in range(len(PROMPTS))]
    runs = [[o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)] for _ in range(2)]
    assert runs[0] == runs[1]
    assert llm.llm_engine.runner.num_graph_verifications == 0  # not greedy: the rejection sampler verified
    assert llm.llm_engine.spec_stats.num_steps > 0


def test_draft_model_on_cuda_gives_the_greedy_output(plain_tokens, default_model_path, check_no_blocks):
    llm, tokens = _run({"method": "draft_model", "model": default_model_path, "num_speculative_tokens": K,
                        "policy": "fixed"})
    assert tokens == plain_tokens
    drafter = llm.llm_engine.drafter
    assert drafter.graphs is not None and sum(drafter.graphs.replays.values()) > 0
    stats = llm.llm_engine.get_stats()["spec_decode"]
    assert stats["acceptance_rate"] > 0.95  # it drafts for itself (float32: a near tie may still differ)
    check_no_blocks(llm.llm_engine)
