"""Gemma 3 with images (``Gemma3ForConditionalGeneration``): a SigLIP tower, an average-pooling projector,
and Gemma 3's decoder, whose image rows attend to each other both ways.

An image is resized to the tower's square ``image_size`` (896: 64 x 64 patches of 14); the projector pools
the patches to ``mm_tokens_per_image`` rows (256: 16 x 16, average over 4 x 4), norms them (Gemma's
``1 + w`` RMSNorm) and projects them into the decoder's width. In the prompt each image is one
``<start_of_image>`` token (``boi_token_index``), which the processor replaces by ``\\n\\n`` (when the
checkpoint's tokenizer has that token), ``<start_of_image>``, the image's rows, ``<end_of_image>`` and
``\\n\\n``, as transformers' Gemma3Processor does in text.

In the decoder an image's rows see each other both ways (transformers' ``token_type_ids`` mask): each
feature is ``bidirectional``, so no prompt chunk ends inside an image (``kvforge.multimodal.spans``) and the
model needs an attention backend with ``bidirectional_spans`` (``torch``; docs/multimodal.md).
"""
from __future__ import annotations

import os
from typing import Any, Iterable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kvforge.attention import AttentionBackend
from kvforge.model.config import ConfigFields, HFConfig, ModelConfig
from kvforge.model.interface import ModelCapabilities, ModelFamily
from kvforge.multimodal.inputs import MultiModalFeature, ProcessedPrompt
from kvforge.multimodal.media import image_hash
from kvforge.plugins.models.gemma import GemmaConfig, GemmaForCausalLM, GemmaRMSNorm
from kvforge.plugins.models.image_processing import checkpoint_image_processor, image_processor_class
from kvforge.plugins.models.llava import CLIPEncoder


