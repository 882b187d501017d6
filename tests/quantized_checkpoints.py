"""Pre-quantized Hugging Face checkpoints of the real default model, written for the tests.

The default model's GGUF weights (dequantized to float32, HF names) are quantized and saved as a
safetensors directory with a ``config.json`` whose ``quantization_config`` names the format:

- ``compressed-tensors`` FP8 and INT4 checkpoints are produced by the ``compressed-tensors`` library
  itself (its ``calculate_qparams`` and its compressors), the way llm-compressor saves them;
- AWQ and GPTQ checkpoints by the packers below, written from the projects' documented layouts with
  plain loops (AutoAWQ's ``WQLinear_GEMM.from_linear``, AutoGPTQ's ``QuantLinear.pack``), apart from
  kvforge's own unpacking code, which the tests hold to them;
- ``fp8`` (vLLM's format: FP8 weights and one scale per tensor) from the formula.

Quantization is round-to-nearest: a valid checkpoint of each format, without the calibration that
AWQ and GPTQ add for quality (so the accuracy bounds are those of plain RTN).
"""
from __future__ import annotations

import json
import os

import torch

from kvforge.model.loader import iter_weights, load_model_config, resolve_model_source

LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
FORMATS = ("awq", "gptq", "ct-int4", "ct-fp8", "fp8")


def rtn_asymmetric(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``w [N, K]`` -> q [N, K] (0..15), scales [N, K/G], integer zeros [N, K/G] (AWQ's zero-point RTN)."""
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    scales = ((hi - lo) / 15).clamp(min=1e-8)
    zeros = (-lo / scales).round().clamp(0, 15)
    q = (g / scales[..., None]).round().add(zeros[..., None]).clamp(0, 15)
    return q.reshape(n, k).int(), scales, zeros.int()


def rtn_symmetric(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [N, K]`` -> q [N, K] (0..15 around 8), scales [N, K/G] (GPTQ's ``sym=True``)."""
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    scales = (g.abs().amax(-1) * 2 / 15).clamp(min=1e-8)
    q = (g / scales[..., None]).round().add(8).clamp(0, 15)
    return q.reshape(n, k).int(), scales


def awq_pack(intweight: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's GEMM packing of ``intweight [rows, cols]`` (0..15) along the columns: word ``c`` holds
    column ``8c + AWQ_ORDER[i]`` at bits ``4i``."""
    rows, cols = intweight.shape
    out = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for c in range(cols // 8):
        for i in range(8):
            out[:, c] |= intweight[:, c * 8 + AWQ_ORDER[i]].long() << (i * 4)
    return _to_int32(out)


def gptq_pack_rows(intweight: torch.Tensor) -> torch.Tensor:
    """AutoGPTQ's ``qweight``: ``intweight [K, N]`` packed along K, eight rows per int32, row ``8r + j``
    at bits ``4j``."""
    k, n = intweight.shape
    out = torch.zeros(k // 8, n, dtype=torch.int64)
    for r in range(k // 8):
        for j in range(8):
            out[r] |= intweight[8 * r + j].long() << (4 * j)
    return _to_int32(out)


def gptq_pack_cols(zeros: torch.Tensor) -> torch.Tensor:
    """AutoGPTQ's ``qzeros``: ``zeros [K/G, N]`` packed along N, column ``8c + j`` at bits ``4j``."""
    rows, cols = zeros.shape
    out = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for c in range(cols // 8):
        for j in range(8):
            out[:, c] |= (zeros[:, 8 * c + j].long() & 0xF) << (4 * j)
    return _to_int32(out)


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words -> the int32 tensors checkpoints store (same bits)."""
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def _awq(module: str, w: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    q, scales, zeros = rtn_asymmetric(w, group)  # [N, K], [N, K/G]
    return {f"{module}.qweight": awq_pack(q.t()), f"{module}.qzeros": awq_pack(zeros.t()),
            f"{module}.scales": scales.t().contiguous().half()}


def _gptq(module: str, w: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    q, scales = rtn_symmetric(w, group)
    zeros = torch.full_like(scales, 8, dtype=torch.int32).t() - 1  # checkpoint_format "gptq": stored minus one
    k = w.shape[1]
    return {f"{module}.qweight": gptq_pack_rows(q.t()), f"{module}.qzeros": gptq_pack_cols(zeros),
            f"{module}.scales": scales.t().contiguous().half(),
            f"{module}.g_idx": (torch.arange(k) // group).int()}


def _ct_scheme(fmt: str, group: int):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    if fmt == "ct-fp8":
        return QuantizationScheme(
            targets=["Linear"], weights=QuantizationArgs(num_bits=8, type="float", strategy="channel", symmetric=True),
            input_activations=QuantizationArgs(num_bits=8, type="float", strategy="token", dynamic=True, symmetric=True))
    return QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", strategy="group", group_size=group, symmetric=True))


def _ct(module: str, w: torch.Tensor, scheme) -> dict[str, torch.Tensor]:
    from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    args = scheme.weights
    g = w.reshape(w.shape[0], -1, args.group_size if args.group_size else w.shape[1])
    scale, zero = calculate_qparams(g.amin(-1), g.amax(-1), args)
    state = {"weight": w, "weight_scale": scale, "weight_zero_point": zero}
    compressor = FloatQuantizationCompressor if args.type == "float" else PackedQuantizationCompressor
    return {f"{module}.{k}": v for k, v in compressor.compress(state, scheme).items()}


def _fp8(module: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
    scale = w.abs().amax() / torch.finfo(torch.float8_e4m3fn).max
    return {f"{module}.weight": (w / scale).to(torch.float8_e4m3fn), f"{module}.weight_scale": scale.reshape(())}


def quantization_config(fmt: str, group: int) -> dict:
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    if fmt == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False, "sym": True,
                "checkpoint_format": "gptq"}
    if fmt == "fp8":
        return {"quant_method": "fp8", "activation_scheme": "dynamic"}
    from compressed_tensors.quantization import QuantizationConfig

    ct_format = "float-quantized" if fmt == "ct-fp8" else "pack-quantized"
    qc = QuantizationConfig(config_groups={"group_0": _ct_scheme(fmt, group)}, format=ct_format, ignore=["lm_head"])
    return json.loads(qc.model_dump_json())


def write_checkpoint(path: str, fmt: str, group: int = 128) -> str:
    """The default model saved in format ``fmt`` (one of :data:`FORMATS`) under ``path``; returns it."""
    from safetensors.torch import save_file

    assert fmt in FORMATS, fmt
    src = resolve_model_source(None)
    mc = load_model_config(src)
    scheme = _ct_scheme(fmt, group) if fmt.startswith("ct-") else None
    tensors: dict[str, torch.Tensor] = {}
    for name, w in iter_weights(src):
        module, _, leaf = name.rpartition(".")
        if leaf != "weight" or module.rpartition(".")[2] not in LINEAR:
            tensors[name] = w.contiguous()
        elif fmt == "awq":
            tensors.update(_awq(module, w, group))
        elif fmt == "gptq":
            tensors.update(_gptq(module, w, group))
        elif fmt == "fp8":
            tensors.update(_fp8(module, w))
        else:
            tensors.update(_ct(module, w, scheme))
    os.makedirs(path, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "model.safetensors"))
    hf = mc.to_hf_dict()
    hf["quantization_config"] = quantization_config(fmt, group)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f)
    return path
