"""The KV sizing counts a multimodal model's encoder (issue 39): the memory profile encodes the costliest
batch of items one step can reach, the processor's largest item as many times as the budget holds its
rows (and ``limit_mm_per_prompt`` per sequence allows), holding them through the decoder's forward, and
reserves the encoder cache's other rows; a text model encodes nothing."""
from __future__ import annotations

import pytest
import torch

from kvforge import LLM
from kvforge.multimodal.encoder_cache import DEFAULT_CAPACITY_ROWS
from kvforge.rank import kv_sizing
from model_architectures import LLAVA_IMAGE_ROWS, build_llava, build_qwen2_vl

pytest.importorskip("PIL.Image")


def profiled(llm: LLM, monkeypatch, budget: int, seqs: int) -> dict:
    """What the driver's memory profile would run on a GPU: the encoder's output and the reserved bytes."""
    seen = {}

    def fake(rank, tokens, max_len, rows, encode=None, extra_bytes=0):
        seen.update(encoded=encode() if encode is not None else None, extra=extra_bytes, tokens=tokens)
        return 0
    monkeypatch.setattr(kv_sizing, "profile_peak_memory", fake)
    llm.llm_engine.executor.driver.profile_peak_memory(budget, seqs, 128)
    return seen


def test_the_profile_encodes_as_many_largest_images_as_a_step_reaches(tmp_path, monkeypatch):
    build_llava(str(tmp_path))
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=128, num_gpu_blocks_override=32,
              limit_mm_per_prompt={"image": 2})
    try:
        hidden = llm.llm_engine.model_config.hidden_size
        seen = profiled(llm, monkeypatch, budget=10, seqs=4)  # 10 // 4 rows: 2 images fit the budget
        assert [tuple(e.shape) for e in seen["encoded"]] == [(LLAVA_IMAGE_ROWS, hidden)] * 2
        assert seen["extra"] == (DEFAULT_CAPACITY_ROWS - 2 * LLAVA_IMAGE_ROWS) * hidden * 4
        seen = profiled(llm, monkeypatch, budget=100, seqs=1)  # one sequence of at most 2 images
        assert len(seen["encoded"]) == 2
    finally:
        llm.shutdown()


def test_qwen2_vl_profiles_its_largest_image_and_a_text_model_nothing(tmp_path, monkeypatch, tiny_llm):
    build_qwen2_vl(str(tmp_path))  # max_pixels 28 x 28 x 16: a 112 x 112 image, 16 rows
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=128, num_gpu_blocks_override=32)
    try:
        seen = profiled(llm, monkeypatch, budget=64, seqs=8)
        assert [e.shape[0] for e in seen["encoded"]] == [16] * 4  # the budget holds 4 images' rows
        assert torch.isfinite(torch.cat(seen["encoded"])).all()
        assert len(profiled(llm, monkeypatch, budget=1000, seqs=2)["encoded"]) == 2  # one image a sequence
    finally:
        llm.shutdown()
    assert profiled(tiny_llm, monkeypatch, budget=64, seqs=8)["encoded"] is None
