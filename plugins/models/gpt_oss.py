"""gpt-oss (``GptOssForCausalLM``): a Llama-shaped mixture-of-experts model with attention sinks.

Per layer: attention with q/k/v/o biases and one learned sink logit per head (``self_attn.sinks``, split
with the heads under tensor parallelism), sliding-window (128) and global layers alternating, YaRN RoPE;
then a router with a bias choosing the top k experts by logit (softmax over those k), experts with
biases and a clamped SwiGLU (``(up + 1) * gate * sigmoid(1.702 * gate)``, both clamped at
``swiglu_limit``). The checkpoint stacks the experts: ``experts.gate_up_proj`` [E, H, 2I] with gate and
up interleaved by column, ``experts.down_proj`` [E, I, H]; :class:`kvforge.layers.moe.FusedMoE` loads
them into its [E, 2I, H] / [E, H, I] layout (:data:`GPT_OSS_WEIGHTS`). The released checkpoints hold the
experts in MXFP4 (``quantization_config.quant_method == "mxfp4"``, ``experts.gate_up_proj_blocks`` /
``_scales``...), loaded by ``kvforge.plugins.quantization.mxfp4``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from kvforge.attention import AttentionBackend
from kvforge.layers.moe import FusedMoE
from kvforge.layers.weights import ShardId, check_shape, full_shape, set_loader
from kvforge.model.config import FULL, SLIDING, ConfigFields, HFConfig, ModelConfig, windowed_layers
from kvforge.model.interface import ModelCapabilities, ModelFamily
from kvforge.plugins.models.llama import (
    LLAMA_WEIGHTS,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
)


@dataclass
class GptOssConfig(ModelConfig):
    """A gpt-oss config: every layer has attention sinks; the experts' fields are config.json's."""

    @property
    def attention_features(self) -> frozenset[str]:
        return super().attention_features | {"attention_sinks"}

    @property
    def num_experts(self) -> int:
        return _positive(self.hf_config, "num_local_experts", "num_experts")

    @property
    def experts_per_token(self) -> int:
        return _positive(self.hf_config, "num_experts_per_tok")


def _positive(hf: HFConfig, *names: str) -> int:
    """The first of ``names`` that config.json sets, a positive integer; ``ValueError`` naming them if none."""
    value = next((hf[n] for n in names if hf.get(n) is not None), None)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"model config field {' / '.join(map(repr, names))} must be a positive integer for a "
                         f"mixture-of-experts model, got {value!r}")
    return value


class GptOssAttention(LlamaAttention):
    def __init__(self, config: ModelConfig, attn: AttentionBackend, layer_idx: int):
        super().__init__(config, attn, layer_idx)
        self.heads_start = self.qkv_proj.shard.q_start
        sinks = nn.Parameter(torch.zeros(self.num_heads, dtype=torch.float32), requires_grad=False)
        self.sinks = set_loader(sinks, self._load_sinks, (config.num_attention_heads,))
        self.attn_layer = attn.layer(layer_idx, sliding_window=config.window_of(layer_idx), sinks=self.sinks)

    def _load_sinks(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        check_shape("the tensor", loaded, full_shape(param))
        param.data.copy_(loaded[self.heads_start:self.heads_start + self.num_heads])


class GptOssMLP(nn.Module):
    def __init__(self, config: GptOssConfig):
        super().__init__()
        hf = config.hf_config
        experts, top_k = config.num_experts, config.experts_per_token
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
        if not isinstance(config, GptOssConfig):
            raise TypeError(f"gpt-oss layers are built from a GptOssConfig, got a {type(config).__name__}")
        return GptOssMLP(config)


class GptOssModel(LlamaModel):
    layer_cls = GptOssDecoderLayer


#: Llama's names, and the stacked expert tensors -> (FusedMoE parameter, how its loader reads them)
GPT_OSS_WEIGHTS = dataclasses.replace(LLAMA_WEIGHTS, stacked_experts={
    "gate_up_proj": ("w13", "w13_interleaved"), "gate_up_proj_bias": ("w13_bias", "w13_interleaved"),
    "down_proj": ("w2", "w2_transposed"), "down_proj_bias": ("w2_bias", "w2_transposed"),
    # MXFP4 checkpoints (kvforge.plugins.quantization.mxfp4): [E, 2I, H / 32, 16] rows interleaved, [E, H, I / 32, 16]
    "gate_up_proj_blocks": ("w13_blocks", "w13_interleaved_rows"),
    "gate_up_proj_scales": ("w13_scales", "w13_interleaved_rows"),
    "down_proj_blocks": ("w2_blocks", "w2_stacked"), "down_proj_scales": ("w2_scales", "w2_stacked")})

GPT_OSS_PRESETS: dict[str, ModelConfig] = {
    "gpt-oss-20b": GptOssConfig(  # openai/gpt-oss-20b's config.json
        architecture="GptOssForCausalLM", model_type="gpt_oss", vocab_size=201088, hidden_size=2880,
        intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
        rms_norm_eps=1e-5, rope_theta=150000.0, max_position_embeddings=131072, tie_word_embeddings=False,
        rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                      "original_max_position_embeddings": 4096},
        attention_bias=True, attention_out_bias=True, sliding_window=128, layer_types=[SLIDING, FULL] * 12,
        bos_token_id=199998, eos_token_ids=[200002], torch_dtype="bfloat16",
        hf_config={"num_local_experts": 32, "num_experts_per_tok": 4, "swiglu_limit": 7.0}),
}


class GptOssForCausalLM(LlamaForCausalLM):
    model_cls = GptOssModel
    weight_map = GPT_OSS_WEIGHTS
    config_class = GptOssConfig
    family = ModelFamily(model_types={"gpt_oss": "GptOssForCausalLM"}, presets=GPT_OSS_PRESETS)
    capabilities = ModelCapabilities(sliding_window=True, moe=True, quantization=True,
                                     notes="attention sinks (triton, torch, FA4); MXFP4 and fp8 experts")

    @classmethod
    def config_from_hf(cls, fields: ConfigFields, hf: HFConfig) -> GptOssConfig:
        """Sliding and global layers alternate (sliding first) where ``layer_types`` is missing."""
        window = fields.get("sliding_window")
        if window is not None and not hf.get("layer_types"):
            types = [SLIDING if i % 2 == 0 else FULL for i in range(fields["num_hidden_layers"])]
            fields["layer_types"] = windowed_layers(types, window)
        return GptOssConfig(**fields)
