"""Pre-quantized Hugging Face checkpoints (AWQ, GPTQ, compressed-tensors FP8 and INT4, vLLM's fp8)
and ``int4`` on load: the packing layouts against their projects' documented layouts and against
the compressed-tensors library's own unpacking, then accuracy on the real default model against
float32 (docs/quantization.md#accuracy), and clear refusals naming the field for what is not supported.

The default model's hidden size (576) is not a multiple of 128, so its checkpoints use groups of 64."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from kvforge import LLM, quantization
from kvforge.layers import ColumnParallelLinear
from kvforge.model.config import ModelConfig
from kvforge.model.loader import default_model_path
from kvforge.plugins.quantization import int4
from kvforge.plugins.quantization.compressed_tensors import CompressedTensorsQuantization
from quantization_accuracy import mean_kl, passage_logits, top1_agreement
from quantized_checkpoints import FORMATS, awq_pack, gptq_pack_cols, gptq_pack_rows, write_checkpoint

#: bounds (measured values in docs/quantization.md): FP8 keeps ~0.02 nats; round-to-nearest INT4 with
#: groups of 64 costs this 135M model 0.27 (asymmetric) to 0.35 (symmetric) nats. A dequantizer that
#: misplaces a nibble, a scale or a zero point gives several nats and agreement near zero.
MAX_MEAN_KL = {"fp8": 0.05, "ct-fp8": 0.05, "awq": 0.5, "gptq": 0.5, "ct-int4": 0.5,
               "int4": 0.5}
MIN_AGREEMENT = {"fp8": 0.85, "ct-fp8": 0.85, "awq": 0.6, "gptq": 0.6}
ENGINE = dict(device="cpu", max_model_len=256, num_gpu_blocks_override=64)


def test_awq_and_gptq_words_unpack_in_their_documented_nibble_order():
    # AutoAWQ's GEMM layout: nibble i of a word holds output column AWQ_ORDER[i] of its eight
    awq_word = torch.tensor([[0x75316420]], dtype=torch.int32)
    assert int4.unpack_cols(awq_word, int4.AWQ_ORDER).tolist() == [list(range(8))]
    # GPTQ's qweight: nibble j holds input row 8r + j; qzeros: nibble j holds output column 8c + j
    gptq_word = torch.tensor([[0x76543210]], dtype=torch.int32)
    assert int4.unpack_rows(gptq_word).flatten().tolist() == list(range(8))
    assert int4.unpack_cols(gptq_word).tolist() == [list(range(8))]
    # a sign bit set (a nibble of 8 or more at the top) unpacks the same
    top = torch.tensor([[-0x10000000 * 8 + 0x0000001]], dtype=torch.int32)  # 0x80000001
    assert int4.unpack_rows(top).flatten().tolist() == [1, 0, 0, 0, 0, 0, 0, 8]


def test_kvforge_unpacks_what_the_awq_and_gptq_packers_wrote():
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (64, 48), generator=g, dtype=torch.int32)
    assert torch.equal(int4.unpack_cols(awq_pack(q), int4.AWQ_ORDER), q)
    assert torch.equal(int4.unpack_rows(gptq_pack_rows(q)), q)
    assert torch.equal(int4.unpack_cols(gptq_pack_cols(q)), q)
    assert torch.equal(int4.unpack_rows(int4.pack_rows(q)), q)


def _ct_layer(state: dict, qc: dict, out: int, inp: int) -> torch.nn.Module:
    """A column-parallel layer loading one compressed-tensors module's tensors."""
    method = CompressedTensorsQuantization(
        model_config=dataclasses.replace(ModelConfig.from_preset("tiny"), quantization_config=qc))
    with quantization.building(method):
        layer = ColumnParallelLinear(inp, out)
    quantization.attach_all(layer, method)
    for name, tensor in state.items():
        param = getattr(layer, name)
        param.weight_loader(param, tensor)
    quantization.process_after_loading(layer)
    return layer


