"""Quantized mixture-of-experts checkpoints in their published layouts, written from a tiny random model
(``model_architectures.build``), each with its twin: the same quantized values dequantized to float32 and
saved as an ordinary checkpoint (the reference that transformers and kvforge's bf16 path run).

- MXFP4 as gpt-oss publishes it: ``experts.gate_up_proj_blocks`` [E, 2I, H / 32, 16] uint8 (rows = the
  bf16 ``gate_up_proj`` [E, H, 2I] columns, gate/up interleaved), ``_scales`` [E, 2I, H / 32] e8m0,
  ``down_proj_blocks`` / ``_scales`` from ``down_proj`` [E, I, H]; round-to-nearest e2m1 under the OCP
  shared exponent ``floor(log2(amax)) - 2``. The twin is dequantized by transformers' own
  ``convert_moe_packed_tensors``.
- Block FP8 as Qwen3 / DeepSeek publish it: every decoder ``*_proj.weight`` (experts and attention) e4m3
  with ``weight_scale_inv`` [ceil(N / B), ceil(K / B)], ``amax / 448`` per block.
- Per-tensor FP8 as vLLM's ``fp8`` / AutoFP8 write it: e4m3 ``weight`` and a one-value ``weight_scale``.
"""
from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [..., K]`` -> (blocks [..., K / 32, 16] uint8, scales [..., K / 32] uint8)."""
    groups = w.float().reshape(*w.shape[:-1], -1, 32)
    amax = groups.abs().amax(dim=-1, keepdim=True).clamp(min=2.0 ** -100)
    exp = torch.floor(torch.log2(amax)) - 2  # e2m1's largest exponent is 2 (6 = 1.5 * 2^2)
    scaled = (groups / torch.exp2(exp)).clamp(-6, 6)
    codes = (scaled.abs().unsqueeze(-1) - E2M1).abs().argmin(dim=-1)  # nearest magnitude
    codes = codes | ((scaled < 0).long() << 3)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return packed, (exp.squeeze(-1) + 127).to(torch.uint8)


def quantize_fp8_blocks(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [N, K]`` -> (e4m3 [N, K], weight_scale_inv [ceil(N / B), ceil(K / B)] float32), ``amax / 448``."""
    n, k = w.shape
    rows, cols = -(-n // block), -(-k // block)
    padded = torch.zeros(rows * block, cols * block)
    padded[:n, :k] = w.float()
    tiles = padded.reshape(rows, block, cols, block)
    scale = (tiles.abs().amax(dim=(1, 3)) / 448.0).clamp(min=1e-12)
    full = scale.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    return (w.float() / full).clamp(-448, 448).to(torch.float8_e4m3fn), scale


def _write(path: str, tensors: dict[str, torch.Tensor], config: dict, src: str) -> None:
    os.makedirs(path, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    for extra in ("generation_config.json",):
        if os.path.exists(os.path.join(src, extra)):
            with open(os.path.join(src, extra)) as f, open(os.path.join(path, extra), "w") as g:
                g.write(f.read())


def _source(src: str) -> tuple[dict[str, torch.Tensor], dict]:
    with open(os.path.join(src, "config.json")) as f:
        return load_file(os.path.join(src, "model.safetensors")), json.load(f)


def write_mxfp4(src: str, quantized: str, dequantized: str) -> None:
    """gpt-oss's experts of the checkpoint ``src`` in MXFP4 (``quantized``) and dequantized (``dequantized``)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    tensors, config = _source(src)
    quant, deq = {}, {}
    for name, w in tensors.items():
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            blocks, scales = quantize_mxfp4(w.transpose(1, 2))  # [E, out, in]: the rows the blocks hold
            quant[name + "_blocks"], quant[name + "_scales"] = blocks, scales
            deq[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
        else:
            quant[name] = deq[name] = w
    _write(quantized, quant, config | {"quantization_config": {"quant_method": "mxfp4"}}, src)
    _write(dequantized, deq, config, src)


def write_fp8_blocks(src: str, quantized: str, dequantized: str, block: int) -> None:
    """Every decoder projection of ``src`` (experts, attention, dense MLPs; not the router) in block FP8."""
    tensors, config = _source(src)
    quant, deq = {}, {}
    for name, w in tensors.items():
        if ".layers." in name and name.endswith("_proj.weight"):
            q, scale = quantize_fp8_blocks(w, block)
            quant[name], quant[name.removesuffix("weight") + "weight_scale_inv"] = q, scale
            full = scale.repeat_interleave(block, 0)[:w.shape[0]].repeat_interleave(block, 1)[:, :w.shape[1]]
            deq[name] = q.float() * full
        else:
            quant[name] = deq[name] = w
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [block, block]}
    _write(quantized, quant, config | {"quantization_config": qc}, src)
    _write(dequantized, deq, config, src)


def write_fp8_tensor(src: str, quantized: str, dequantized: str) -> None:
    """Every decoder projection of ``src`` in FP8 with one scale per tensor (``amax / 448``)."""
    tensors, config = _source(src)
    quant, deq = {}, {}
    for name, w in tensors.items():
        if ".layers." in name and name.endswith("_proj.weight"):
            scale = (w.abs().amax().float() / 448.0).clamp(min=1e-12).reshape(())
            q = (w.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
            quant[name], quant[name.removesuffix("weight") + "weight_scale"] = q, scale
            deq[name] = q.float() * scale
        else:
            quant[name] = deq[name] = w
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    _write(quantized, quant, config | {"quantization_config": qc}, src)
    _write(dequantized, deq, config, src)
