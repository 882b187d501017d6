"""RoPE variants (kvforge.layers.rotary) against transformers' own: the same inverse frequencies and
attention factor for every variant both compute, selected by the config's rope_scaling data."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from kvforge.layers.rotary import ROPE_VARIANTS, RotaryCache, rope_attention_factor, rope_inv_freq
from kvforge.model.config import ModelConfig

_BASE = dict(vocab_size=64, hidden_size=128, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=1, head_dim=64, max_position_embeddings=1024)

#: id -> (rope_parameters, transformers' seq_len for the variant that depends on it)
VARIANTS = {
    "linear": ({"rope_type": "linear", "factor": 4.0}, None),
    "llama3": ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 128}, None),
    "yarn": ({"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
              "original_max_position_embeddings": 128}, None),
    "yarn-mscale": ({"rope_type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 0.5,
                     "original_max_position_embeddings": 256}, None),
    "longrope-short": ({"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(32)],
                        "long_factor": [2.0 + 0.5 * i for i in range(32)], "original_max_position_embeddings": 256},
                       100),
    "longrope-long": ({"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(32)],
                       "long_factor": [2.0 + 0.5 * i for i in range(32)], "original_max_position_embeddings": 256},
                      1000),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variant_equals_transformers(variant):
    params, seq_len = VARIANTS[variant]
    hf = transformers.LlamaConfig(**_BASE, rope_parameters={**params, "rope_theta": 10000.0})
    ref_inv_freq, ref_factor = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf, torch.device("cpu"), seq_len=seq_len)
    config = ModelConfig.from_hf_dict({**_BASE, "model_type": "llama", "rope_theta": 10000.0, "rope_scaling": params})
    long = seq_len is not None and seq_len > params["original_max_position_embeddings"]
    torch.testing.assert_close(rope_inv_freq(config, long=long), ref_inv_freq.float(), rtol=1e-6, atol=0)
    assert rope_attention_factor(config) == pytest.approx(ref_factor, rel=1e-9)


def test_default_and_unknown_variants():
    config = ModelConfig.from_preset("tiny")
    assert torch.equal(rope_inv_freq(config), 1.0 / 10000.0 ** (torch.arange(0, 16, 2).float() / 16))
    assert set(ROPE_VARIANTS) == {"default", "linear", "llama3", "yarn", "longrope", "freq_factors"}
    dynamic = ModelConfig(**{**config.to_dict(), "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})
    with pytest.raises(ValueError, match="rope_type 'dynamic'; supported: default, linear"):
        rope_inv_freq(dynamic)


def test_longrope_cache_holds_both_tables_and_switches_on_the_sequence_length():
    params = VARIANTS["longrope-long"][0]
    config = ModelConfig.from_hf_dict({**_BASE, "model_type": "llama", "rope_scaling": params})
    cache = RotaryCache(config)
    assert cache.cos.shape == (2 * 1024, 64)  # short-factor rows, then long-factor rows
    positions = torch.tensor([0, 1, 255, 256])  # the last two tokens of a 300-token sequence, two of a short one
    meta = SimpleNamespace(query_start_loc=torch.tensor([0, 2, 4]), seq_lens=torch.tensor([2, 300]))
    assert cache.rows(positions, meta).tolist() == [0, 1, 255 + 1024, 256 + 1024]
