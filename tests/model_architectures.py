"""Tiny random Hugging Face models of each supported architecture, built offline by transformers from a
small config (no download) and saved as safetensors: shared by the architecture tests and the template
in docs/adding_a_model.md."""
from __future__ import annotations

from typing import Any

import torch
import transformers

from kvforge.plugins.models.image_processing import image_processor_class

VOCAB = 128
WINDOW = 24  # shorter than the test prompts: sliding-window layers really slide

_BASE: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                             rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                             tie_word_embeddings=False)
_ALTERNATING = ["sliding_attention", "full_attention"]
_MOE: dict[str, Any] = dict(num_experts_per_tok=2, moe_intermediate_size=32)

#: test id -> (model_type, config fields over _BASE)
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "mistral-window": ("mistral", dict(sliding_window=WINDOW)),
    "gemma2": ("gemma2", dict(sliding_window=WINDOW, layer_types=_ALTERNATING, query_pre_attn_scalar=32,
                              attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                              hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)),
    "gemma3": ("gemma3_text", dict(num_hidden_layers=4, sliding_window=WINDOW, layer_types=_ALTERNATING * 2,
                                   query_pre_attn_scalar=16, tie_word_embeddings=True,
                                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                    "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                       "rope_theta": 1000000.0}})),
    # LongRoPE switches to its long factors once a sequence is longer than original_max_position_embeddings;
    # a forward without a cache (the reference) then re-rotates every earlier key too, a cached engine
    # cannot: so one config is always past the switch (long factors), the other never (short factors)
    "phi3-longrope-long": ("phi3", dict(original_max_position_embeddings=4,
                                        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                         "short_factor": [1.0 + 0.1 * i for i in range(8)],
                                                         "long_factor": [2.0 + 0.5 * i for i in range(8)],
                                                         "original_max_position_embeddings": 4})),
    "phi4-mini-longrope-short-partial-rotary": (
        "phi3", dict(original_max_position_embeddings=256, tie_word_embeddings=True,
                     rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                                      "short_factor": [1.0 + 0.1 * i for i in range(6)],
                                      "long_factor": [2.0 + 0.5 * i for i in range(6)],
                                      "original_max_position_embeddings": 256})),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen2-moe": ("qwen2_moe", dict(num_experts=4, shared_expert_intermediate_size=48, norm_topk_prob=False,
                                    mlp_only_layers=[1], **_MOE)),
    "qwen3-moe": ("qwen3_moe", dict(num_experts=4, norm_topk_prob=True, **_MOE)),
    "gpt-oss": ("gpt_oss", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
                                layer_types=_ALTERNATING, intermediate_size=32,
                                rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0,
                                                 "beta_slow": 1.0, "truncate": False,
                                                 "original_max_position_embeddings": 64, "rope_theta": 150000.0})),
}


def build(test_id: str, path: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """Build the transformers model of ``CONFIGS[test_id]`` (config fields replaced by ``overrides``) with
    every weight perturbed (norms, biases, sinks and routers too, so that all of it is tested), save it to
    ``path``; returns it in float32."""
    model_type, fields = CONFIGS[test_id]
    config = transformers.AutoConfig.for_model(model_type, **{**_BASE, **fields, **overrides})
    config._attn_implementation = "eager"  # soft-capping and sinks are eager-only in some versions
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path, safe_serialization=True)
    return model


#: the tiny LLaVA's image placeholder token and the embedding rows of each image ((28 / 14)^2 patches)
LLAVA_IMAGE_TOKEN, LLAVA_IMAGE_ROWS = 100, 4


#: a LLaVA-style chat template: an image part is the <image> token where it stands
LLAVA_CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {% if m['content'] is string %}{{ m['content'] }}"
                       "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<image>{% else %}"
                       "{{ p['text'] }}{% endif %}{% endfor %}{% endif %}\n{% endfor %}"
                       "{% if add_generation_prompt %}assistant:{% endif %}")


