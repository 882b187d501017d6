"""The engine on a CUDA device (run on the GPU machine: python -m pytest -m gpu)."""
import os

import pytest
import torch

from kvforge import LLM, SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Hello, my name is", "1, 2, 3, 4, 5,",
           "The quick brown fox", "Once upon a time, in a small village by the sea,",
           "Water boils at", "The best way to learn a language is"]


def test_default_model_fp32_on_cuda_matches_transformers(default_model_path, check_no_blocks):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, name = os.path.split(default_model_path)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32).cuda().eval()
    llm = LLM(device="cuda", dtype="float32", attention_backend="torch", gpu_memory_utilization=0.3)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    for p, o in zip(PROMPTS, outs):
        ids = tok(p, return_tensors="pt").input_ids.cuda()
        with torch.no_grad():
            ref = model.generate(ids, max_new_tokens=32, do_sample=False, eos_token_id=2, pad_token_id=2)
        assert o.outputs[0].token_ids == ref[0, ids.shape[1]:].tolist(), p
    check_no_blocks(llm.llm_engine)


def test_default_model_bf16_runs(check_no_blocks):
    llm = LLM(device="cuda", dtype="bfloat16", attention_backend="torch", gpu_memory_utilization=0.3)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 16 for o in outs)
    assert "Paris" in outs[0].outputs[0].text
    check_no_blocks(llm.llm_engine)


def test_dummy_llama_1b_bf16_preempts_and_still_finishes_every_request(check_no_blocks):
    """bf16 on CUDA: batching changes rounding, so tokens are not compared here (the CPU float32
    test_greedy_matches_transformers[tiny-pool-preempt] checks tokens under preemption)."""
    llm = LLM("dummy:llama-3.2-1b", device="cuda", attention_backend="torch", num_gpu_blocks_override=64,
              max_num_batched_tokens=512)
    prompts = torch.randint(100, 120000, (16, 100)).tolist()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    assert len(outs) == 16 and all(len(o.outputs[0].token_ids) == 40 for o in outs)
    assert llm.llm_engine.get_stats()["num_preemptions"] > 0
    check_no_blocks(llm.llm_engine)


def test_async_scheduling_matches_sync_on_cuda(check_no_blocks):
    """Same batches (EOS ignored, so no step differs), same kernels: the same tokens, bit for bit."""
    prompts = torch.randint(100, 40000, (24, 48), generator=torch.Generator().manual_seed(1)).tolist()
    p = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kw = dict(device="cuda", dtype="bfloat16", attention_backend="triton", gpu_memory_utilization=0.3)
    on = LLM(**kw)
    got = [o.outputs[0].token_ids for o in on.generate(prompts, p, use_tqdm=False)]
    check_no_blocks(on.llm_engine)
    del on
    import gc
    gc.collect()
    torch.cuda.empty_cache()
    off = LLM(async_scheduling=False, **kw)
    assert got == [o.outputs[0].token_ids for o in off.generate(prompts, p, use_tqdm=False)]


def test_fused_ops_match_torch_path_fp32(monkeypatch):
    """The fused RMSNorm/RoPE/SiLU kernels against the plain torch ops on the default model in float32
    (eager both ways): the same greedy tokens, log-probabilities equal to float noise."""
    from kvforge.plugins.models import fused_ops

    p = SamplingParams(temperature=0, max_tokens=24, logprobs=1, ignore_eos=True)
    llm = LLM(device="cuda", dtype="float32", attention_backend="triton", gpu_memory_utilization=0.3,
              enforce_eager=True)  # a captured graph would keep the fused kernels
    fused = [o.outputs[0] for o in llm.generate(PROMPTS, p, use_tqdm=False)]
    monkeypatch.setattr(fused_ops, "use_fused", lambda x: False)
    plain = [o.outputs[0] for o in llm.generate(PROMPTS, p, use_tqdm=False)]
    worst = 0.0
    for f, e in zip(fused, plain):
        assert f.token_ids == e.token_ids
        for lf, le, t in zip(f.logprobs, e.logprobs, e.token_ids):
            worst = max(worst, abs(lf[t].logprob - le[t].logprob))
    print(f"fused vs torch ops (fp32): largest log-probability difference {worst:.2e}")
    assert worst < 1e-3


@pytest.mark.gpu
def test_an_explicit_device_index_runs_there_from_the_engine_thread():
    """device="cuda:N" (the last device): the engine thread binds it, so its streams, events, Triton
    kernels and graphs live there, and the tokens equal a run on the same device from this thread."""
    import asyncio

    from kvforge.config import EngineConfig
    from kvforge.engine.async_engine import AsyncLLMEngine

    dev = f"cuda:{torch.cuda.device_count() - 1}"
    llm = LLM("dummy:tiny", device=dev, dtype="float32", max_model_len=256, num_gpu_blocks_override=64)
    assert next(llm.llm_engine.runner.model.parameters()).device == torch.device(dev)
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    direct = llm.generate([[5, 6, 7, 8]], p, use_tqdm=False)[0].outputs[0].token_ids
    engine = AsyncLLMEngine.from_config(EngineConfig(model="dummy:tiny", device=dev, dtype="float32",
                                                     max_model_len=256, num_gpu_blocks_override=64))
    engine.start()

    async def run():
        toks = []
        async for out in engine.generate([5, 6, 7, 8], p, "r0"):
            toks += out.outputs[0].token_ids
        return toks

    try:
        assert asyncio.run(run()) == direct
        assert engine.error is None
    finally:
        engine.shutdown()
