"""Quantized mixture-of-experts checkpoints in their published layouts (tests/moe_checkpoints.py): a tiny
random gpt-oss in MXFP4 and a tiny Qwen3-MoE in block FP8 (16x16 blocks: the tiny model's 32-wide
experts split over two ranks in whole blocks; real checkpoints use 128x128, the same code). kvforge's
greedy tokens and log-probabilities over 8 prompts x 32 tokens equal transformers' on the same weights
dequantized to float32, at TP=1 and split over two gloo ranks; FP8 quantized on load, layer by layer."""
from __future__ import annotations

import pytest
import torch
from moe_checkpoints import quantize_mxfp4, write_fp8_blocks, write_fp8_tensor, write_mxfp4
from moe_layers import build_layer, route

from kvforge import LLM, SamplingParams
from kvforge.layers.fused_moe import fused_experts_ref
from model_architectures import VOCAB, build

TOKENS = 32
PROMPTS = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist()
           for n in (3, 5, 8, 11, 16, 20, 27, 40)]
#: test id -> (architecture, config overrides, checkpoint writer, the experts' stored dtype)
CASES = {
    "gpt-oss-mxfp4": ("gpt-oss", dict(intermediate_size=64), write_mxfp4, torch.uint8),
    "qwen3-moe-fp8-block": ("qwen3-moe", {}, lambda s, q, d: write_fp8_blocks(s, q, d, 16), torch.float8_e4m3fn),
}


