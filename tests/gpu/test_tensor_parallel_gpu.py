"""Tensor parallelism over NCCL on two GPUs (the nvidia-h200-x2 machine): the real default model gives
the same greedy tokens with two ranks as with one, with CUDA graphs replayed under TP."""
import pytest
import torch

from kvforge import LLM, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (nvidia-h200-x2)")]

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Hello, my name is", "1, 2, 3, 4, 5,",
           "The quick brown fox", "Once upon a time, in a small village by the sea,",
           "Water boils at", "The best way to learn a language is"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tp2_equals_tp1_on_cuda_with_graphs(dtype, check_no_blocks):
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    common = dict(device="cuda", dtype=dtype, gpu_memory_utilization=0.3, max_model_len=1024)
    one = LLM(**common)
    ref = [o.outputs[0].token_ids for o in one.generate(PROMPTS, params, use_tqdm=False)]
    del one
    two = LLM(tensor_parallel_size=2, **common)
    try:
        got = [o.outputs[0].token_ids for o in two.generate(PROMPTS, params, use_tqdm=False)]
        graphs = two.llm_engine.runner.graphs
        assert graphs is not None and sum(graphs.replays.values()) > 0  # decode steps replayed graphs under TP
        same = sum(a == b for a, b in zip(got, ref))
        if dtype == "float32":
            assert got == ref
        else:  # bf16: a different reduction order may flip a near-tie late in a sequence
            assert same >= 6 and all(a[:8] == b[:8] for a, b in zip(got, ref)), (got, ref)
        check_no_blocks(two.llm_engine)
    finally:
        two.shutdown()