def _saved_perturbed(model_cls: Any, config: Any, path: str, seed: int) -> torch.nn.Module:
    """``model_cls(config)`` in float32 with every weight perturbed (seeded), saved to ``path``."""
    torch.manual_seed(seed)
    model = model_cls(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(path, safe_serialization=True)
    return model


def build_llava(path: str, seed: int = 0, tokenizer: Any = None, **text_fields: Any) -> torch.nn.Module:
    """A tiny random LLaVA-1.5 (CLIP tower of 3 layers on 28x28 images in 14x14 patches, MLP projector,
    a Llama decoder of ``_BASE``'s shape), every weight perturbed, saved with its image processor to
    ``path``; returns it in float32. ``tokenizer``: saved with it, an ``<image>`` token and
    :data:`LLAVA_CHAT_TEMPLATE` added, the vocabulary its size (else ``VOCAB`` ids, token
    :data:`LLAVA_IMAGE_TOKEN` the image's). ``text_fields``: the decoder's config fields over ``_BASE``'s."""
    base = dict(_BASE, **text_fields)
    image_token = LLAVA_IMAGE_TOKEN
    if tokenizer is not None:
        tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
        tokenizer.chat_template = LLAVA_CHAT_TEMPLATE
        tokenizer.save_pretrained(path)
        base["vocab_size"], image_token = len(tokenizer), tokenizer.convert_tokens_to_ids("<image>")
    text = transformers.LlamaConfig(**base)
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                           num_attention_heads=4, image_size=28, patch_size=14, projection_dim=32)
    config = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_token,
                                      vision_feature_layer=-2, vision_feature_select_strategy="default",
                                      projector_hidden_act="gelu")
    model = _saved_perturbed(transformers.LlavaForConditionalGeneration, config, path, seed)
    transformers.CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}).save_pretrained(path)
    return model


#: the tiny Qwen2-VL's image pad token (its vision start and end tokens are the next two ids)
QWEN2VL_IMAGE_TOKEN = 100


def build_qwen2_vl(path: str, seed: int = 0, version: str = "2", **text_fields: Any) -> torch.nn.Module:
    """A tiny random Qwen2-VL (a 2-layer ViT of width 32 over 14x14 patches, 2x2 merger, a Qwen2 decoder
    of ``_BASE``'s shape with M-RoPE), every weight perturbed, saved with an image processor of at most
    16 merged rows an image to ``path``; returns it in float32. ``version`` "2.5": Qwen2.5-VL (RMSNorms, gated
    MLPs, windows of 2 x 2 merged rows with block 1 of 3 seeing whole images). ``text_fields``: the decoder's
    config fields over ``_BASE``'s."""
    text = dict(_BASE, **text_fields)
    half = text["head_dim"] // 2
    section = [half - 2 * (3 * half // 8), 3 * half // 8, 3 * half // 8]
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section}
    text.update(bos_token_id=None, eos_token_id=None, pad_token_id=None)  # (Qwen2-VL's defaults: 151643...)
    vision = dict(depth=2, embed_dim=32, hidden_size=text["hidden_size"], num_heads=4, mlp_ratio=2, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    config_cls, model_cls = transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration
    if version == "2.5":
        vision = dict(depth=3, hidden_size=32, out_hidden_size=text["hidden_size"], intermediate_size=48, num_heads=4,
                      patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3, window_size=56,
                      fullatt_block_indexes=[1], hidden_act="silu")
        config_cls, model_cls = transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration
    config = config_cls(text_config=text, vision_config=vision, image_token_id=QWEN2VL_IMAGE_TOKEN,
                                        video_token_id=QWEN2VL_IMAGE_TOKEN + 3,
                                        vision_start_token_id=QWEN2VL_IMAGE_TOKEN + 1,
                                        vision_end_token_id=QWEN2VL_IMAGE_TOKEN + 2, tie_word_embeddings=False)
    model = _saved_perturbed(model_cls, config, path, seed)
    ImageProcessor = image_processor_class("qwen2_vl", "Qwen2VLImageProcessor")
    ImageProcessor(min_pixels=28 * 28, max_pixels=28 * 28 * 16).save_pretrained(path)
    return model


#: the tiny LLaVA-NeXT's resolutions (tiles of 28 pixels: up to 3 x 3 tiles, 6 x 6 rows of features)
LLAVA_NEXT_PINPOINTS = [[28, 84], [84, 28], [56, 56], [84, 84]]


def build_llava_next(path: str, seed: int = 0, **text_fields: Any) -> torch.nn.Module:
    """A tiny random LLaVA-NeXT: :func:`build_llava`'s CLIP tower and decoder, tiles by
    :data:`LLAVA_NEXT_PINPOINTS`, every weight perturbed (the newline row too), saved with its image processor
    to ``path``; returns it in float32. Image token :data:`LLAVA_IMAGE_TOKEN`."""
    text = transformers.LlamaConfig(**dict(_BASE, **text_fields))
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                           num_attention_heads=4, image_size=28, patch_size=14, projection_dim=32)
    config = transformers.LlavaNextConfig(vision_config=vision, text_config=text, image_token_index=LLAVA_IMAGE_TOKEN,
                                          vision_feature_layer=-2, vision_feature_select_strategy="default",
                                          projector_hidden_act="gelu", image_grid_pinpoints=LLAVA_NEXT_PINPOINTS)
    model = _saved_perturbed(transformers.LlavaNextForConditionalGeneration, config, path, seed)
    ImageProcessor = image_processor_class("llava_next", "LlavaNextImageProcessor")
    ImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28},
                   image_grid_pinpoints=LLAVA_NEXT_PINPOINTS).save_pretrained(path)
    return model


