"""``kv_cache_dtype="fp8"``: the option, twice the blocks for the same memory, swapping, copy-on-write
and prefix caching over an FP8 cache (tiny random Llama), and accuracy on the real default model
against its GGUF weights dequantized to float32 (mean KL over a 1,000+-token text, greedy agreement
over 8 prompts x 64 tokens). Backend-level tests: tests/plugins/attention/test_fp8_kv_attention.py."""
from __future__ import annotations

import pytest
import torch

from kvforge import LLM, SamplingParams
from kvforge.config import EngineConfig
from kvforge.model.loader import load_model_config, resolve_model_source
from quantization_accuracy import mean_kl, passage_logits, top1_agreement

FP8 = torch.float8_e4m3fn
#: bounds (docs/quantization.md#fp8-kv-cache). Measured on the default model: mean KL 0.0055 nats with
#: the default scales (1.0) and 0.0056 with per-layer amax/448 scales; teacher-forced agreement 0.971.
#: Broken scales measured far outside: inverted scales (448/amax) 1.74 nats, K saturated by a 64x too
#: small scale 0.156, values 64x too small for e4m3's normal range 0.017.
MAX_MEAN_KL = 0.015
MIN_GREEDY_AGREEMENT = 0.94  # of the float32 model's 8 x 64 greedy tokens, ranked first with an FP8 cache

TINY = dict(device="cpu", max_model_len=128)
TINY_PROMPTS = [list(range(1 + 7 * i, 30 + 7 * i)) for i in range(4)]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


# -- the option ------------------------------------------------------------------------------------------
def test_option_values_aliases_and_refusals(tmp_path):
    from kvforge.cli import build_parser, engine_kwargs

    assert EngineConfig().kv_cache_dtype == "auto" and EngineConfig().torch_kv_cache_dtype == torch.float32
    assert EngineConfig(dtype="bfloat16").torch_kv_cache_dtype == torch.bfloat16  # auto: the model dtype
    assert EngineConfig(kv_cache_dtype="fp8").torch_kv_cache_dtype == FP8
    assert EngineConfig(kv_cache_dtype="fp8_e4m3").torch_kv_cache_dtype == FP8  # vLLM's alias
    for bad in ("fp8_e5m2", "int8", "bfloat16", None, 8):
        with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of auto, fp8, fp8_e4m3; got"):
            EngineConfig(kv_cache_dtype=bad)
    args = build_parser().parse_args(["generate", "hi", "--kv-cache-dtype", "fp8"])
    assert engine_kwargs(args)["kv_cache_dtype"] == "fp8"
    with pytest.raises(SystemExit):  # argparse's choices
        build_parser().parse_args(["generate", "hi", "--kv-cache-dtype", "int8"])
    (tmp_path / "c.toml").write_text('kv_cache_dtype = "fp8"\n')
    assert EngineConfig.create(tmp_path / "c.toml").kv_cache_dtype == "fp8"


def test_fp8_holds_twice_the_blocks_of_bf16_in_the_same_memory():
    bytes_bf16 = None
    counts = {}
    for kv in ("auto", "fp8"):
        llm = LLM("dummy:tiny", dtype="bfloat16", kv_cache_dtype=kv, kv_cache_memory_gib=0.01, **TINY)
        worker = llm.llm_engine.executor.driver
        counts[kv] = llm.llm_engine.num_blocks
        assert llm.llm_engine.kv_cache.stats().num_blocks == counts[kv]
        assert worker.kv_caches[0].dtype == (torch.bfloat16 if kv == "auto" else FP8)
        bytes_bf16 = bytes_bf16 or worker.bytes_per_block()
        if kv == "fp8":
            assert worker.bytes_per_block() * 2 == bytes_bf16
    budget = int(0.01 * 2 ** 30)
    assert counts == {"auto": budget // bytes_bf16, "fp8": budget // (bytes_bf16 // 2)}
    assert counts["fp8"] in (2 * counts["auto"], 2 * counts["auto"] + 1)  # the floor of twice as much


def test_explicit_backend_without_fp8_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="attention_backend 'flash_attn' cannot be used: .*kv_cache_dtype "
                                         "torch.float8_e4m3fn not supported"):
        LLM("dummy:tiny", kv_cache_dtype="fp8", attention_backend="flash_attn", num_gpu_blocks_override=16, **TINY)


# -- the cache's block operations with FP8 blocks ----------------------------------------------------------
@pytest.fixture(scope="module")
def fp8_reference():
    """Greedy n=2 outputs of an FP8 engine whose pool never runs short."""
    llm = LLM("dummy:tiny", kv_cache_dtype="fp8", num_gpu_blocks_override=256, **TINY)
    return llm.generate(TINY_PROMPTS, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, n=2),
                        use_tqdm=False)


