"""Qwen2-VL and Qwen2.5-VL: a ViT with 2-D RoPE over each image's own patches (Qwen2.5-VL: in windows of
``window_size`` pixels, but for ``fullatt_block_indexes``), a 2 x 2 patch merger, and a Qwen2 decoder that
rotates by M-RoPE (temporal, height and width positions on sections of the rotary dims).

An image is resized to multiples of 28 pixels (``smart_resize``, within ``min_pixels``/``max_pixels``) and
cut into 14 x 14 patches, two frames deep (an image is its own second frame); its ``t x h x w`` patches
become ``t*h*w/4`` embedding rows after the merger. The prompt holds one ``<|image_pad|>`` per image,
between ``<|vision_start|>`` and ``<|vision_end|>`` (text); the processor expands the pad. Each image's
M-RoPE positions come with its feature (``rope_positions``, ``rope_extent``); the engine turns them into
per-step positions (``kvforge.multimodal.mrope``), so decode steps keep 1-D positions and CUDA graphs.

The tower runs on every rank, replicated, as plain torch modules (docs/multimodal.md); attention is
non-causal within each image only (per-image segments, never an all-patches mask).
"""
from __future__ import annotations

import functools
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kvforge.attention import AttentionBackend, AttentionMetadata
from kvforge.model.config import ConfigFields, HFConfig, ModelConfig
from kvforge.model.interface import ModelCapabilities, ModelFamily
from kvforge.multimodal.inputs import MultiModalFeature, ProcessedPrompt, expand_placeholders
from kvforge.multimodal.media import image_hash
from kvforge.plugins.models.image_processing import checkpoint_image_processor, image_processor_class
from kvforge.plugins.models.llama import LlamaForCausalLM, LlamaModel, RotaryEmbedding, require_silu
from kvforge.plugins.models.llava import _act


# -- the vision tower ---------------------------------------------------------------------------------
def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cu: Sequence[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.heads, -1).unbind(1)  # [N, heads, head_dim] each
        # 2-D RoPE in float32, as transformers' apply_rotary_pos_emb_vision
        c, s = cos[:, None].float(), sin[:, None].float()
        q = (q.float() * c + _rotate_half(q.float()) * s).to(v.dtype)
        k = (k.float() * c + _rotate_half(k.float()) * s).to(v.dtype)
        out = torch.empty_like(q)
        for a, b in zip(cu[:-1], cu[1:]):  # every patch sees every patch of its own image
            out[a:b] = F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[a:b].transpose(0, 1),
                                                      v[a:b].transpose(0, 1)).transpose(0, 1)
        return self.proj(out.reshape(n, -1))


