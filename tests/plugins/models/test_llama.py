"""The built-in Llama-family model against transformers: same weights (saved by transformers and loaded
by kvforge), same logits, through a paged KV cache with batched prefill, decode and chunked prefill."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from kvforge.attention import BatchLayout
from kvforge.model.config import ModelConfig
from kvforge.model.loader import iter_weights, load_model, load_model_config, resolve_model_source
from kvforge.plugins.attention.torch_backend import TorchAttentionBackend

BLOCK_SIZE = 16
NUM_BLOCKS = 8
VOCAB = 256

_BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
             rope_theta=10000.0, max_position_embeddings=256, bos_token_id=1, eos_token_ids=[2])

CONFIGS = {
    "llama": ModelConfig(architecture="LlamaForCausalLM", model_type="llama", **_BASE,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    "qwen2": ModelConfig(architecture="Qwen2ForCausalLM", model_type="qwen2", tie_word_embeddings=True,
                         attention_bias=True, **_BASE),
    "qwen3": ModelConfig(architecture="Qwen3ForCausalLM", model_type="qwen3", tie_word_embeddings=True,
                         qk_norm=True, **{**_BASE, "head_dim": 32}),
    "mistral": ModelConfig(architecture="MistralForCausalLM", model_type="mistral",
                           **{**_BASE, "num_key_value_heads": 1}),
}


def make_layout(seqs: list[tuple[list[int], int, int]]) -> tuple[BatchLayout, torch.Tensor]:
    """seqs: (block ids, cached tokens, new tokens) per sequence -> (layout, positions [num_tokens])."""
    new = [n for _, _, n in seqs]
    max_blocks = max(len(b) for b, _, _ in seqs)
    positions = np.concatenate([np.arange(c, c + n) for _, c, n in seqs])
    slots = np.concatenate([[b[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(c, c + n)]
                            for b, c, n in seqs])
    layout = BatchLayout(
        query_start_loc=np.concatenate([[0], np.cumsum(new)]).astype(np.int32),
        seq_lens=np.array([c + n for _, c, n in seqs], dtype=np.int32),
        block_tables=np.array([b + [0] * (max_blocks - len(b)) for b, _, _ in seqs], dtype=np.int32),
        slot_mapping=slots.astype(np.int64),
    )
    return layout, torch.from_numpy(positions.astype(np.int64))


class Runner:
    """A kvforge model, its attention backend and a fresh KV cache."""

    def __init__(self, model_dir: str):
        src = self.src = resolve_model_source(model_dir)
        self.config = load_model_config(src)
        c = self.config
        self.attn = TorchAttentionBackend(num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads,
                                          head_size=c.head_dim, scale=c.head_dim ** -0.5, block_size=BLOCK_SIZE,
                                          dtype=torch.float32, device=torch.device("cpu"))
        self.model = load_model(src, c, self.attn, torch.float32, torch.device("cpu"))
        self.kv_caches = self.attn.allocate_kv_cache(NUM_BLOCKS, c.num_hidden_layers)

    @torch.no_grad()
    def step(self, seqs: list[tuple[list[int], int, list[int]]]) -> torch.Tensor:
        """seqs: (block ids, cached tokens, new token ids) -> logits [num_new_tokens, vocab]."""
        layout, positions = make_layout([(b, c, len(t)) for b, c, t in seqs])
        input_ids = torch.tensor([t for _, _, toks in seqs for t in toks], dtype=torch.long)
        meta = self.attn.build_metadata(layout)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        return self.model.compute_logits(hidden)


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory):
    """(transformers model, kvforge runner factory, config) with the same random weights."""
    config = CONFIGS[request.param]
    hf_config = transformers.AutoConfig.for_model(**config.to_hf_dict())
    hf_config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config).float().eval()
    with torch.no_grad():  # HF inits norms to 1 and biases to 0: perturb everything so all of it is tested
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path, safe_serialization=True)
    return hf, (lambda: Runner(str(path))), config


@torch.no_grad()
def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    return hf(input_ids=torch.tensor([tokens])).logits[0].float()  # [len, vocab]


def test_config_round_trips_through_transformers(pair):
    _, make_runner, config = pair
    loaded = make_runner().config
    assert loaded == ModelConfig(**{**config.to_dict(), "torch_dtype": loaded.torch_dtype})


def test_prefill_then_decode_matches_transformers(pair):
    hf, make_runner, _ = pair
    runner = make_runner()
    gen = torch.Generator().manual_seed(1)
    a = torch.randint(3, VOCAB, (19,), generator=gen).tolist()  # spans two blocks
    b = torch.randint(3, VOCAB, (5,), generator=gen).tolist()
    # two prompts prefilled together, in non-contiguous blocks
    logits = runner.step([([3, 1], 0, a), ([2], 0, b)])
    ref = torch.cat([hf_logits(hf, a), hf_logits(hf, b)])
    assert ref.std() > 0.1  # the comparison is not between near-zero numbers
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
    # one decode step for both
    na, nb = 7, 11
    logits = runner.step([([3, 1], len(a), [na]), ([2], len(b), [nb])])
    ref = torch.stack([hf_logits(hf, a + [na])[-1], hf_logits(hf, b + [nb])[-1]])
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)


def test_chunked_prefill_matches_unchunked(pair):
    hf, make_runner, _ = pair
    prompt = torch.randint(3, VOCAB, (20,), generator=torch.Generator().manual_seed(2)).tolist()
    whole = make_runner().step([([5, 0], 0, prompt)])
    runner = make_runner()
    first = runner.step([([0, 4], 0, prompt[:12])])
    second = runner.step([([0, 4], 12, prompt[12:])])
    chunked = torch.cat([first, second])
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chunked, hf_logits(hf, prompt), atol=1e-4, rtol=1e-4)


def test_load_weights_rejects_unknown_and_missing(pair):
    _, make_runner, _ = pair
    runner = make_runner()
    model = runner.model
    with pytest.raises(ValueError, match="model.layers.0.self_attn.bogus.weight"):
        model.load_weights([("model.layers.0.self_attn.bogus.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="shape"):
        model.load_weights([("model.norm.weight", torch.zeros(3))])
    with pytest.raises(ValueError, match=r"missing 1 weight\(s\): model\.norm\.weight$"):
        model.load_weights((n, w) for n, w in iter_weights(runner.src) if n != "model.norm.weight")
    # a missing shard of a fused weight is named with its shard id
    skipped = "model.layers.1.self_attn.k_proj.weight"
    with pytest.raises(ValueError, match=r"missing 1 weight\(s\): model\.layers\.1\.self_attn\.qkv_proj\.weight\[k\]$"):
        model.load_weights((n, w) for n, w in iter_weights(runner.src) if n != skipped)


def test_unsupported_rope_type_is_a_value_error():
    from kvforge.layers.rotary import rope_inv_freq

    config = ModelConfig(**{**CONFIGS["mistral"].to_dict(), "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}})
    with pytest.raises(ValueError, match="rope_scaling.*dynamic"):
        rope_inv_freq(config)
