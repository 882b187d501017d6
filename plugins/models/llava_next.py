"""LLaVA-NeXT (LLaVA-1.6): LLaVA's CLIP tower and projector over an image cut into tiles ("anyres").

The image is resized into the best of ``image_grid_pinpoints`` (the resolution that keeps most of it and
wastes least), padded, and cut into tiles of the tower's ``image_size``; a base tile (the whole image at
the tower's size) goes first. Every tile goes through the tower and the projector. The base tile gives
``g x g`` rows (``g = image_size / patch_size``); the other tiles are laid out as one feature map of
``(tiles high * g) x (tiles wide * g)``, the padding's rows or columns cut off again (to the image's aspect
ratio), and an ``image_newline`` row appended at the end of each of its rows. So an image's row count
depends on its size; the processor computes it as the model packs it (:func:`unpadded_shape`).
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

import torch
from torch import nn

from kvforge.attention import AttentionBackend
from kvforge.model.config import ConfigFields, HFConfig, ModelConfig
from kvforge.model.interface import ModelCapabilities, ModelFamily
from kvforge.multimodal.inputs import MultiModalFeature, ProcessedPrompt, expand_placeholders
from kvforge.multimodal.media import image_hash
from kvforge.plugins.models.image_processing import checkpoint_image_processor, image_processor_class
from kvforge.plugins.models.llava import LlavaForConditionalGeneration


def best_resolution(height: int, width: int, pinpoints: Sequence[Sequence[int]]) -> tuple[int, int]:
    """The (height, width) of ``pinpoints`` that keeps most of an image's pixels once it is scaled to fit,
    and of those the one that wastes least (transformers' ``select_best_resolution``)."""
    best, kept_best, waste_best = (0, 0), -1, float("inf")
    for h, w in pinpoints:
        scale = min(w / width, h / height)
        kept = min(int(width * scale) * int(height * scale), width * height)
        waste = w * h - kept
        if kept > kept_best or (kept == kept_best and waste < waste_best):
            best, kept_best, waste_best = (int(h), int(w)), kept, waste
    return best


def unpadded_shape(height: int, width: int, rows: int, cols: int) -> tuple[int, int, int]:
    """An image of ``height x width`` pixels whose tiles' feature map is ``rows x cols``: the feature map's
    rows and columns left once the padding is cut off, and how many are cut off each side (of the rows if
    the image is wider than the map, else of the columns)."""
    if width / height > cols / rows:
        pad = (rows - int(round(height * (cols / width), 7))) // 2
        return rows - 2 * pad, cols, pad
    pad = (cols - int(round(width * (rows / height), 7))) // 2
    return rows, cols - 2 * pad, pad


class LlavaNextLayout:
    """How one checkpoint tiles and packs an image: from its ``image_grid_pinpoints`` and tower sizes."""

    def __init__(self, hf: HFConfig):
        vc = hf["vision_config"]
        self.pinpoints = [list(p) for p in hf["image_grid_pinpoints"]]
        self.tile = int(vc["image_size"])
        self.grid = self.tile // int(vc["patch_size"])

    def tiles(self, height: int, width: int) -> tuple[int, int]:
        """Tiles high and wide (the base tile apart)."""
        h, w = best_resolution(height, width, self.pinpoints)
        return h // self.tile, w // self.tile

    def rows(self, height: int, width: int) -> int:
        """An image's embedding rows: the base tile's, then the unpadded map's with a newline row each."""
        th, tw = self.tiles(height, width)
        r, c, _ = unpadded_shape(height, width, th * self.grid, tw * self.grid)
        return self.grid * self.grid + r * (c + 1)


class LlavaNextProcessor:
    """Tiles by the checkpoint's image processor (``preprocessor_config.json``; a LLaVA-NeXT processor of the
    tower's size and the config's pinpoints when there is none), one ``image_token_index`` expanded per
    image to its row count."""

    modalities = ("image",)

    def __init__(self, config: ModelConfig, model_dir: str | None):
        hf = config.hf_config
        self.token_id = int(hf.get("image_token_index", hf.get("image_token_id", 32000)))
        self.layout = LlavaNextLayout(hf)
        self.image_processor = _image_processor(model_dir, self.layout)

    def profile_prompt(self) -> tuple[list[int], Any]:
        """An image of the pinpoint with the most tiles (the most tower work and rows)."""
        from PIL import Image

        h, w = max(self.layout.pinpoints, key=lambda p: (p[0] // self.layout.tile) * (p[1] // self.layout.tile))
        return [self.token_id], Image.new("RGB", (w, h))

    def process(self, prompt_token_ids: list[int], items: Mapping[str, Sequence[Any]]) -> ProcessedPrompt:
        images = list(items.get("image", ()))
        sizes = [(image.height, image.width) for image in images]
        lengths = [self.layout.rows(h, w) for h, w in sizes]
        ids, offsets = expand_placeholders(prompt_token_ids, self.token_id, lengths)
        features = []
        for image, (h, w), offset, length in zip(images, sizes, offsets, lengths):
            th, tw = self.layout.tiles(h, w)
            pixels = self.image_processor(images=[image], return_tensors="pt")["pixel_values"][0][:1 + th * tw]
            features.append(MultiModalFeature("image", {"pixel_values": pixels, "image_size": (h, w)}, offset, length,
                                              image_hash(image)))
        return ProcessedPrompt(ids, tuple(features))


def _image_processor(model_dir: str | None, layout: LlavaNextLayout) -> Any:
    size = layout.tile
    return checkpoint_image_processor(model_dir, lambda: image_processor_class("llava_next", "LlavaNextImageProcessor")(
        size={"shortest_edge": size}, crop_size={"height": size, "width": size},
        image_grid_pinpoints=layout.pinpoints))


class LlavaNextForConditionalGeneration(LlavaForConditionalGeneration):
    """The model plugin for ``LlavaNextForConditionalGeneration`` with a Llama-family text model."""

    family = ModelFamily(model_types={"llava_next": "LlavaNextForConditionalGeneration"})
    capabilities = ModelCapabilities(sliding_window=False, tensor_parallel=True, pipeline_parallel=False,
                                     quantization=False, modalities=("image",),
                                     notes="LLaVA-NeXT: anyres tiles through a CLIP tower (replicated) + MLP projector "
                                           "+ Llama decoder")

    def __init__(self, config: ModelConfig, attn: AttentionBackend):
        super().__init__(config, attn)
        self.layout = LlavaNextLayout(config.hf_config)
        self.image_newline = nn.Parameter(torch.zeros(config.hidden_size))

    @classmethod
    def config_from_hf(cls, fields: ConfigFields, hf: HFConfig) -> ModelConfig:
        if hf.get("vision_feature_select_strategy", "default") != "default":
            raise ValueError("config.json vision_feature_select_strategy must be 'default' for LLaVA-NeXT (the tiles "
                             "are packed without their CLS rows)")
        if not hf.get("image_grid_pinpoints"):
            raise ValueError("config.json has no image_grid_pinpoints; LLaVA-NeXT tiles images by them")
        return super().config_from_hf(fields, hf)

    @classmethod
    def processor(cls, config: ModelConfig, model_dir: str | None) -> LlavaNextProcessor:  # type: ignore[override]
        return LlavaNextProcessor(config, model_dir)

    def embed_multimodal(self, features: Sequence[MultiModalFeature]) -> list[torch.Tensor]:
        """Each image's rows [length, hidden]: its tiles through the tower (one batch for all images) and the
        projector, then packed (base tile, unpadded map with a newline row at the end of each row)."""
        device = self.multi_modal_projector.linear_1.weight.device
        counts = [len(f.data["pixel_values"]) for f in features]
        pixels = torch.cat([f.data["pixel_values"] for f in features]).to(device)
        tiles = self.multi_modal_projector(self.vision_tower(pixels)[:, 1:])  # [all tiles, g*g, hidden]
        out = []
        g = self.layout.grid
        for feature, rows in zip(features, tiles.split(counts)):
            h, w = feature.data["image_size"]
            th, tw = self.layout.tiles(h, w)
            grid = rows[1:].view(th, tw, g, g, -1).permute(4, 0, 2, 1, 3).reshape(rows.shape[-1], th * g, tw * g)
            r, c, pad = unpadded_shape(h, w, th * g, tw * g)
            grid = grid[:, pad:pad + r, :] if r < th * g else grid[:, :, pad:pad + c]
            newline = self.image_newline.to(grid.dtype)[:, None, None].expand(-1, r, 1)
            packed = torch.cat([grid, newline], dim=-1).flatten(1).t()  # [r * (c + 1), hidden]
            out.append(torch.cat([rows[0], packed]))
        return out

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """LLaVA's names, and ``image_newline`` (``model.image_newline`` in transformers 5)."""
        super().load_weights((name.replace("model.image_newline", "image_newline"), w) for name, w in weights)
