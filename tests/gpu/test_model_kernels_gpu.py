"""The model plugins' fused kernels inside whole models on the GPU: Qwen3-MoE (per-head q/k norm, the
one-kernel softmax routing), Gemma 3 (Gemma's ``1 + w`` norms, its q/k norms) and gpt-oss (top-k-then-
softmax routing) at their real widths (two layers, a small vocabulary, random float32 weights), eager,
against the same engine with every fused path off (torch ops): the same greedy tokens, log-probabilities
equal to float noise."""
import dataclasses
import json

import pytest
import torch

from kvforge import LLM, SamplingParams
from kvforge.model.config import ModelConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPTS = [[11, 503, 77, 9, 1200, 41], [3, 3, 3, 8, 900], [2000, 14, 15, 16, 17, 18, 19, 20, 21]]


def shrunk(preset: str, path) -> str:
    mc = ModelConfig.from_preset(preset)
    layer_types = list(mc.layer_types[-2:]) if mc.layer_types else None  # one sliding and one global layer
    mc = dataclasses.replace(mc, num_hidden_layers=2, vocab_size=4096, layer_types=layer_types, bos_token_id=1,
                             eos_token_ids=[2], max_position_embeddings=4096)
    path.mkdir()
    (path / "config.json").write_text(json.dumps(mc.to_hf_dict() | {"torch_dtype": "float32"}))
    return str(path)


@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "gemma-3-27b", "gpt-oss-20b"])
def test_fused_model_kernels_match_the_torch_ops(preset, tmp_path, monkeypatch):
    from kvforge.layers import fused_moe
    from kvforge.plugins.models import fused_ops

    llm = LLM(shrunk(preset, tmp_path / preset), load_format="dummy", device="cuda", dtype="float32",
              enforce_eager=True, gpu_memory_utilization=0.3, max_model_len=512)
    p = SamplingParams(temperature=0, max_tokens=16, logprobs=1, ignore_eos=True)
    fused = [o.outputs[0] for o in llm.generate(PROMPTS, p, use_tqdm=False)]
    monkeypatch.setattr(fused_ops, "use_fused", lambda x: False)
    monkeypatch.setattr(fused_moe, "use_triton", lambda x: False)
    plain = [o.outputs[0] for o in llm.generate(PROMPTS, p, use_tqdm=False)]
    worst = 0.0
    for f, e in zip(fused, plain):
        assert f.token_ids == e.token_ids
        for lf, le, t in zip(f.logprobs, e.logprobs, e.token_ids):
            worst = max(worst, abs(lf[t].logprob - le[t].logprob))
    print(f"{preset}: fused vs torch ops (fp32), largest log-probability difference {worst:.2e}")
    assert worst < 1e-3