def test_swapped_out_and_in_fp8_blocks_give_the_same_tokens(fp8_reference, check_no_blocks):
    """8 blocks of 16 for 4 requests of 2 samples growing to 4 blocks each: preempted by swapping."""
    llm = LLM("dummy:tiny", kv_cache_dtype="fp8", num_gpu_blocks_override=8, scheduler="priority", swap_space=0.01,
              plugins={"priority": {"preemption_mode": "swap"}}, **TINY)
    got = llm.generate(TINY_PROMPTS, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, n=2),
                       use_tqdm=False, priority=[1, 0, 1, 0])
    for g, w in zip(got, fp8_reference):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs]
    stats = llm.llm_engine.get_stats()
    assert stats["num_preemptions_swap"] > 0 and stats["num_swapped_out_blocks"] > 0
    assert llm.llm_engine.runner.swap_space.caches[0].dtype == FP8
    check_no_blocks(llm.llm_engine)


def test_copy_on_write_of_fp8_blocks_keeps_every_sample(fp8_reference, check_no_blocks):
    """n=2 shares the prompt's blocks; each sample's first write into the shared partial block copies it."""
    llm = LLM("dummy:tiny", kv_cache_dtype="fp8", num_gpu_blocks_override=256, **TINY)
    got = llm.generate(TINY_PROMPTS, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, n=2),
                       use_tqdm=False)
    assert llm.llm_engine.kv_cache.stats().num_cow_copies >= len(TINY_PROMPTS)
    for g, w in zip(got, fp8_reference):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs]
        assert g.outputs[0].token_ids == g.outputs[1].token_ids  # greedy: a corrupted copy would diverge
    check_no_blocks(llm.llm_engine)


def test_prefix_cache_hit_on_fp8_blocks_gives_the_uncached_tokens(check_no_blocks):
    first = list(range(200, 240))
    second = first[:32] + list(range(500, 510))  # two full blocks shared
    cached = LLM("dummy:tiny", kv_cache_dtype="fp8", num_gpu_blocks_override=64, **TINY)
    cached.generate([first], GREEDY, use_tqdm=False)
    out = cached.generate([second], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 32
    fresh = LLM("dummy:tiny", kv_cache_dtype="fp8", num_gpu_blocks_override=64, enable_prefix_caching=False, **TINY)
    assert out.outputs[0].token_ids == fresh.generate([second], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    check_no_blocks(cached.llm_engine)


# -- accuracy on the default model -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference(float32_passage):
    """The float32 logits over the passage, and each layer's max |K|, |V| on it (conftest's, computed once)."""
    logits, _, amax = float32_passage
    assert len(logits) >= 1000 and len(amax) == load_model_config(resolve_model_source(None)).num_hidden_layers
    return logits, amax


@pytest.mark.slow
def test_fp8_kv_cache_mean_kl_on_the_default_model_is_bounded(reference):
    ref, amax = reference
    default = mean_kl(passage_logits(kv_cache_dtype=FP8)[0], ref)  # every scale 1.0, as without checkpoint scales
    calibrated = mean_kl(passage_logits(kv_cache_dtype=FP8, kv_scales=[(k / 448, v / 448) for k, v in amax])[0], ref)
    print(f"fp8 KV cache: mean KL {default:.5f} nats (scales 1.0), {calibrated:.5f} (amax/448 per layer)")
    assert 0 < default < MAX_MEAN_KL and 0 < calibrated < MAX_MEAN_KL


@pytest.mark.slow
def test_a_wrong_scale_fails_the_kl_bound(reference):
    """The bound tells a working FP8 cache from a broken one: scales read inverted (448/amax instead of
    amax/448, a descale for a scale) squeeze K/V into e4m3's subnormals."""
    ref, amax = reference
    inverted = mean_kl(passage_logits(kv_cache_dtype=FP8, kv_scales=[(448 / k, 448 / v) for k, v in amax])[0], ref)
    print(f"fp8 KV cache with inverted scales: mean KL {inverted:.3f} nats")
    assert inverted > 10 * MAX_MEAN_KL


@pytest.mark.slow
def test_fp8_kv_cache_greedy_agreement_with_float32_over_8_prompts_x_64_tokens(float32_greedy):
    """The float32 model generates greedily (conftest's ``float32_greedy``: an engine built with ``engine``,
    once for the session); the FP8-cache engine, fed each prefix (teacher-forced, as one prefill that
    writes and reads the FP8 cache), ranks the same token first."""
    engine = dict(device="cpu", max_model_len=256, num_gpu_blocks_override=64)
    fp8 = LLM(kv_cache_dtype="fp8", **engine)
    assert fp8.llm_engine.executor.driver.kv_caches[0].dtype == FP8
    share = top1_agreement(fp8, float32_greedy)
    print(f"fp8 KV cache: greedy agreement {share:.3f}")
    assert share >= MIN_GREEDY_AGREEMENT