def _run(path: str, **engine) -> tuple[list[tuple[list[int], list[float]]], set[torch.dtype]]:
    """kvforge's greedy (tokens, log-probabilities) per prompt, and the dtypes its first layer's experts hold."""
    llm = LLM(model=path, device="cpu", dtype="float32", block_size=16, num_gpu_blocks_override=48, **engine)
    try:
        params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True, logprobs=0)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        stored = set()
        if llm.llm_engine.executor.world_size == 1:
            experts = llm.llm_engine.executor.driver.model.model.layers[0].mlp.experts
            stored = {p.dtype for n, p in experts.named_parameters() if n in ("w13", "w2", "w13_blocks", "w2_blocks")}
        return [(list(o.outputs[0].token_ids), [s[t].logprob for s, t in zip(o.outputs[0].logprobs,
                                                                           o.outputs[0].token_ids)])
                for o in outs], stored
    finally:
        llm.shutdown()


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
    """(test id, quantized checkpoint, transformers on its dequantized twin, kvforge's TP=1 outputs)."""
    import transformers

    arch, overrides, write, _ = CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    build(arch, str(root / "src"), **overrides)
    write(str(root / "src"), str(root / "quantized"), str(root / "dequantized"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(root / "dequantized"), dtype=torch.float32).eval()
    hf.config._attn_implementation = "eager"
    return request.param, str(root / "quantized"), hf, _run(str(root / "quantized"))


def test_quantized_experts_equal_the_dequantized_reference_in_transformers(checkpoint):
    test_id, _, hf, (outs, stored) = checkpoint
    assert stored == {CASES[test_id][3]}  # the experts are held quantized
    for prompt, (tokens, logprobs) in zip(PROMPTS, outs):
        with torch.no_grad():  # one forward over prompt + generated tokens: every step's distribution
            logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()
        ref = torch.log_softmax(logits, dim=-1)
        assert tokens == ref.argmax(dim=-1).tolist()  # greedy: each token is the reference's argmax
        torch.testing.assert_close(torch.tensor(logprobs), ref[torch.arange(TOKENS), tokens], atol=1e-4, rtol=0)


def test_split_over_two_ranks_equals_one(checkpoint):
    _, path, _, (outs, _) = checkpoint
    split, _ = _run(path, tensor_parallel_size=2)
    assert [t for t, _ in split] == [t for t, _ in outs]
    torch.testing.assert_close(torch.tensor([lp for _, lp in split]), torch.tensor([lp for _, lp in outs]),
                               atol=1e-4, rtol=0)


def test_mxfp4_bytes_dequantize_as_transformers_reads_them():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from kvforge.plugins.quantization.mxfp4 import dequantize_mxfp4

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 2, 16), generator=gen).to(torch.uint8)  # every e2m1 code
    scales = torch.randint(110, 140, (3, 8, 2), generator=gen).to(torch.uint8)
    ours = dequantize_mxfp4(blocks, scales)  # [E, out, in]
    assert torch.equal(ours.transpose(1, 2), convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    w = torch.randn(4, 64)
    assert (dequantize_mxfp4(*quantize_mxfp4(w)) - w).abs().max() < 0.25 * w.abs().max()  # the test quantizer


@pytest.mark.parametrize("fmt", ["fp8-on-load", "fp8-tensor", "fp8-block16", "fp8-block128", "mxfp4"])
def test_layer_reference_uses_the_stored_values(fmt):
    """The CPU path equals the torch reference run on float32 weights rebuilt here from the stored tensors."""
    layer = build_layer(fmt)
    x, weights, ids = route(layer, 7)
    p = layer.get_parameter
    if fmt == "mxfp4":
        from transformers.integrations.mxfp4 import convert_moe_packed_tensors

        w13, w2 = (convert_moe_packed_tensors(p(f"{w}_blocks"), p(f"{w}_scales"), dtype=torch.float32)
                   .transpose(1, 2).contiguous() for w in ("w13", "w2"))
    else:
        n, h = layer.count, layer.hidden_size
        block = {"fp8-block16": 16, "fp8-block128": 128}.get(fmt)
        suffix = "_weight_scale_inv" if block else "_weight_scale"
        s13, s2 = p("w13" + suffix), p("w2" + suffix)
        if block:  # the gate and up halves each have ceil(I / B) rows of blocks
            rows = -(-n // block)
            assert s13.shape == (4, 2 * rows, -(-h // block)) and s2.shape == (4, -(-h // block), rows)
            gate, up = (half.repeat_interleave(block, 1)[:, :n] for half in (s13[:, :rows], s13[:, rows:]))
            s13 = torch.cat([gate, up], 1).repeat_interleave(block, 2)[:, :, :h]
            s2 = s2.repeat_interleave(block, 1).repeat_interleave(block, 2)[:, :h, :n]
        elif fmt == "fp8-tensor":  # (gate, up) per expert, one for down
            s13 = s13.repeat_interleave(n, 1)
        w13, w2 = p("w13").float() * s13, p("w2").float() * s2
        assert p("w13").dtype == torch.float8_e4m3fn
    want = fused_experts_ref(x, w13, w2, weights, ids, activation=layer.activation, w13_bias=layer.w13_bias,
                             w2_bias=layer.w2_bias)
    assert torch.equal(layer.quant_method.apply(layer, x, weights, ids), want)


def test_fp8_on_load_scales_each_expert_row():
    layer = build_layer("fp8-on-load")
    w13, s13 = layer.get_parameter("w13"), layer.get_parameter("w13_weight_scale")
    assert w13.dtype == torch.float8_e4m3fn and s13.shape == (4, 80, 1)
    assert torch.equal(w13.float().abs().amax(dim=2), torch.full((4, 80), 448.0))  # each row's max is e4m3's


def test_qwen3_moe_quantized_on_load_runs_fp8_experts(tmp_path):
    build("qwen3-moe", str(tmp_path))
    llm = LLM(model=str(tmp_path), device="cpu", dtype="float32", quantization="fp8", num_gpu_blocks_override=16)
    try:
        experts = llm.llm_engine.executor.driver.model.model.layers[0].mlp.experts
        assert experts.get_parameter("w13").dtype == torch.float8_e4m3fn
        out = llm.generate([{"prompt_token_ids": PROMPTS[2]}], SamplingParams(temperature=0, max_tokens=4),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
    finally:
        llm.shutdown()


def test_per_tensor_fp8_checkpoint_keeps_each_expert_projection_scale(tmp_path):
    """vLLM-style per-tensor scales (``experts.N.gate_proj.weight_scale``, one value) land per expert and
    projection; the dense layers are the ``fp8`` linear method's (W8A8, so no exact twin here: the layer
    tests hold the experts' arithmetic)."""
    from safetensors.torch import load_file

    build("qwen3-moe", str(tmp_path / "src"))
    write_fp8_tensor(str(tmp_path / "src"), str(tmp_path / "q"), str(tmp_path / "d"))
    saved = load_file(str(tmp_path / "q" / "model.safetensors"))
    llm = LLM(model=str(tmp_path / "q"), device="cpu", dtype="float32", num_gpu_blocks_override=16)
    try:
        experts = llm.llm_engine.executor.driver.model.model.layers[1].mlp.experts
        s13, s2 = experts.get_parameter("w13_weight_scale"), experts.get_parameter("w2_weight_scale")
        prefix = "model.layers.1.mlp.experts.2."
        assert s13[2, 0, 0] == saved[prefix + "gate_proj.weight_scale"] != s13[2, 1, 0]
        assert s13[2, 1, 0] == saved[prefix + "up_proj.weight_scale"]
        assert s2[2, 0, 0] == saved[prefix + "down_proj.weight_scale"]
        assert torch.equal(experts.get_parameter("w13")[2, :32].float(), saved[prefix + "gate_proj.weight"].float())
        out = llm.generate([{"prompt_token_ids": PROMPTS[1]}], SamplingParams(temperature=0, max_tokens=4),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
    finally:
        llm.shutdown()


def test_bad_block_sizes_are_refused_naming_the_field():
    from types import SimpleNamespace

    from kvforge.plugins.quantization.fp8 import Fp8Quantization

    qc = {"quant_method": "fp8", "weight_block_size": [128]}
    with pytest.raises(ValueError, match="'weight_block_size' is \\[128\\]"):
        Fp8Quantization(model_config=SimpleNamespace(quantization_config=qc))
    static = Fp8Quantization(model_config=SimpleNamespace(
        quantization_config={"quant_method": "fp8", "activation_scheme": "static"}))
    with pytest.raises(ValueError, match="'activation_scheme' is 'static'"):
        static.moe_method(torch.nn.Module())


@pytest.mark.parametrize("fmt, inter, field", [("fp8-block16", 40, "weight_block_size"), ("mxfp4", 96, "quant_method")])
def test_a_split_that_cuts_a_block_is_refused_naming_the_field(fmt, inter, field):
    """Two ranks of 20 (48) intermediate rows each would cut a 16-block (a group of 32)."""
    from moe_layers import method

    from kvforge.layers.moe import FusedMoE
    from kvforge.model import quantization
    from kvforge.rank import parallel_state

    with parallel_state.building(parallel_state.TPGroup(rank=1, size=2)), quantization.building(method(fmt)):
        with pytest.raises(ValueError, match=f"field '{field}'.*split over 2 ranks"):
            FusedMoE(4, 2, 64, inter)
        FusedMoE(4, 2, 64, 2 * inter if fmt == "mxfp4" else 64)  # whole blocks per rank: built