class SiglipVisionTower(nn.Module):
    """transformers' ``SiglipVisionModel`` without its head: patches (a biased convolution) plus positions,
    the encoder (CLIP's layer shape: ``kvforge.plugins.models.llava.CLIPEncoder``), the final LayerNorm."""

    def __init__(self, vc: Mapping[str, Any]):
        super().__init__()
        hidden, patch = vc["hidden_size"], vc["patch_size"]
        self.patch_embedding = nn.Conv2d(vc.get("num_channels", 3), hidden, patch, patch)
        self.position_embedding = nn.Embedding((vc["image_size"] // patch) ** 2, hidden)
        self.encoder = CLIPEncoder(dict(vc, hidden_act=vc.get("hidden_act", "gelu_pytorch_tanh")),
                                   vc["num_hidden_layers"])
        self.post_layernorm = nn.LayerNorm(hidden, eps=vc.get("layer_norm_eps", 1e-6))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[n, 3, H, W] -> [n, patches, hidden]."""
        x = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        return self.post_layernorm(self.encoder(x + self.position_embedding.weight[None]))


class Gemma3Projector(nn.Module):
    """Average-pool the patch grid to ``mm_tokens_per_image`` rows, norm, project to the decoder's width."""

    def __init__(self, hf: HFConfig, text_hidden: int):
        super().__init__()
        vc = hf["vision_config"]
        self.side = vc["image_size"] // vc["patch_size"]
        self.kernel = self.side // int(int(hf.get("mm_tokens_per_image", 256)) ** 0.5)
        self.mm_soft_emb_norm = GemmaRMSNorm(vc["hidden_size"], vc.get("layer_norm_eps", 1e-6))
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(vc["hidden_size"], text_hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, _, hidden = x.shape
        grid = x.transpose(1, 2).reshape(n, hidden, self.side, self.side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)  # [n, rows, hidden]
        normed = self.mm_soft_emb_norm(pooled.reshape(-1, hidden)).view(pooled.shape)
        return (normed @ self.mm_input_projection_weight).to(x.dtype)


class Gemma3Processor:
    """Pixels by the checkpoint's image processor (transformers' Gemma 3 defaults at the tower's size when
    there is none); each ``<start_of_image>`` becomes the image's whole span."""

    modalities = ("image",)

    def __init__(self, config: ModelConfig, model_dir: str | None):
        hf = config.hf_config
        self.boi, self.eoi = int(hf.get("boi_token_index", 255999)), int(hf.get("eoi_token_index", 256000))
        self.image_token = int(hf.get("image_token_index", 262144))
        self.rows = int(hf.get("mm_tokens_per_image", 256))
        self.newline = _double_newline(model_dir)
        self.size = int(hf["vision_config"]["image_size"])
        self.image_processor = _image_processor(model_dir, self.size)

    def profile_prompt(self) -> tuple[list[int], Any]:
        """Every image costs the same (it is resized to the tower's size)."""
        from PIL import Image

        return [self.boi], Image.new("RGB", (self.size, self.size))

    def process(self, prompt_token_ids: list[int], items: Mapping[str, Sequence[Any]]) -> ProcessedPrompt:
        images = list(items.get("image", ()))
        found = prompt_token_ids.count(self.boi)
        if found != len(images):
            raise ValueError(f"multi_modal_data: the prompt has {found} <start_of_image> token(s) (token {self.boi}) "
                             f"for {len(images)} image(s); put one where each image goes")
        nl = [] if self.newline is None else [self.newline]
        ids: list[int] = []
        features = []
        it = iter(images)
        for t in prompt_token_ids:
            if t != self.boi:
                ids.append(t)
                continue
            image = next(it)
            ids += [*nl, self.boi]
            pixels = self.image_processor(images=[image], return_tensors="pt")["pixel_values"]
            features.append(MultiModalFeature("image", {"pixel_values": pixels}, len(ids), self.rows, image_hash(image),
                                              bidirectional=True))
            ids += [self.image_token] * self.rows + [self.eoi, *nl]
        return ProcessedPrompt(ids, tuple(features))


def _double_newline(model_dir: str | None) -> int | None:
    """The id of ``\\n\\n`` in the checkpoint's tokenizer (Gemma's vocabulary has it), None without one."""
    if model_dir is None or not os.path.exists(os.path.join(model_dir, "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model_dir, local_files_only=True).encode("\n\n", add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


def _image_processor(model_dir: str | None, size: int) -> Any:
    return checkpoint_image_processor(model_dir, lambda: image_processor_class("gemma3", "Gemma3ImageProcessor")(
        size={"height": size, "width": size}))


class Gemma3ForConditionalGeneration(GemmaForCausalLM):
    """The model plugin for ``Gemma3ForConditionalGeneration``: Gemma 3 (4B, 12B, 27B) with images."""

    family = ModelFamily(model_types={"gemma3": "Gemma3ForConditionalGeneration"})
    capabilities = ModelCapabilities(sliding_window=True, tensor_parallel=True, pipeline_parallel=False,
                                     quantization=False, modalities=("image",),
                                     notes="Gemma 3: SigLIP tower (replicated) + pooling projector + Gemma 3 decoder, "
                                           "image rows attending both ways")

    def __init__(self, config: GemmaConfig, attn: AttentionBackend):
        super().__init__(config, attn)
        self.vision_tower = SiglipVisionTower(config.hf_config["vision_config"])
        self.multi_modal_projector = Gemma3Projector(config.hf_config, config.hidden_size)

    @classmethod
    def config_from_hf(cls, fields: ConfigFields, hf: HFConfig) -> GemmaConfig:
        """Gemma 3's text rules over ``text_config`` (the outer ``model_type`` is ``gemma3``), the outer
        ``tie_word_embeddings``."""
        vision_type = (hf.get("vision_config") or {}).get("model_type")
        if vision_type != "siglip_vision_model":
            raise ValueError(f"config.json vision_config.model_type is {vision_type!r}; Gemma 3 reads a "
                             "siglip_vision_model")
        fields["model_type"] = "gemma3_text"
        if "tie_word_embeddings" in hf:
            fields["tie_word_embeddings"] = bool(hf["tie_word_embeddings"])
        config = super().config_from_hf(fields, dict(hf.get("text_config") or {}))
        return config

    @classmethod
    def attention_features(cls, config: ModelConfig) -> Iterable[str]:
        return ("bidirectional_spans",)  # an image's rows see each other

    @classmethod
    def processor(cls, config: ModelConfig, model_dir: str | None) -> Gemma3Processor:
        return Gemma3Processor(config, model_dir)

    def embed_multimodal(self, features: Sequence[MultiModalFeature]) -> list[torch.Tensor]:
        """Each image's rows [mm_tokens_per_image, hidden], in the model's dtype, on its device."""
        device = self.multi_modal_projector.mm_input_projection_weight.device
        pixels = torch.cat([f.data["pixel_values"] for f in features]).to(device)
        return list(self.multi_modal_projector(self.vision_tower(pixels)))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed(input_ids)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """transformers 5's names (``model.language_model.*``, ``model.vision_tower.*``...) or the hub's
        (``language_model.model.*``, ``vision_tower.vision_model.*``...), renamed to this module's."""
        def renamed() -> Iterable[tuple[str, torch.Tensor]]:
            for name, w in weights:
                name = name.replace("model.language_model.", "model.").replace("language_model.model.", "model.")
                name = name.replace("language_model.lm_head.", "lm_head.")
                for part in ("vision_tower.", "multi_modal_projector."):
                    if name.startswith("model." + part):
                        name = name.removeprefix("model.")
                if name.startswith("vision_tower."):
                    name = name.replace("vision_tower.vision_model.", "vision_tower.")
                    name = name.replace("vision_tower.embeddings.", "vision_tower.")
                    for proj in ("q", "k", "v", "out"):  # (the decoder's weight map would fuse q/k/v_proj)
                        name = name.replace(f".self_attn.{proj}_proj.", f".self_attn.{proj}.")
                yield name, w

        super().load_weights(renamed())
