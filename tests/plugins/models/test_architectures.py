"""Every built-in architecture against transformers ``generate``: a tiny random model of each, saved by
transformers and loaded by kvforge, gives the same greedy tokens for every prompt (float32, CPU), with
prefix caching, chunked prefill and preemption all happening, and prompts longer than the window of
the sliding-window models."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvforge import LLM, SamplingParams
from kvforge.rank.cuda_graphs import uniform_layout
from kvforge.rank.model_build import hidden_states
from kvforge.rank.piecewise_graphs import PiecewiseUnsafe, cut_forward
from model_architectures import CONFIGS, VOCAB, WINDOW, build

MAX_TOKENS = 20


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(0, VOCAB, (36,), generator=g).tolist()  # two full blocks of 16 shared
    tails = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (9, 21)]
    others = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (5, 47, 70)]
    prompts = [shared + tails[0], shared + tails[1], *others]
    assert max(len(p) for p in prompts) > 2 * WINDOW
    return prompts


PROMPTS = _prompts()


@pytest.fixture(scope="module", params=list(CONFIGS))
def arch(request, tmp_path_factory):
    """(test id, saved model directory, transformers' greedy continuations)."""
    path = str(tmp_path_factory.mktemp(request.param))
    hf = build(request.param, path)
    return request.param, path, [greedy(hf, p, MAX_TOKENS) for p in PROMPTS]


@torch.no_grad()
def greedy(hf, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation, one whole forward per token (no KV cache).

    NOTE: not ``generate``: on these random models it picked a token other than the forward's argmax
    (logit gap 0.05) after a run of repeats, with and without its cache; the argmax of the model's own
    forward is the definition both engines implement."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_greedy_tokens_equal_transformers_with_caching_chunking_and_preemption(arch, check_no_blocks):
    test_id, path, refs = arch
    # 16-token blocks, 32-token chunks, a pool too small for every prompt at once
    llm = LLM(model=path, device="cpu", dtype="float32", block_size=16, max_num_batched_tokens=32,
              num_gpu_blocks_override=12, enable_prefix_caching=True)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for i, (o, ref) in enumerate(zip(outs, refs)):
        assert o.outputs[0].token_ids == ref, f"{test_id}: prompt {i}"
    stats = llm.llm_engine.get_stats()
    assert stats["prefix_cache_hits"] >= 32, stats  # the second prompt reused the first one's two blocks
    if llm.llm_engine.kv_cache.sliding_window is None:
        assert stats["num_preemptions"] > 0, stats
    check_no_blocks(llm.llm_engine)
    # run again: everything a prompt shares with the first run comes from the prefix cache
    again = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == refs[:2]
    check_no_blocks(llm.llm_engine)


@torch.inference_mode()
def test_the_forward_cut_at_attention_gives_the_eager_hidden_states_unless_it_reads_metadata(arch):
    # What piecewise CUDA graphs capture (kvforge.rank.piecewise_graphs): the forward with every attention
    # call handed out and the metadata sealed. Each family's cut forward must compute exactly the eager
    # hidden states with one cut per layer; LongRoPE reads the sequence lengths to pick its table, so its
    # cut must refuse (and its mixed steps stay eager) rather than bake one step's lengths into a graph.
    test_id, path, _ = arch
    llm = LLM(model=path, device="cpu", dtype="float32", block_size=16, num_gpu_blocks_override=8)
    worker = llm.llm_engine.runner.worker
    model, attn, caches = worker.model, worker.attn, worker.kv_caches
    T = len(PROMPTS[4])  # 70 tokens: past the sliding windows
    ids, pos = torch.tensor(PROMPTS[4]), torch.arange(T)
    layout = uniform_layout(1, T, 8, seq_lens=np.array([T], dtype=np.int32),
                            block_tables=np.arange(8, dtype=np.int32)[None], slots=np.arange(T, dtype=np.int64))
    meta = attn.build_metadata(layout)
    eager = hidden_states(model(ids, pos, caches, meta)).clone()
    layers = []

    def attend(q, k, v, cache, layer):
        layers.append(layer)
        return type(attn).forward(attn, q, k, v, cache, meta, layer)

    if test_id.startswith("phi"):
        with pytest.raises(PiecewiseUnsafe, match="query_start_loc|seq_lens"):
            cut_forward(model, attn, caches, ids, pos, attend)
    else:
        assert torch.equal(cut_forward(model, attn, caches, ids, pos, attend), eager)
        assert len(layers) == worker.num_layers
        assert len({id(c) for c in caches}) == len(caches)
    assert "forward" not in vars(attn)  # the backend's own forward again


@torch.inference_mode()
def test_captured_hidden_states_are_transformers_output_hidden_states(arch):
    # The hook EAGLE heads read (kvforge.model.hidden_capture): every family writes, for ids 0..L, exactly
    # transformers' output_hidden_states (embeddings, each layer's output, the final normed states)
    import transformers

    from kvforge.model.hidden_capture import HiddenStateCapture, install

    test_id, path, _ = arch
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.config._attn_implementation = "eager"
    llm = LLM(model=path, device="cpu", dtype="float32", block_size=16, num_gpu_blocks_override=8)
    worker = llm.llm_engine.runner.worker
    model, attn, caches = worker.model, worker.attn, worker.kv_caches
    L, h = hf.config.num_hidden_layers, hf.config.hidden_size
    T = len(PROMPTS[4])
    capture = HiddenStateCapture(range(L + 1), num_layers=L, hidden_size=h, max_tokens=T + 8, dtype=torch.float32,
                                 device="cpu")
    install(model, capture)
    layout = uniform_layout(1, T, 8, seq_lens=np.array([T], dtype=np.int32),
                            block_tables=np.arange(8, dtype=np.int32)[None], slots=np.arange(T, dtype=np.int64))
    try:
        out = hidden_states(model(torch.tensor(PROMPTS[4]), torch.arange(T), caches, attn.build_metadata(layout)))
    finally:
        install(model, None)
    ref = hf(torch.tensor([PROMPTS[4]]), output_hidden_states=True).hidden_states
    assert len(ref) == L + 1
    got = capture.rows(T)
    for i in range(L + 1):
        torch.testing.assert_close(got[:, i * h:(i + 1) * h], ref[i][0], atol=2e-4, rtol=2e-4,
                                   msg=lambda m, i=i: f"{test_id}: layer id {i}: {m}")
    assert torch.equal(got[:, L * h:], out)  # id L is what the forward returns
    assert model.model.capture is None  # uninstalled: later forwards write nothing


@pytest.mark.parametrize("test_id,parallel", [
    ("gpt-oss", dict(tensor_parallel_size=2)),  # experts, sinks, biases split over two gloo ranks
    ("qwen2-moe", dict(tensor_parallel_size=2)),  # shared expert and a dense layer too
    ("gemma3", dict(pipeline_parallel_size=2)),  # Gemma's stages hand over their hidden states
])
def test_split_over_two_ranks_the_tokens_stay_transformers(test_id, parallel, tmp_path, check_no_blocks):
    hf = build(test_id, str(tmp_path))
    prompts = PROMPTS[1:4]
    llm = LLM(model=str(tmp_path), device="cpu", dtype="float32", block_size=16, max_num_batched_tokens=32,
              num_gpu_blocks_override=24, **parallel)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
        assert llm.llm_engine.executor.world_size == 2
        assert [o.outputs[0].token_ids for o in outs] == [greedy(hf, p, 12) for p in prompts]
        check_no_blocks(llm.llm_engine)
    finally:
        llm.shutdown()


def test_quantizing_an_moe_model_is_refused_naming_the_method(tmp_path):
    build("mixtral", str(tmp_path))  # int4 has no moe_method (fp8 and mxfp4 do: tests/plugins/quantization)
    with pytest.raises(ValueError, match="quantization 'int4' does not support mixture-of-experts layers"):
        LLM(model=str(tmp_path), device="cpu", dtype="float32", quantization="int4")
