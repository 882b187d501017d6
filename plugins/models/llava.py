"""LLaVA (-1.5 style): a CLIP vision tower and an MLP projector in front of a Llama-family decoder.

An image becomes ``(image_size / patch_size)^2`` embedding rows (the CLS row dropped, transformers'
``vision_feature_select_strategy="default"``; one more with ``"full"``): the tower's hidden states at
``vision_feature_layer``, through the projector. The prompt holds one ``image_token_index`` token where
each image goes; the processor expands it to that many positions (docs/multimodal.md).

The tower runs on every rank, replicated (docs/multimodal.md says why), as plain torch modules: it is
non-causal over one image's patches and keeps no KV cache. The decoder is kvforge's Llama.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kvforge.attention import AttentionBackend
from kvforge.model.config import ConfigFields, HFConfig, ModelConfig
from kvforge.model.interface import ModelCapabilities, ModelFamily
from kvforge.multimodal.inputs import MultiModalFeature, ProcessedPrompt, expand_placeholders
from kvforge.multimodal.media import image_hash
from kvforge.plugins.models.image_processing import checkpoint_image_processor
from kvforge.plugins.models.llama import LlamaForCausalLM

_ACTS = {"quick_gelu": lambda x: x * torch.sigmoid(1.702 * x), "gelu": F.gelu,
         "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu}


def _act(name: str):
    if name not in _ACTS:
        raise ValueError(f"config.json activation {name!r} is not supported (supported: {', '.join(_ACTS)})")
    return _ACTS[name]


class CLIPAttention(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        # NOTE: named apart from the decoder's q_proj/k_proj/v_proj, which the Llama weight map fuses;
        # load_weights renames the checkpoint's tower projections to these
        self.q, self.k, self.v = (nn.Linear(hidden, hidden) for _ in range(3))
        self.out = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = (p(x).view(b, t, self.heads, h // self.heads).transpose(1, 2)
                   for p in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v)  # every patch sees every patch of its image
        return self.out(out.transpose(1, 2).reshape(b, t, h))


class CLIPMLP(nn.Module):
    def __init__(self, vc: Mapping[str, Any]):
        super().__init__()
        self.fc1 = nn.Linear(vc["hidden_size"], vc["intermediate_size"])
        self.fc2 = nn.Linear(vc["intermediate_size"], vc["hidden_size"])
        self.act = _act(vc.get("hidden_act", "quick_gelu"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class CLIPEncoderLayer(nn.Module):
    def __init__(self, vc: Mapping[str, Any]):
        super().__init__()
        hidden, eps = vc["hidden_size"], vc.get("layer_norm_eps", 1e-5)
        self.self_attn = CLIPAttention(hidden, vc["num_attention_heads"])
        self.layer_norm1 = nn.LayerNorm(hidden, eps=eps)
        self.mlp = CLIPMLP(vc)
        self.layer_norm2 = nn.LayerNorm(hidden, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class CLIPEmbeddings(nn.Module):
    def __init__(self, vc: Mapping[str, Any]):
        super().__init__()
        hidden, patch = vc["hidden_size"], vc["patch_size"]
        self.patch_embedding = nn.Conv2d(vc.get("num_channels", 3), hidden, patch, patch, bias=False)
        self.class_embedding = nn.Parameter(torch.empty(hidden))
        self.position_embedding = nn.Embedding((vc["image_size"] // patch) ** 2 + 1, hidden)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[n, 3, H, W] -> [n, 1 + patches, hidden]: the CLS row, then the patches, positions added."""
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(len(patches), 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight[None, :patches.shape[1] + 1]


class CLIPEncoder(nn.Module):
    def __init__(self, vc: Mapping[str, Any], num_layers: int):
        super().__init__()
        self.layers = nn.ModuleList(CLIPEncoderLayer(vc) for _ in range(num_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class CLIPVisionTower(nn.Module):
    """transformers' ``CLIPVisionModel`` up to the layer whose hidden states LLaVA reads. A tower class
    (``LlavaForConditionalGeneration.vision_tower_cls``) is built as ``cls(vision_config, num_layers)``,
    maps pixels to [n, rows(vision_config), hidden], and names its parameters as the checkpoint's
    ``vision_model.*`` tensors (attention projections ``q``/``k``/``v``/``out``)."""

    @staticmethod
    def rows(vc: Mapping[str, Any]) -> int:
        """Rows per image: the CLS row and one per patch."""
        return (vc["image_size"] // vc["patch_size"]) ** 2 + 1

    def __init__(self, vc: Mapping[str, Any], num_layers: int):
        super().__init__()
        self.embeddings = CLIPEmbeddings(vc)
        self.pre_layrnorm = nn.LayerNorm(vc["hidden_size"], eps=vc.get("layer_norm_eps", 1e-5))
        self.encoder = CLIPEncoder(vc, num_layers)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[n, 3, H, W] -> [n, 1 + patches, hidden]: the hidden states after the layers it holds."""
        return self.encoder(self.pre_layrnorm(self.embeddings(pixel_values)))


class LlavaProjector(nn.Module):
    def __init__(self, vision_hidden: int, text_hidden: int, act: str):
        super().__init__()
        self.linear_1 = nn.Linear(vision_hidden, text_hidden)
        self.linear_2 = nn.Linear(text_hidden, text_hidden)
        self.act = _act(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaProcessor:
    """Pixels by the checkpoint's image processor (``preprocessor_config.json``; a CLIP processor of the
    tower's image size when there is none), one ``image_token_index`` expanded per image."""

    modalities = ("image",)

    def __init__(self, config: ModelConfig, model_dir: str | None, tower_rows: int):
        """``tower_rows``: the rows the vision tower gives per image (the CLS row is dropped unless the
        feature selection is ``full``)."""
        hf = config.hf_config
        vc = hf["vision_config"]
        self.token_id = int(hf.get("image_token_index", hf.get("image_token_id", 32000)))
        self.length = tower_rows - (hf.get("vision_feature_select_strategy", "default") != "full")
        self.size = int(vc["image_size"])
        self.image_processor = _image_processor(model_dir, vc["image_size"])

    def profile_prompt(self) -> tuple[list[int], Any]:
        """Every image costs the same (it is resized to the tower's size)."""
        from PIL import Image

        return [self.token_id], Image.new("RGB", (self.size, self.size))

    def process(self, prompt_token_ids: list[int], items: Mapping[str, Sequence[Any]]) -> ProcessedPrompt:
        images = list(items.get("image", ()))
        ids, offsets = expand_placeholders(prompt_token_ids, self.token_id, [self.length] * len(images))
        features = []
        for image, offset in zip(images, offsets):
            pixels = self.image_processor(images=[image], return_tensors="pt")["pixel_values"]
            features.append(MultiModalFeature("image", {"pixel_values": pixels}, offset, self.length,
                                              image_hash(image)))
        return ProcessedPrompt(ids, tuple(features))


def _image_processor(model_dir: str | None, size: int) -> Any:
    def clip() -> Any:
        from transformers import CLIPImageProcessor

        return CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
    return checkpoint_image_processor(model_dir, clip)


class LlavaForConditionalGeneration(LlamaForCausalLM):
    """The model plugin for ``LlavaForConditionalGeneration`` with a Llama-family text model."""

    family = ModelFamily(model_types={"llava": "LlavaForConditionalGeneration"})
    #: the vision tower's class (a subclass of this model with another tower swaps it: the dummy plugin's
    #: SigLIP LLaVA)
    vision_tower_cls: Any = CLIPVisionTower  # (a class with rows(): typed loosely, as a plugin's is not CLIP's)
    #: the vision_config model types the tower reads
    vision_model_types: tuple[str, ...] = ("clip_vision_model",)
    capabilities = ModelCapabilities(sliding_window=False, tensor_parallel=True, pipeline_parallel=False,
                                     quantization=False, modalities=("image",),
                                     notes="LLaVA-1.5: CLIP tower (replicated) + MLP projector + Llama decoder")

    def __init__(self, config: ModelConfig, attn: AttentionBackend):
        super().__init__(config, attn)
        hf = config.hf_config
        vc = hf["vision_config"]
        layer = int(hf.get("vision_feature_layer", -2))
        total = vc["num_hidden_layers"]
        self.vision_layers = layer if layer >= 0 else total + 1 + layer  # layers run: hidden_states[layer]
        self.vision_tower = self.vision_tower_cls(vc, self.vision_layers)
        self.multi_modal_projector = LlavaProjector(vc["hidden_size"], config.hidden_size,
                                                    hf.get("projector_hidden_act", "gelu"))
        self.keep_cls = hf.get("vision_feature_select_strategy", "default") == "full"

    @classmethod
    def config_from_hf(cls, fields: ConfigFields, hf: HFConfig) -> ModelConfig:
        text_type = (hf.get("text_config") or {}).get("model_type", "llama")
        if text_type not in ("llama", "mistral", "qwen2"):
            raise ValueError(f"config.json text_config.model_type is {text_type!r}; LLaVA runs a Llama, "
                             "Mistral or Qwen2 decoder")
        vision_type = (hf.get("vision_config") or {}).get("model_type") or "clip_vision_model"
        if "vision_config" not in hf or vision_type not in cls.vision_model_types:
            raise ValueError(f"config.json vision_config.model_type is {vision_type!r}; {cls.__name__} reads "
                             f"{', '.join(cls.vision_model_types)}")
        return cls.config_class(**fields)

    @classmethod
    def processor(cls, config: ModelConfig, model_dir: str | None) -> LlavaProcessor:
        rows = cls.vision_tower_cls.rows(config.hf_config["vision_config"])
        return LlavaProcessor(config, model_dir, rows)

    def embed_multimodal(self, features: Sequence[MultiModalFeature]) -> list[torch.Tensor]:
        """Each image's embedding rows [length, hidden], in the model's dtype, on its device."""
        device = self.multi_modal_projector.linear_1.weight.device
        pixels = torch.cat([f.data["pixel_values"] for f in features]).to(device)
        hidden = self.vision_tower(pixels)
        if not self.keep_cls:
            hidden = hidden[:, 1:]
        rows = self.multi_modal_projector(hidden)
        return list(rows)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed(input_ids)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """transformers 5's names (``model.language_model.*``, ``model.vision_tower.*``, ...) or 4.x's
        (``language_model.model.*``, ``vision_tower.*``, ...), renamed to this module's and loaded as the
        Llama family's (``ValueError`` on an unknown name or one left unfilled); the tower's layers past
        ``vision_feature_layer`` and its final norm are not used, so not loaded."""
        def renamed() -> Iterable[tuple[str, torch.Tensor]]:
            for name, w in weights:
                if not name.startswith("model.language_model."):
                    name = name.removeprefix("model.")
                if name.startswith("vision_tower."):
                    name = name.replace("vision_tower.vision_model.", "vision_tower.")
                    parts = name.split(".")
                    if name.startswith(("vision_tower.post_layernorm.", "vision_tower.head.")) or (
                            name.startswith("vision_tower.encoder.layers.") and int(parts[3]) >= self.vision_layers):
                        continue
                    for proj in ("q", "k", "v", "out"):
                        name = name.replace(f".self_attn.{proj}_proj.", f".self_attn.{proj}.")
                elif not name.startswith("multi_modal_projector."):
                    name = name.replace("model.language_model.", "model.").replace("language_model.model.", "model.")
                    name = name.replace("language_model.lm_head.", "lm_head.")
                yield name, w

        super().load_weights(renamed())
