"""Phi-3, Phi-3.5 and Phi-4 (``Phi3ForCausalLM``): Llama with fused checkpoints and LongRoPE.

The checkpoint already fuses ``self_attn.qkv_proj`` and ``mlp.gate_up_proj`` (the rows kvforge's fused
layers hold, in the same order), so its weight map fuses nothing: each loads whole through the layer's
loader, which takes this rank's heads and columns under tensor parallelism. LongRoPE
(``rope_scaling.rope_type == "longrope"``: short and long factors, an attention factor on cos/sin) and
Phi-4-mini's ``partial_rotary_factor`` are ``kvforge.layers.rotary``'s; ``sliding_window`` applies to
every layer, as in transformers. Only the data differs from Llama: this class computes nothing of its own.
"""
from __future__ import annotations

import dataclasses

from kvforge.model.config import ConfigFields, HFConfig, ModelConfig
from kvforge.model.interface import ModelCapabilities, ModelFamily
from kvforge.plugins.models.llama import LLAMA_WEIGHTS, LlamaForCausalLM, require_silu


class Phi3ForCausalLM(LlamaForCausalLM):
    #: the checkpoint's modules are the fused ones (and quantization formats name them so)
    weight_map = dataclasses.replace(LLAMA_WEIGHTS, fused={})
    family = ModelFamily(model_types={"phi3": "Phi3ForCausalLM"})
    capabilities = ModelCapabilities(sliding_window=True, notes="fused qkv/gate_up checkpoints, LongRoPE, partial rotary")

    @classmethod
    def config_from_hf(cls, fields: ConfigFields, hf: HFConfig) -> ModelConfig:
        require_silu(hf)
        return cls.config_class(**fields)
