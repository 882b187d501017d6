"""A quantization format brought by a third-party package (the dummy plugin's ``dummy_int8``, weight-only
int8 with a scale per output channel), selected by a config file with its own options: the engine runs
the contract's steps on it, and its greedy tokens stay those of the float32 model. The same package
loads a pre-quantized ``dummy_int8`` checkpoint (``checkpoint_formats``, ``layer.make_param``)."""
from __future__ import annotations

import torch

from kvforge import LLM, SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Hello, my name is", "1, 2, 3, 4, 5,"]


def test_third_party_quantization_method_selected_by_config_file(dummy_plugin_installed, default_llm, tmp_path):
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
    ref = [o.outputs[0].token_ids for o in default_llm.generate(PROMPTS, params, use_tqdm=False)]  # float32
    assert sum(a[:8] == b[:8] for a, b in zip(got, ref)) >= 3  # int8 weights: near-lossless


def test_third_party_pre_quantized_checkpoint_loads_as_its_on_load_twin(dummy_plugin_installed, tmp_path):
    """A checkpoint whose config.json says ``"quant_method": "dummy_int8"`` selects the plugin by itself
    and gives exactly the logits of the same int8 values quantized on load."""
    import json

    from safetensors.torch import save_file

    from kvforge.model.loader import default_model_path, iter_weights, load_model_config, resolve_model_source

    src = resolve_model_source(None)
    tensors = {}
    for name, w in iter_weights(src):
        if name.endswith("_proj.weight"):  # the plugin's quantization, written out
            scale = (w.abs().amax(dim=1, keepdim=True) / 127).clamp(min=1e-12)
            tensors[name] = (w / scale).round().clamp(-127, 127).to(torch.int8)
            tensors[name.removesuffix("weight") + "weight_scale"] = scale
        else:
            tensors[name] = w.contiguous()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    hf = load_model_config(src).to_hf_dict() | {"quantization_config": {"quant_method": "dummy_int8"}}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    engine = dict(device="cpu", max_model_len=256, num_gpu_blocks_override=64)
    stored = LLM(str(tmp_path), tokenizer=default_model_path(), **engine)
    assert stored.llm_engine.config.quantization == "dummy_int8"
    assert stored.llm_engine.executor.driver.model.model.layers[0].mlp.down_proj.weight.dtype == torch.int8
    on_load = LLM(quantization="dummy_int8", **engine)
    params = SamplingParams(max_tokens=1, prompt_logprobs=5)
    ids = [{"prompt_token_ids": list(range(1, 40))}]
    a = stored.generate(ids, params, use_tqdm=False)[0].prompt_logprobs[1:]
    b = on_load.generate(ids, params, use_tqdm=False)[0].prompt_logprobs[1:]
    assert [{t: lp.logprob for t, lp in pos.items()} for pos in a] == [{t: lp.logprob for t, lp in pos.items()} for pos in b]


def test_third_party_quantized_experts_through_moe_method(dummy_plugin_installed, tmp_path):
    """The plugin's ``moe_method`` holds a Qwen3-MoE's experts in int8 (the contract: create, process, apply),
    and its log-probabilities stay within int8's rounding of the float32 model's."""
    from kvforge_dummy_plugin.components import Int8WeightOnly

    from model_architectures import build

    build("qwen3-moe", str(tmp_path))
    engine = dict(device="cpu", dtype="float32", num_gpu_blocks_override=16)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    prompts = [{"prompt_token_ids": [3, 14, 15, 92, 65]}, {"prompt_token_ids": [27, 18, 28]}]
    ref = LLM(model=str(tmp_path), **engine)
    try:
        want = ref.generate(prompts, params, use_tqdm=False)
    finally:
        ref.shutdown()
    llm = LLM(model=str(tmp_path), quantization="dummy_int8", **engine)
    try:
        experts = llm.llm_engine.executor.driver.model.model.layers[0].mlp.experts
        assert experts.w13.dtype == torch.int8 and experts.w2_scale.shape == (4, 64, 1)
        applied = Int8WeightOnly.applied
        got = llm.generate(prompts, params, use_tqdm=False)
        assert Int8WeightOnly.applied - applied >= 8 * 2  # every step's experts, both layers
    finally:
        llm.shutdown()
    for g, w in zip(got, want):
        ours, theirs = g.outputs[0], w.outputs[0]
        assert ours.token_ids[:4] == theirs.token_ids[:4]
        steps = zip(ours.logprobs[:4], theirs.logprobs[:4], theirs.token_ids[:4])
        assert max(abs(a[t].logprob - b[t].logprob) for a, b, t in steps) < 0.02