@pytest.mark.parametrize("symmetric, group", [(True, 128), (False, 64), (False, 32), (True, None)],
                         ids=["sym-g128", "asym-g64", "asym-g32", "sym-channel"])
def test_compressed_tensors_int4_unpacks_as_the_library_decompresses(symmetric, group):
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric,
                            **({"strategy": "group", "group_size": group} if group else {"strategy": "channel"}))
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    w = torch.randn(40, 256, generator=torch.Generator().manual_seed(1))
    grouped = w.reshape(40, -1, group or 256)
    scale, zero = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
    packed = PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zero},
                                                   scheme)
    library = PackedQuantizationCompressor.decompress(dict(packed), scheme)["weight"]
    qc = json.loads(QuantizationConfig(config_groups={"g": scheme}, format="pack-quantized").model_dump_json())
    layer = _ct_layer(packed, qc, 40, 256)
    kernel = layer.quant_method.weights  # the layer's kernel layout (int4.Int4Weights)
    ours = int4.dequantize(kernel.qweight, kernel.scales, kernel.zeros, kernel.group_size).t()
    torch.testing.assert_close(ours, library.float(), rtol=0, atol=1e-6)
    assert (ours - w).abs().max() > 1e-3  # really quantized


def test_compressed_tensors_fp8_weights_dequantize_as_the_library_does():
    from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    args = QuantizationArgs(num_bits=8, type="float", strategy="channel", symmetric=True)
    acts = QuantizationArgs(num_bits=8, type="float", strategy="token", dynamic=True, symmetric=True)
    scheme = QuantizationScheme(targets=["Linear"], weights=args, input_activations=acts)
    w = torch.randn(24, 64, generator=torch.Generator().manual_seed(2))
    scale, zero = calculate_qparams(w.amin(-1, keepdim=True), w.amax(-1, keepdim=True), args)
    packed = FloatQuantizationCompressor.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zero},
                                                  scheme)
    library = FloatQuantizationCompressor.decompress(dict(packed), scheme)["weight"]
    qc = json.loads(QuantizationConfig(config_groups={"g": scheme}, format="float-quantized").model_dump_json())
    layer = _ct_layer(packed, qc, 24, 64)
    torch.testing.assert_close(layer.weight.float() * layer.weight_scale, library.float(), rtol=0, atol=0)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    return {fmt: write_checkpoint(str(root / fmt), fmt, group=64) for fmt in FORMATS}


@pytest.fixture(scope="module")
def reference_logits(float32_passage):
    return float32_passage[0]  # conftest's: the float32 passage logits, computed once for the session


@pytest.mark.parametrize("fmt", [*FORMATS, "int4"])
def test_mean_kl_of_each_format_on_the_default_model_is_bounded(fmt, checkpoints, reference_logits):
    got, n = (passage_logits(quant="int4", group_size=64) if fmt == "int4" else passage_logits(checkpoints[fmt]))
    kl = mean_kl(got, reference_logits)
    print(f"{fmt}: mean KL {kl:.4f} nats over {n} positions")
    assert n >= 1000 and 0 < kl < MAX_MEAN_KL[fmt]


@pytest.fixture(scope="module")
def greedy(float32_greedy):
    return float32_greedy  # conftest's: reference_greedy on an engine built with ENGINE, generated once


@pytest.mark.parametrize("fmt", ["awq", "gptq", "ct-fp8"])
def test_greedy_agreement_of_pre_quantized_checkpoints_over_8_prompts_x_64_tokens(fmt, checkpoints, greedy):
    llm = LLM(checkpoints[fmt], tokenizer=default_model_path(), **ENGINE)
    assert llm.llm_engine.config.quantization == {"ct-fp8": "compressed-tensors"}.get(fmt, fmt)
    share = top1_agreement(llm, greedy)
    print(f"{fmt}: greedy agreement {share:.3f}")
    assert share >= MIN_AGREEMENT[fmt]


def _config_dir(tmp_path, qc: dict) -> str:
    hf = ModelConfig.from_preset("tiny").to_hf_dict()
    hf["quantization_config"] = qc
    (tmp_path / "config.json").write_text(json.dumps(hf))
    return str(tmp_path)


