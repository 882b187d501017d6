"""LLaVA-NeXT through the engine (issue 39), on a tiny random LLaVA-NeXT built by transformers (tiles of 28
pixels, up to 3 x 3): greedy tokens and their float32 log-probabilities equal transformers' with 0, 1 and 2
images whose tiles' padding is cut off by rows or by columns, whole and in chunks that split images; the
row count of an image equals transformers' processor's for 300 image sizes."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvforge import LLM, SamplingParams
from kvforge.plugins.models.llava_next import LlavaNextLayout
from model_architectures import LLAVA_IMAGE_TOKEN, assert_greedy_equal, build_llava_next, hf_greedy_logprobs

PIL = pytest.importorskip("PIL.Image")
IMG = LLAVA_IMAGE_TOKEN
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)


def picture(h: int, w: int, seed: int):
    return PIL.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8))


#: 3 x 3 tiles each: 2 of 6 feature rows cut off, then 4 of 6 columns; 1 x 3 tiles, nothing cut off
IMAGES = [picture(40, 60, 0), picture(90, 40, 1), picture(20, 90, 2)]
CASES = [([5, IMG, 6], [0]), ([7, IMG, 8, IMG, 9], [1, 2]), ([3, 4], [])]


@pytest.fixture(scope="module")
def llava_next(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llava_next"))
    return path, build_llava_next(path)


def reference(hf, path: str, expanded: list[int], imgs: list) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and their log-probabilities for the expanded prompt (it refuses a prompt
    whose placeholders are not the images' rows)."""
    from transformers import AutoImageProcessor

    kw = {}
    if imgs:
        out = AutoImageProcessor.from_pretrained(path)(images=imgs, return_tensors="pt")
        kw = {"pixel_values": out["pixel_values"], "image_sizes": out["image_sizes"]}
    return hf_greedy_logprobs(hf, torch.tensor([expanded]), **kw)


@pytest.mark.parametrize("budget", [512, 5], ids=["whole-prompts", "chunks-split-images"])
def test_greedy_tokens_and_logprobs_equal_transformers_with_tiled_images(llava_next, budget):
    path, hf = llava_next
    llm = LLM(path, dtype="float32", max_model_len=256, num_gpu_blocks_override=64, max_num_batched_tokens=budget,
              limit_mm_per_prompt={"image": 2})
    try:
        prompts = [{"prompt_token_ids": ids, **({"multi_modal_data": {"image": [IMAGES[i] for i in imgs]}} if imgs else {})}
                   for ids, imgs in CASES]
        expanded = [llm.llm_engine.inputs.multimodal(ids, {"image": [IMAGES[i] for i in imgs]})[0] if imgs else ids
                    for ids, imgs in CASES]
        refs = [reference(hf, path, e, [IMAGES[i] for i in imgs]) for e, (_, imgs) in zip(expanded, CASES)]
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    assert_greedy_equal(outs, refs)


def test_an_images_rows_equal_transformers_processor_count_for_300_sizes():
    from transformers.models.llava_next.processing_llava_next import LlavaNextProcessor

    hf = {"vision_config": {"image_size": 336, "patch_size": 14},
          "image_grid_pinpoints": [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]}
    layout = LlavaNextLayout(hf)
    theirs = SimpleNamespace(image_processor=SimpleNamespace(image_grid_pinpoints=hf["image_grid_pinpoints"]),
                             patch_size=14, num_additional_image_tokens=0)
    theirs._get_unpadded_features = lambda *a: LlavaNextProcessor._get_unpadded_features(theirs, *a)
    rng = np.random.default_rng(0)
    for h, w in rng.integers(16, 2000, (300, 2)).tolist():
        assert layout.rows(h, w) == LlavaNextProcessor._get_number_of_features(theirs, h, w, 336, 336), (h, w)