#: the tiny Gemma 3's image token (<start_of_image> and <end_of_image> are the next two ids) and rows an image
GEMMA3_IMAGE_TOKEN, GEMMA3_IMAGE_ROWS = 100, 4


def build_gemma3_vision(path: str, seed: int = 0, **text_fields: Any) -> torch.nn.Module:
    """A tiny random Gemma 3 with images: a 2-layer SigLIP tower on 56x56 images (4 x 4 patches of 14,
    pooled to 2 x 2 = :data:`GEMMA3_IMAGE_ROWS` rows), a Gemma 3 decoder of ``_BASE``'s shape with a
    sliding layer (window 16) then a global one; every weight perturbed, saved with its image processor to
    ``path``; returns it in float32. ``text_fields``: the decoder's config fields over those."""
    text = dict(_BASE, sliding_window=16, layer_types=["sliding_attention", "full_attention"], **text_fields)
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, image_size=56,
                  patch_size=14, vision_use_head=False)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=GEMMA3_IMAGE_ROWS,
                                       image_token_index=GEMMA3_IMAGE_TOKEN, boi_token_index=GEMMA3_IMAGE_TOKEN + 1,
                                       eoi_token_index=GEMMA3_IMAGE_TOKEN + 2)
    model = _saved_perturbed(transformers.Gemma3ForConditionalGeneration, config, path, seed)
    ImageProcessor = image_processor_class("gemma3", "Gemma3ImageProcessor")
    ImageProcessor(size={"height": 56, "width": 56}).save_pretrained(path)
    return model


def hf_greedy_logprobs(hf: torch.nn.Module, input_ids: torch.Tensor, max_new_tokens: int = 8,
                       **inputs: Any) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens for ``input_ids`` ([1, T]) and each one's log-probability."""
    with torch.no_grad():
        g = hf.generate(input_ids, max_new_tokens=max_new_tokens, do_sample=False, output_scores=True,
                        return_dict_in_generate=True, **inputs)
    tokens = g.sequences[0, input_ids.shape[1]:].tolist()
    return tokens, [float(torch.log_softmax(s[0].float(), -1)[t]) for s, t in zip(g.scores, tokens)]


def assert_greedy_equal(outs: Any, refs: list[tuple[list[int], list[float]]], tol: float = 1e-4) -> None:
    """Each ``RequestOutput`` (sampled with ``logprobs=0``) has the reference's tokens, and log-probabilities
    within ``tol`` of its."""
    for out, (tokens, logprobs) in zip(outs, refs, strict=True):
        got = out.outputs[0]
        assert list(got.token_ids) == tokens
        diff = max(abs(step[t].logprob - lp) for step, t, lp in zip(got.logprobs, got.token_ids, logprobs))
        assert diff < tol, diff
