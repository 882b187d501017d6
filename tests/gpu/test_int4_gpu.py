"""INT4 checkpoints on the GPU: the default model saved as AWQ and GPTQ (groups of 64) runs through the
Triton W4A16 GEMM, with CUDA graphs giving the eager run's tokens, and agrees with the CPU's
dequantize-then-matmul reference of the same checkpoint on the teacher-forced greedy tokens."""
import pytest
import torch

from kvforge import LLM, SamplingParams
from kvforge.model.loader import default_model_path
from quantization_accuracy import reference_greedy, top1_agreement
from quantized_checkpoints import write_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,"]


@pytest.mark.parametrize("fmt", ["awq", "gptq"])
def test_int4_checkpoint_with_graphs_equals_eager_and_agrees_with_the_cpu_reference(fmt, tmp_path):
    path = write_checkpoint(str(tmp_path / fmt), fmt, group=64)
    kw = dict(tokenizer=default_model_path(), device="cuda", max_model_len=256, kv_cache_memory_gib=1)
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    graphs = LLM(path, **kw)
    layer = graphs.llm_engine.executor.driver.model.model.layers[0].mlp.down_proj
    assert layer.qweight.dtype == torch.int32 and layer.qweight.is_cuda and not hasattr(layer, "weight")
    got = [o.outputs[0].token_ids for o in graphs.generate(PROMPTS, greedy, use_tqdm=False)]
    cpu = LLM(path, tokenizer=default_model_path(), device="cpu", max_model_len=256, num_gpu_blocks_override=64)
    # bf16 on the GPU against float32 on the CPU, same int4 weights: near-ties may flip
    share = top1_agreement(graphs, reference_greedy(cpu))
    del graphs
    eager = LLM(path, enforce_eager=True, **kw)
    assert [o.outputs[0].token_ids for o in eager.generate(PROMPTS, greedy, use_tqdm=False)] == got
    print(f"{fmt}: GPU bf16 vs CPU float32 teacher-forced agreement {share:.3f}")
    assert share >= 0.9