@pytest.mark.parametrize("qc, quant, message", [
    ({"quant_method": "bitsandbytes"}, None,
     # (an installed plugin's formats join the list: the dummy plugin's dummy_int8 when another test loaded it)
     "quant_method 'bitsandbytes', which no registered quantization method loads; supported: awq, "
     "compressed-tensors, (dummy_int8, )?fp8, gptq, mxfp4$"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, None, "'version' is 'gemv'"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True}, None, "'desc_act' is true"),
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, None, "'bits' is 8"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 96}, None, "'group_size' is 96; supported: 32, 64, 128"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, None, r"'weight_block_size' is \[128\]; expected two"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128}, "fp8",
     "quantization='fp8' cannot load this checkpoint: its config.json quantization_config has quant_method 'awq'"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
        "input_activations": {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}}}}, None,
     "config_groups.group_0 .*is not supported; supported: FP8 W8A8"),
], ids=["unknown-method", "awq-gemv", "gptq-act-order", "gptq-8-bit", "gptq-group-96", "fp8-block-malformed",
        "method-mismatch", "ct-int8"])
def test_unsupported_checkpoints_are_refused_naming_the_field(tmp_path, qc, quant, message):
    with pytest.raises(ValueError, match=message):
        LLM(_config_dir(tmp_path, qc), quantization=quant, device="cpu", load_format="dummy", max_model_len=128,
            num_gpu_blocks_override=16)


def test_a_checkpoint_format_without_a_checkpoint_is_refused():
    with pytest.raises(ValueError, match="quantization='gptq' loads pre-quantized checkpoints only"):
        LLM(quantization="gptq", device="cpu", max_model_len=128, num_gpu_blocks_override=16)


def test_gptq_act_order_g_idx_is_refused(tmp_path, checkpoints):
    from safetensors.torch import load_file, save_file

    src = checkpoints["gptq"]
    tensors = load_file(f"{src}/model.safetensors")
    name = "model.layers.0.mlp.down_proj.g_idx"
    tensors[name] = tensors[name].flip(0).contiguous()  # an act-order permutation
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(open(f"{src}/config.json").read())
    with pytest.raises(ValueError, match="g_idx is not sequential"):
        LLM(str(tmp_path), tokenizer=default_model_path(), **ENGINE)


def test_int4_group_size_that_does_not_divide_the_inputs_names_the_option():
    with pytest.raises(ValueError, match="group_size"):
        LLM(quantization="int4", device="cpu", max_model_len=128, num_gpu_blocks_override=16)


def test_fp8_kv_cache_scales_load_from_the_checkpoint(tmp_path, checkpoints):
    """compressed-tensors' ``model.layers.N.self_attn.k_scale`` / ``v_scale`` (and the older
    ``k_proj.output_scale``) reach the attention backend's per-layer scales of the FP8 KV cache."""
    from safetensors.torch import load_file, save_file

    src = checkpoints["ct-fp8"]
    tensors = load_file(f"{src}/model.safetensors")
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(0.5)
    tensors["model.layers.0.self_attn.v_scale"] = torch.tensor([0.25])
    tensors["model.layers.3.self_attn.k_proj.output_scale"] = torch.tensor(2.0)
    tensors["model.layers.5.self_attn.kv_scale"] = torch.tensor(3.0)  # AutoFP8: one scale for K and V
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(open(f"{src}/config.json").read())
    llm = LLM(str(tmp_path), tokenizer=default_model_path(), kv_cache_dtype="fp8", **ENGINE)
    driver = llm.llm_engine.executor.driver
    scales = [driver.attn.layer_kv_scales(cache) for cache in driver.kv_caches]
    assert [(s.k, s.v) for s in scales[:6]] == [(0.5, 0.25), (1.0, 1.0), (1.0, 1.0), (2.0, 1.0), (1.0, 1.0), (3.0, 3.0)]


