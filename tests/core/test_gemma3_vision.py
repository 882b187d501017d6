"""Gemma 3 with images through the engine (issue 39), on a tiny random Gemma3ForConditionalGeneration built by
transformers: greedy tokens and their float32 log-probabilities equal transformers' with 0, 1 and 2 images,
whole and with a budget that would split images (chunks then stop before them); without the image rows'
two-way attention they would differ. An image larger than a step's budget is a ValueError; chunks never end
inside such an image; backends without two-way spans are refused by name."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvforge import LLM, SamplingParams
from kvforge.multimodal.inputs import MultiModalFeature
from kvforge.multimodal.spans import chunk_limit, lookahead
from kvforge.scheduler import Scheduler
from model_architectures import (
    GEMMA3_IMAGE_ROWS,
    GEMMA3_IMAGE_TOKEN,
    assert_greedy_equal,
    build_gemma3_vision,
    hf_greedy_logprobs,
)

PIL = pytest.importorskip("PIL.Image")
BOI = GEMMA3_IMAGE_TOKEN + 1
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)


def picture(h: int, w: int, seed: int):
    return PIL.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8))


IMAGES = [picture(40, 60, 0), picture(90, 40, 1)]
CASES = [([5, BOI, 6, 7], [0]), ([7, BOI, 8, BOI, 9], [1, 0]), ([3, 4], [])]


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("gemma3_vision"))
    return path, build_gemma3_vision(path)


def reference(hf, path: str, expanded: list[int], imgs: list) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and log-probabilities (``token_type_ids`` marks the image rows)."""
    from transformers import AutoImageProcessor

    x = torch.tensor([expanded])
    kw = {"token_type_ids": (x == GEMMA3_IMAGE_TOKEN).long()}
    if imgs:
        kw["pixel_values"] = AutoImageProcessor.from_pretrained(path)(images=imgs, return_tensors="pt")["pixel_values"]
    return hf_greedy_logprobs(hf, x, **kw)


@pytest.mark.parametrize("budget", [512, 5], ids=["whole-prompts", "chunks-stop-before-images"])
def test_greedy_tokens_and_logprobs_equal_transformers_with_two_way_image_rows(gemma3, budget):
    path, hf = gemma3
    llm = LLM(path, dtype="float32", max_model_len=256, num_gpu_blocks_override=64, max_num_batched_tokens=budget,
              limit_mm_per_prompt={"image": 2})
    try:
        assert llm.llm_engine.executor.driver.attn_name == "torch"  # the backend with two-way spans on the CPU
        items = [[IMAGES[i] for i in imgs] for _, imgs in CASES]
        expanded = [llm.llm_engine.inputs.multimodal(ids, {"image": im})[0] if im else ids
                    for (ids, _), im in zip(CASES, items)]
        assert expanded[0] == [5, BOI] + [GEMMA3_IMAGE_TOKEN] * GEMMA3_IMAGE_ROWS + [BOI + 1, 6, 7]
        refs = [reference(hf, path, e, im) for e, im in zip(expanded, items)]
        outs = llm.generate([{"prompt_token_ids": ids, **({"multi_modal_data": {"image": im}} if im else {})}
                             for (ids, _), im in zip(CASES, items)], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    assert_greedy_equal(outs, refs)


def test_an_image_longer_than_a_steps_budget_is_a_value_error(gemma3):
    path, _ = gemma3
    llm = LLM(path, dtype="float32", max_model_len=256, num_gpu_blocks_override=64, max_num_batched_tokens=3)
    try:
        with pytest.raises(ValueError, match="multi_modal_data: image 0 takes 4 positions, more than max_num_batched"):
            llm.generate([{"prompt_token_ids": [5, BOI, 6], "multi_modal_data": {"image": IMAGES[0]}}], GREEDY)
    finally:
        llm.shutdown()


def test_chunks_never_end_inside_a_two_way_item_and_rows_see_to_its_end():
    image = MultiModalFeature("image", {}, offset=4, length=4, content_hash=1, bidirectional=True)
    assert chunk_limit([image], 0, 6) == 4  # stops before the image
    assert chunk_limit([image], 0, 8) == 8 and chunk_limit([image], 0, 3) == 3
    assert chunk_limit([image], 4, 3) == 0  # starts at the image and cannot finish it: waits for more budget
    assert chunk_limit([image], 6, 1) == 0 and chunk_limit([image], 6, 2) == 2  # (a prefix hit inside it)
    assert lookahead([image], 2, 8).tolist() == [0, 0, 3, 2, 1, 0, 0, 0]
    req = SimpleNamespace(mm_features=(image,), num_computed_tokens=2)
    assert Scheduler.fit_chunk(req, 5) == 2 and Scheduler.fit_chunk(req, 3, start=4) == 0  # type: ignore[arg-type]
    text = MultiModalFeature("image", {}, offset=4, length=4, content_hash=1)  # a one-way item may be split
    assert chunk_limit([text], 0, 6) == 6


def test_backends_without_two_way_spans_are_refused_by_name():
    from kvforge.plugins.attention.triton_backend import TritonAttentionBackend

    reasons = TritonAttentionBackend.validate(device=torch.device("cpu"), dtype=torch.float32, head_size=64,
                                              block_size=16, features=frozenset({"bidirectional_spans"}))
    assert "no bidirectional spans support (the model's layers need it)" in reasons
