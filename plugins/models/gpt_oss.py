"""gpt-oss (``GptOssForCausalLM``): a Llama-shaped mixture-of-experts model with attention sinks.

Per layer: attention with q/k/v/o biases and one learned sink logit per head (``self_attn.sinks``, split
with the heads under tensor parallelism), sliding-window (128) and global layers alternating, YaRN RoPE;
then a router with a bias choosing the top k experts by logit (softmax over those k), experts with
biases and a clamped SwiGLU (``(up + 1) * gate * sigmoid(1.702 * gate)``, both clamped at
``swiglu_limit``). The checkpoint stacks the experts: ``experts.gate_up_proj`` [E, H, 2I] with gate and
up interleaved by column, ``experts.down_proj`` [E, I, H]; :class:`kvforge.layers.moe.FusedMoE` loads
them into its [E, 2I, H] / [E, H, I] layout. The released checkpoints hold the experts in MXFP4
(``quantization_config.quant_method == "mxfp4"``), which kvforge does not load yet: the bf16 ones do.
"""
from __future__ import annotations

import torch
from torch import nn

from kvforge.layers.moe import FusedMoE
from kvforge.layers.weights import check_shape
from kvforge.model.config import ModelConfig
from kvforge.model.interface import ModelCapabilities
from kvforge.plugins.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class GptOssAttention(LlamaAttention):
    def __init__(self, config: ModelConfig, attn, layer_idx: int):
        super().__init__(config, attn, layer_idx)
        self.heads_start = self.qkv_proj.shard.q_start
        self.sinks = nn.Parameter(torch.zeros(self.num_heads, dtype=torch.float32), requires_grad=False)
        self.sinks.full_shape = (config.num_attention_heads,)
        self.sinks.weight_loader = self._load_sinks
        self.attn_layer = attn.layer(layer_idx, sliding_window=config.window_of(layer_idx), sinks=self.sinks)

    def _load_sinks(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        check_shape("the tensor", loaded, param.full_shape)
        param.data.copy_(loaded[self.heads_start:self.heads_start + self.num_heads])


class GptOssMLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        hf = config.hf_config
        experts, top_k = hf.get("num_local_experts") or hf.get("num_experts"), hf.get("num_experts_per_tok")
        self.router = nn.Linear(config.hidden_size, experts, bias=True)
        self.experts = FusedMoE(experts, top_k, config.hidden_size, config.intermediate_size, bias=True,
                                activation="swigluoai", scoring="topk_softmax",
                                swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
                                swiglu_limit=float(hf.get("swiglu_limit", 7.0)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.router(x))


class GptOssDecoderLayer(LlamaDecoderLayer):
    attention_cls = GptOssAttention

    def make_mlp(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        return GptOssMLP(config)


class GptOssModel(LlamaModel):
    layer_cls = GptOssDecoderLayer


#: stacked expert tensors -> (kvforge parameter, how FusedMoE.weight_loader reads it)
STACKED_EXPERTS = {"gate_up_proj": ("w13", "w13_interleaved"), "gate_up_proj_bias": ("w13_bias", "w13_interleaved"),
                   "down_proj": ("w2", "w2_transposed"), "down_proj_bias": ("w2_bias", "w2_transposed")}


class GptOssForCausalLM(LlamaForCausalLM):
    model_cls = GptOssModel
    capabilities = ModelCapabilities(sliding_window=True, moe=True, quantization=False,
                                     notes="attention sinks (triton, torch, FA4); MXFP4 checkpoints refused")

    def param_for(self, name: str, w: torch.Tensor):
        prefix, _, leaf = name.rpartition(".")
        if prefix.endswith(".mlp.experts") and leaf in STACKED_EXPERTS:
            param, kind = STACKED_EXPERTS[leaf]
            return f"{prefix}.{param}", (None, kind)
        return super().param_for(name, w)
