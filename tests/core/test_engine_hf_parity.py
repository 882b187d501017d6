"""End-to-end truth: greedy tokens equal transformers `generate` on the same default-model weights."""

import pytest
import torch

from kvforge import LLM, SamplingParams

MAX_TOKENS = 32
SHARED = ("You are a careful assistant. Answer the question about the history of European cities "
          "in one sentence, and mention the century in which each city was founded if you know it. ")
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Hello, my name is",
    SHARED + "Question: when was Paris founded?",
    "1, 2, 3, 4, 5,",
    SHARED + "Question: tell me about Rome.",
    "The quick brown fox",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who every "
    "morning walked down to the harbour to look at the boats, count the gulls on the pier, and talk "
    "with the other fishermen about the weather, the price of fish at the market, and the stories of "
    "storms that their fathers and grandfathers used to tell on long winter evenings. One day he saw",
]


def _hf_greedy(model, ids: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=2,
                             pad_token_id=2)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def hf_reference(hf_base, hf_tokenizer):
    """Greedy continuations from transformers, one prompt at a time (no padding involved)."""
    return {p: _hf_greedy(hf_base, hf_tokenizer(p).input_ids) for p in PROMPTS}


def _check(llm, refs, check_no_blocks):
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    assert [o.prompt for o in outs] == PROMPTS
    for o in outs:
        assert o.outputs[0].token_ids == refs[o.prompt], o.prompt
        finish = "stop" if refs[o.prompt][-1] == 2 and len(refs[o.prompt]) < MAX_TOKENS else "length"
        assert o.outputs[0].finish_reason == finish
    check_no_blocks(llm.llm_engine)
    return outs


@pytest.mark.slow
@pytest.mark.parametrize("engine_args", [
    dict(),
    dict(enable_prefix_caching=False),
    dict(max_num_batched_tokens=32),
    dict(num_gpu_blocks_override=14, max_num_batched_tokens=64),
    dict(num_gpu_blocks_override=14, max_num_batched_tokens=64, scheduler="priority"),
    dict(num_gpu_blocks_override=14, max_num_batched_tokens=64, scheduler="priority",
         plugins={"priority": {"preemption_mode": "swap"}}, swap_space=0.05),
], ids=["default", "no-prefix-cache", "chunked-32", "tiny-pool-preempt", "priority-recompute", "priority-swap"])
def test_greedy_matches_transformers(hf_reference, check_no_blocks, engine_args, request):
    # the default settings are the shared default engine's (a 0.5 GiB pool, not the 4 GiB CPU default: CI memory)
    llm = LLM(device="cpu", kv_cache_memory_gib=0.5, **engine_args) if engine_args \
        else request.getfixturevalue("default_llm")
    _check(llm, hf_reference, check_no_blocks)
    stats = llm.llm_engine.get_stats()
    if "num_gpu_blocks_override" in engine_args:
        assert stats["num_preemptions"] > 0
        swapping = "swap_space" in engine_args
        assert (stats["num_preemptions_swap"] > 0) == swapping
        assert (stats["num_swapped_out_blocks"] > 0) == swapping and stats["num_swapped"] == 0
    if engine_args.get("enable_prefix_caching", True) and "num_gpu_blocks_override" not in engine_args:
        # two prompts share a 26-token prefix (one full block)... and a later rerun hits everything
        outs = llm.generate(PROMPTS[3], SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
        assert outs[0].outputs[0].token_ids == hf_reference[PROMPTS[3]]
        assert outs[0].num_cached_tokens >= 16
    if "max_num_batched_tokens" in engine_args and "num_gpu_blocks_override" not in engine_args:
        assert max(len(llm.get_tokenizer().encode(p)) for p in PROMPTS) > 32  # chunking really happened


@pytest.mark.slow
def test_shared_64_token_prefix_hits_cache(default_llm, hf_base, check_no_blocks):
    llm = default_llm
    tok = llm.get_tokenizer()
    first = tok.encode(PROMPTS[7])
    assert len(first) >= 64
    second = first[:64] + tok.encode(" a whale jumping out of the water and")
    llm.generate([first], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    before = llm.llm_engine.get_stats()["prefix_cache_hits"]
    out = llm.generate([second], SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)[0]
    assert llm.llm_engine.get_stats()["prefix_cache_hits"] - before == 64
    assert out.num_cached_tokens == 64
    assert out.outputs[0].token_ids == _hf_greedy(hf_base, second)
    check_no_blocks(llm.llm_engine)


@pytest.mark.slow
def test_logprobs_are_log_softmax_of_transformers_logits(default_llm, hf_base):
    out = default_llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=8, logprobs=5, prompt_logprobs=2),
                               use_tqdm=False)[0]
    assert out.num_cached_tokens == 0  # (a prompt shorter than a block: the shared engine computes all of it)
    ids = out.prompt_token_ids + out.outputs[0].token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf_base(torch.tensor([ids])).logits[0].float(), dim=-1)
    n_prompt = len(out.prompt_token_ids)
    for i, (tok, lps) in enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs)):
        row = ref[n_prompt - 1 + i]
        assert lps[tok].logprob == pytest.approx(row[tok].item(), abs=1e-3)
        top = row.topk(5)
        assert sorted(lps) == sorted(top.indices.tolist())
    for pos in range(1, n_prompt):
        entry = out.prompt_logprobs[pos]
        tok = ids[pos]
        assert entry[tok].logprob == pytest.approx(ref[pos - 1, tok].item(), abs=1e-3)