def _method(cls, qc: dict):
    return cls(model_config=dataclasses.replace(ModelConfig.from_preset("tiny"), quantization_config=qc))


def test_layer_selection_follows_each_formats_own_rules():
    from kvforge.plugins.quantization.compressed_tensors import PackedInt4Linear
    from kvforge.plugins.quantization.fp8 import Fp8LinearMethod, Fp8Quantization
    from kvforge.plugins.quantization.gptq import GptqQuantization

    int4 = {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 64}}
    fp8 = {"targets": ["re:.*down_proj"], "format": "float-quantized",  # a mixed-precision checkpoint's group
           "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
           "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}
    ct = _method(CompressedTensorsQuantization, {"quant_method": "compressed-tensors", "format": "mixed-precision",
                                                 "config_groups": {"group_0": int4 | {"format": "pack-quantized"},
                                                                   "group_1": fp8}})
    # a regex naming the module wins over the class name "Linear", whatever the groups' order
    assert isinstance(ct.linear_method(None, ["model.layers.0.mlp.down_proj"]), Fp8LinearMethod)
    assert isinstance(ct.linear_method(None, ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"]),
                      PackedInt4Linear)
    # fp8's ignored_layers are exact names: a router called "...mlp.gate" does not touch gate_proj
    q = _method(Fp8Quantization, {"quant_method": "fp8", "ignored_layers": ["model.layers.0.mlp.gate"]})
    assert q.linear_method(None, ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"]) is not None
    # GPTQ's modules_in_block_to_quantize: the rest stays unquantized; half a fused layer is refused
    g = _method(GptqQuantization, {"quant_method": "gptq", "bits": 4, "group_size": 64,
                                   "modules_in_block_to_quantize": [["self_attn.q_proj", "self_attn.k_proj",
                                                                     "self_attn.v_proj"], ["mlp.down_proj"]]})
    assert g.linear_method(None, ["model.layers.0.self_attn.o_proj"]) is None
    assert g.linear_method(None, ["model.layers.0.mlp.down_proj"]) is not None
    with pytest.raises(ValueError, match="modules_in_block_to_quantize"):
        _method(GptqQuantization, {"quant_method": "gptq", "bits": 4, "group_size": 64,
                                   "modules_in_block_to_quantize": [["mlp.gate_proj"]]}).linear_method(
            None, ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"])
    with pytest.raises(ValueError, match="'sparsity_config' has format 'sparse-24-bitmask'"):
        _method(CompressedTensorsQuantization, {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                                "config_groups": {"g": int4},
                                                "sparsity_config": {"format": "sparse-24-bitmask"}})


def test_a_method_given_a_model_without_kvforge_linear_layers_is_refused():
    from kvforge.plugins.quantization.fp8 import Fp8Quantization

    with pytest.raises(ValueError, match="no kvforge.layers linear layers"):
        quantization.attach_all(torch.nn.Sequential(torch.nn.Linear(4, 4)), Fp8Quantization())


def test_gptq_extra_zero_biases_are_skipped_and_a_quantized_draft_model_loads(tmp_path, checkpoints):
    """AutoGPTQ's QuantLinear saves an all-zero bias per layer; and a pre-quantized draft model
    (speculative_config) loads its own quantization_config: greedy speculation is lossless, so the
    target's tokens are the plain run's."""
    from safetensors.torch import load_file, save_file

    from kvforge import SamplingParams

    src = checkpoints["gptq"]
    tensors = load_file(f"{src}/model.safetensors")
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(576, dtype=torch.float16)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(open(f"{src}/config.json").read())
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    plain = [o.outputs[0].token_ids for o in LLM(**ENGINE).generate(prompts, params, use_tqdm=False)]
    spec = LLM(speculative_config={"method": "draft_model", "model": str(tmp_path), "num_speculative_tokens": 3},
               **ENGINE)
    drafter = spec.llm_engine.spec.drafter
    assert drafter.model.model.layers[0].self_attn.qkv_proj.qweight.dtype == torch.int32
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)] == plain
