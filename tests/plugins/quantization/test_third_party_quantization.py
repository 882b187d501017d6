"""A quantization format brought by a third-party package (the dummy plugin's ``dummy_int8``, weight-only
int8 with a scale per output channel), selected by a config file with its own options: the engine runs
the contract's steps on it, and its greedy tokens stay those of the float32 model."""
from __future__ import annotations

import torch

from kvforge import LLM, SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Hello, my name is", "1, 2, 3, 4, 5,"]


def test_third_party_quantization_method_selected_by_config_file(dummy_plugin_installed, tmp_path):
    from kvforge_dummy_plugin.components import Int8WeightOnly

    cfg = tmp_path / "kvforge.toml"
    cfg.write_text('device = "cpu"\nmax_model_len = 256\nnum_gpu_blocks_override = 64\nquantization = "dummy_int8"\n'
                   '[plugins.dummy_int8]\nskip = "RowParallelLinear"\n')
    processed = Int8WeightOnly.processed
    llm = LLM(config=str(cfg))
    model = llm.llm_engine.executor.driver.model
    layers = model.model.layers
    # the column-parallel layers (QKV, gate/up) are int8; the skipped row-parallel ones keep float32
    assert layers[0].self_attn.qkv_proj.weight.dtype == torch.int8 and layers[0].mlp.down_proj.quant_method is None
    assert layers[0].mlp.down_proj.weight.dtype == torch.float32
    assert Int8WeightOnly.processed - processed == 2 * len(layers)
    applied = Int8WeightOnly.applied
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert Int8WeightOnly.applied - applied >= 16 * 2 * len(layers)  # every step went through apply()
    ref = [o.outputs[0].token_ids for o in LLM(device="cpu", max_model_len=256, num_gpu_blocks_override=64)
           .generate(PROMPTS, params, use_tqdm=False)]
    assert sum(a[:8] == b[:8] for a, b in zip(got, ref)) >= 3  # int8 weights: near-lossless
