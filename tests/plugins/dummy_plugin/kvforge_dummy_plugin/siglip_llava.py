"""A vision-language model as a third-party plugin (issue 39's proof of the multimodal contract): LLaVA with
a SigLIP vision tower instead of CLIP, as LLaVA variants and Gemma 3 use. Built from kvforge's public
parts: the built-in LLaVA swaps its ``vision_tower_cls``, and the tower reuses the CLIP encoder layers
(SigLIP's have the same shape and names).

transformers' SigLIP vision embeddings: a biased patch convolution and one learned position per patch,
no CLS row and no layer norm before the encoder; its final norm and pooling head are not read by LLaVA.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from kvforge.model import ModelCapabilities, ModelFamily
from kvforge.plugins.models.llava import CLIPEncoder, LlavaForConditionalGeneration


class SiglipEmbeddings(nn.Module):
    def __init__(self, vc: Mapping[str, Any]):
        super().__init__()
        hidden, patch = vc["hidden_size"], vc["patch_size"]
        self.patch_embedding = nn.Conv2d(vc.get("num_channels", 3), hidden, patch, patch)
        self.position_embedding = nn.Embedding((vc["image_size"] // patch) ** 2, hidden)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        return patches + self.position_embedding.weight[None]


class SiglipVisionTower(nn.Module):
    """transformers' ``SiglipVisionModel`` up to the layer LLaVA reads."""

    @staticmethod
    def rows(vc: Mapping[str, Any]) -> int:
        return (vc["image_size"] // vc["patch_size"]) ** 2  # one per patch: SigLIP has no CLS row

    def __init__(self, vc: Mapping[str, Any], num_layers: int):
        super().__init__()
        self.embeddings = SiglipEmbeddings(vc)
        self.encoder = CLIPEncoder({**vc, "hidden_act": vc.get("hidden_act", "gelu_pytorch_tanh")}, num_layers)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.encoder(self.embeddings(pixel_values))


class SiglipLlavaForConditionalGeneration(LlavaForConditionalGeneration):
    """LLaVA whose ``vision_config`` is a SigLIP tower (``siglip_vision_model``)."""

    family = ModelFamily()
    vision_tower_cls = SiglipVisionTower
    vision_model_types = ("siglip_vision_model",)
    capabilities = ModelCapabilities(sliding_window=False, tensor_parallel=True, pipeline_parallel=False,
                                     quantization=False, modalities=("image",),
                                     notes="a third-party plugin's LLaVA with a SigLIP tower")