class VisionRMSNorm(nn.Module):
    """Qwen2.5-VL's tower norm: RMSNorm in float32, the weight applied in the input's dtype."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        return self.weight * (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class VisionBlock(nn.Module):
    """Qwen2-VL's block (LayerNorms, an fc1/fc2 MLP of ``mlp_ratio``) or Qwen2.5-VL's (RMSNorms, a gated MLP
    of ``intermediate_size``, its projections named ``gate``/``up``/``down`` here: the decoder's weight map
    would fuse ``gate_proj``/``up_proj``)."""

    def __init__(self, vc: Mapping[str, Any], gated: bool):
        super().__init__()
        dim = vc["hidden_size"] if gated else vc["embed_dim"]
        norm = VisionRMSNorm if gated else functools.partial(nn.LayerNorm, eps=1e-6)
        self.norm1, self.norm2 = norm(dim), norm(dim)
        self.attn = VisionAttention(dim, vc["num_heads"])
        self.gated = gated
        if gated:
            hidden = vc["intermediate_size"]
            self.mlp = nn.ModuleDict({"gate": nn.Linear(dim, hidden), "up": nn.Linear(dim, hidden),
                                      "down": nn.Linear(hidden, dim)})
        else:
            hidden = int(dim * vc.get("mlp_ratio", 4))
            self.mlp = nn.ModuleDict({"fc1": nn.Linear(dim, hidden), "fc2": nn.Linear(hidden, dim)})
        self.act = _act(vc.get("hidden_act", "silu" if gated else "quick_gelu"))

    def forward(self, x: torch.Tensor, cu: Sequence[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cu, cos, sin)
        h = self.norm2(x)
        if self.gated:
            return x + self.mlp["down"](self.act(self.mlp["gate"](h)) * self.mlp["up"](h))
        return x + self.mlp["fc2"](self.act(self.mlp["fc1"](h)))


class PatchMerger(nn.Module):
    """``m x m`` neighbouring patches (consecutive rows: the processor orders them so) into one row."""

    def __init__(self, out_dim: int, dim: int, merge: int, rms: bool = False):
        super().__init__()
        self.width = dim * merge * merge
        self.ln_q = VisionRMSNorm(dim) if rms else nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


def vision_positions(grid: Sequence[tuple[int, int, int]], merge: int) -> torch.Tensor:
    """Each patch's (row, column) in its image, [N, 2], in the processor's order (``merge x merge``
    blocks, row-major inside and between them), every frame alike."""
    out = []
    for t, h, w in grid:
        hp = torch.arange(h)[:, None].expand(h, w)
        wp = torch.arange(w)[None, :].expand(h, w)
        shape = (h // merge, merge, w // merge, merge)
        hp, wp = (p.reshape(shape).transpose(1, 2).flatten() for p in (hp, wp))
        out.append(torch.stack([hp, wp], dim=-1).repeat(t, 1))
    return torch.cat(out)


def window_order(grid: Sequence[tuple[int, int, int]], merge: int, window: int) -> tuple[np.ndarray, list[int]]:
    """Qwen2.5-VL's window attention: the order of the merged units (``merge x merge`` patches each) window
    by window (``window x window`` units, row-major, the last ones cut at the image's edge), and each
    window's patch count; transformers' ``get_vision_window_index``."""
    order, sizes, first = [], [], 0
    for t, h, w in grid:
        hh, ww = h // merge, w // merge
        units = np.arange(t * hh * ww).reshape(t, hh, ww) + first
        for f in range(t):
            for r in range(0, hh, window):
                for c in range(0, ww, window):
                    block = units[f, r:r + window, c:c + window].reshape(-1)
                    order.append(block)
                    sizes.append(len(block) * merge * merge)
        first += t * hh * ww
    return np.concatenate(order), sizes


class PatchEmbed(nn.Module):
    def __init__(self, channels: int, dim: int, frames: int, patch: int):
        super().__init__()
        self.proj = nn.Conv3d(channels, dim, (frames, patch, patch), (frames, patch, patch), bias=False)


class Qwen2VLVisionTower(nn.Module):
    """transformers' ``Qwen2VisionTransformerPretrainedModel`` (``gated=False``) or
    ``Qwen2_5_VisionTransformerPretrainedModel`` (``gated=True``: RMSNorms, gated MLPs, window attention
    except in ``fullatt_block_indexes``): flattened patches ``[N, C*T*P*P]`` of images of ``grid``
    ``(t, h, w)`` patches -> ``[N / merge^2, out]`` rows, image by image."""

    inv_freq: torch.Tensor

    def __init__(self, vc: Mapping[str, Any], gated: bool = False):
        super().__init__()
        dim = vc["hidden_size"] if gated else vc["embed_dim"]
        out = vc["out_hidden_size"] if gated else vc["hidden_size"]
        heads = vc["num_heads"]
        self.merge = vc.get("spatial_merge_size", 2)
        patch, frames, channels = vc.get("patch_size", 14), vc.get("temporal_patch_size", 2), vc.get("in_channels", 3)
        # windows of window_size pixels, in merged units (Qwen2.5-VL); None: every block sees whole images
        self.window = vc.get("window_size", 112) // self.merge // patch if gated else None
        self.full_blocks = set(vc.get("fullatt_block_indexes", ())) if gated else set()
        self.patch_embed = PatchEmbed(channels, dim, frames, patch)
        self.blocks = nn.ModuleList(VisionBlock(vc, gated) for _ in range(vc["depth"]))
        self.merger = PatchMerger(out, dim, self.merge, rms=gated)
        head_dim = dim // heads
        theta = float((vc.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        quarter = head_dim // 2
        self.register_buffer("inv_freq", 1.0 / theta ** (torch.arange(0, quarter, 2, dtype=torch.float32) / quarter),
                             persistent=False)

    def forward(self, pixels: torch.Tensor, grid: Sequence[tuple[int, int, int]]) -> torch.Tensor:
        w = self.patch_embed.proj.weight  # the Conv3d over a whole patch: a linear map of the flattened patch
        x = F.linear(pixels.to(w.dtype), w.view(w.shape[0], -1))
        pos = vision_positions(grid, self.merge).to(x.device)
        freqs = (pos[..., None].float() * self.inv_freq).flatten(1)  # [N, head_dim / 2]: rows then columns
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos(), emb.sin()
        sizes = [h * w for t, h, w in grid for _ in range(t)]  # attention within each frame of each image
        whole = np.concatenate([[0], np.cumsum(sizes)]).tolist()
        order = windows = None
        if self.window is not None:  # rows regrouped window by window (whole frames stay contiguous)
            units, window_sizes = window_order(grid, self.merge, self.window)
            order = torch.from_numpy(units).to(x.device)
            unit = self.merge * self.merge
            x, cos, sin = (t.view(-1, unit, t.shape[-1])[order].reshape(-1, t.shape[-1]) for t in (x, cos, sin))
            windows = np.concatenate([[0], np.cumsum(window_sizes)]).tolist()
        for i, block in enumerate(self.blocks):
            x = block(x, whole if windows is None or i in self.full_blocks else windows, cos, sin)
        rows = self.merger(x)
        return rows if order is None else rows[torch.argsort(order)]


# -- the decoder's M-RoPE ---------------------------------------------------------------------------
class MRotaryEmbedding(RotaryEmbedding):
    """RoPE from 1-D positions ``[T]`` (text, decode: what most steps send), or M-RoPE from ``[3, T]``
    (a step that reaches image rows): the rotary dims' first half split into ``mrope_section`` chunks,
    chunk i rotated by stream ``i % 3``'s position, the second half as the first."""

    stream: torch.Tensor

    def __init__(self, config: ModelConfig, mrope_section: Sequence[int]):
        super().__init__(config)
        half = self.rot_dim // 2
        if sum(mrope_section) != half:
            raise ValueError(f"config.json mrope_section {list(mrope_section)} must sum to half the rotary "
                             f"dimensions ({half})")
        stream = torch.cat([torch.full((n,), i % 3, dtype=torch.long) for i, n in enumerate(mrope_section)])
        self.register_buffer("stream", torch.cat([stream, stream]), persistent=False)

    def bind(self, positions: torch.Tensor, like: torch.Tensor, meta: AttentionMetadata) -> Any:
        if positions.dim() == 1:
            return super().bind(positions, like, meta)
        # [3, T, rot] rows of each stream, then each rotary dim from its stream
        idx = self.stream[None, None, :].expand(1, positions.shape[1], -1)
        cos = self.cos[positions].gather(0, idx)[0].to(like.dtype)[:, None]
        sin = self.sin[positions].gather(0, idx)[0].to(like.dtype)[:, None]
        return functools.partial(self.forward, positions[0], tables=(cos, sin))


def mrope_section(hf: HFConfig) -> list[int]:
    """The config's ``mrope_section``: transformers 5's ``text_config.rope_parameters``, or 4.x's top-level
    ``rope_scaling`` (``{"type": "mrope", ...}``)."""
    for d in (hf.get("text_config") or {}, hf):
        for key in ("rope_parameters", "rope_scaling"):
            section = (d.get(key) or {}).get("mrope_section")
            if section:
                return [int(n) for n in section]
    raise ValueError("config.json has no mrope_section (text_config.rope_parameters or rope_scaling)")


class Qwen2VLTextModel(LlamaModel):
    def __init__(self, config: ModelConfig, attn: AttentionBackend):
        super().__init__(config, attn)
        self.rotary_emb = MRotaryEmbedding(config, mrope_section(config.hf_config))


# -- processor --------------------------------------------------------------------------------------
class Qwen2VLProcessor:
    """Pixels and grids by the checkpoint's image processor (``preprocessor_config.json``; transformers'
    Qwen2-VL defaults when there is none), one ``image_token_id`` expanded per image to its merged rows;
    each feature carries its M-RoPE positions."""

    modalities = ("image",)

    def __init__(self, config: ModelConfig, model_dir: str | None):
        hf = config.hf_config
        vc = hf["vision_config"]
        self.token_id = int(hf.get("image_token_id", 151655))
        self.merge = int(vc.get("spatial_merge_size", 2))
        self.image_processor = _image_processor(model_dir, vc)

    def profile_prompt(self) -> tuple[list[int], Any]:
        """A square image of the processor's ``max_pixels`` (the most patches it makes)."""
        from PIL import Image

        ip = self.image_processor
        most = getattr(ip, "max_pixels", None) or (getattr(ip, "size", None) or {}).get("longest_edge") or 28 * 28 * 1280
        side = max(28, int(int(most) ** 0.5) // 28 * 28)
        return [self.token_id], Image.new("RGB", (side, side))

    def process(self, prompt_token_ids: list[int], items: Mapping[str, Sequence[Any]]) -> ProcessedPrompt:
        images = list(items.get("image", ()))
        done = [self.image_processor(images=[image], return_tensors="pt") for image in images]
        grids = [tuple(int(v) for v in d["image_grid_thw"][0]) for d in done]
        lengths = [t * h * w // self.merge ** 2 for t, h, w in grids]
        ids, offsets = expand_placeholders(prompt_token_ids, self.token_id, lengths)
        features = []
        for image, d, grid, offset, length in zip(images, done, grids, offsets, lengths):
            t, h, w = grid[0], grid[1] // self.merge, grid[2] // self.merge
            k = np.arange(length, dtype=np.int64)
            rope = np.stack([k // (h * w), (k % (h * w)) // w, k % w])  # (frame, row, column) of each row
            features.append(MultiModalFeature("image", {"pixel_values": d["pixel_values"], "grid": grid}, offset,
                                              length, image_hash(image), rope_positions=rope,
                                              rope_extent=max(t, h, w)))
        return ProcessedPrompt(ids, tuple(features))


def _image_processor(model_dir: str | None, vc: Mapping[str, Any]) -> Any:
    return checkpoint_image_processor(model_dir, lambda: image_processor_class("qwen2_vl", "Qwen2VLImageProcessor")(
        patch_size=vc.get("patch_size", 14), merge_size=vc.get("spatial_merge_size", 2),
        temporal_patch_size=vc.get("temporal_patch_size", 2)))


# -- the model --------------------------------------------------------------------------------------
class Qwen2VLForConditionalGeneration(LlamaForCausalLM):
    """The model plugin for ``Qwen2VLForConditionalGeneration``."""

    model_cls = Qwen2VLTextModel
    family = ModelFamily(model_types={"qwen2_vl": "Qwen2VLForConditionalGeneration"})
    capabilities = ModelCapabilities(sliding_window=False, tensor_parallel=True, pipeline_parallel=False,
                                     quantization=False, modalities=("image",),
                                     notes="Qwen2-VL: ViT with 2-D RoPE (replicated) + patch merger + Qwen2 decoder "
                                           "with M-RoPE")

    #: Qwen2.5-VL's tower (RMSNorms, gated MLPs, window attention) rather than Qwen2-VL's
    gated_tower = False

    def __init__(self, config: ModelConfig, attn: AttentionBackend):
        super().__init__(config, attn)
        self.visual = Qwen2VLVisionTower(config.hf_config["vision_config"], gated=self.gated_tower)

    @classmethod
    def config_from_hf(cls, fields: ConfigFields, hf: HFConfig) -> ModelConfig:
        """Qwen2's rules (q/k/v biases, none on o_proj, silu), the outer ``tie_word_embeddings``, and the
        M-RoPE section read apart (the rotary cache itself is plain RoPE)."""
        if "vision_config" not in hf:
            raise ValueError("config.json has no vision_config; Qwen2-VL needs its vision tower's")
        require_silu(hf.get("text_config") or hf)
        mrope_section(hf)  # present, or a ValueError naming it
        fields["attention_bias"], fields["attention_out_bias"] = True, False
        fields["rope_scaling"] = None  # {"type": "mrope"} in 4.x configs: M-RoPE is this class's own
        if "tie_word_embeddings" in hf:
            fields["tie_word_embeddings"] = bool(hf["tie_word_embeddings"])
        return cls.config_class(**fields)

    @classmethod
    def processor(cls, config: ModelConfig, model_dir: str | None) -> Qwen2VLProcessor:
        return Qwen2VLProcessor(config, model_dir)

    def embed_multimodal(self, features: Sequence[MultiModalFeature]) -> list[torch.Tensor]:
        """Each image's embedding rows [length, hidden], in the model's dtype, on its device."""
        device = self.visual.merger.ln_q.weight.device
        pixels = torch.cat([f.data["pixel_values"] for f in features]).to(device)
        rows = self.visual(pixels, [f.data["grid"] for f in features])
        return list(rows.split([f.length for f in features]))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed(input_ids)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """transformers 5's names (``model.visual.*``, ``model.language_model.*``) or the hub's
        (``visual.*``, ``model.*``), renamed to this module's and loaded as the Llama family's."""
        def renamed() -> Iterable[tuple[str, torch.Tensor]]:
            for name, w in weights:
                name = name.replace("model.language_model.", "model.")
                if name.startswith("model.visual."):
                    name = name.removeprefix("model.")
                if name.startswith("visual."):  # (the decoder's weight map would fuse gate_proj/up_proj)
                    for proj in ("gate", "up", "down"):
                        name = name.replace(f".mlp.{proj}_proj.", f".mlp.{proj}.")
                yield name, w

        super().load_weights(renamed())


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """The model plugin for ``Qwen2_5_VLForConditionalGeneration``: Qwen2-VL with Qwen2.5-VL's tower."""

    family = ModelFamily(model_types={"qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration"})
    gated_tower = True
    capabilities = ModelCapabilities(sliding_window=False, tensor_parallel=True, pipeline_parallel=False,
                                     quantization=False, modalities=("image",),
                                     notes="Qwen2.5-VL: ViT with window attention and 2-D RoPE (replicated) + "
                                           "patch merger + Qwen2 decoder with M-RoPE")
