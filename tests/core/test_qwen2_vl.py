"""Qwen2-VL and Qwen2.5-VL through the engine (issue 39), on tiny random ones built by transformers (2.5's
windows cut at the images' edges, one block seeing whole images): greedy tokens and
their log-probabilities equal transformers' (float32) for prompts with 0, 1 and 2 images of different shapes
batched together, whole and in chunks that split an image; the M-RoPE positions equal transformers'
``get_rope_index``; decode steps carry 1-D position offsets only (so they can replay CUDA graphs)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvforge import LLM, SamplingParams
from kvforge.multimodal.mrope import rope_offsets, rope_positions
from kvforge.rank.worker import Worker
from model_architectures import QWEN2VL_IMAGE_TOKEN, assert_greedy_equal, build_qwen2_vl, hf_greedy_logprobs

PIL = pytest.importorskip("PIL.Image")
IMG, START, END = QWEN2VL_IMAGE_TOKEN, QWEN2VL_IMAGE_TOKEN + 1, QWEN2VL_IMAGE_TOKEN + 2
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
#: float32 log-probabilities of the chosen tokens: without M-RoPE's offsets they differ by about 1e-2
LOGPROB_TOL = 1e-4


def picture(h: int, w: int, seed: int):
    return PIL.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8))


@pytest.fixture(scope="module", params=["2", "2.5"], ids=["qwen2-vl", "qwen2.5-vl"])
def qwen2_vl(tmp_path_factory, request):
    path = str(tmp_path_factory.mktemp("qwen2vl"))
    return path, build_qwen2_vl(path, version=request.param)


#: a wide image (2 x 3 merged rows), a square one (1 x 1) and a tall one (3 x 1)
IMAGES = [picture(60, 90, 0), picture(33, 28, 1), picture(90, 40, 2)]
CASES = [([5, START, IMG, END, 6, 7], [0]), ([7, START, IMG, END, 8, START, IMG, END, 9], [2, 1]), ([3, 4, 5], [])]


def hf_inputs(path: str, ids: list[int], imgs: list) -> tuple[torch.Tensor, dict]:
    """transformers' inputs: the prompt with each pad expanded to its image's rows, pixels and grids."""
    from transformers import AutoImageProcessor

    if not imgs:
        x = torch.tensor([ids])
        return x, {"mm_token_type_ids": torch.zeros_like(x, dtype=torch.int32)}
    out = AutoImageProcessor.from_pretrained(path)(images=imgs, return_tensors="pt")
    rows = iter(int(t * h * w) // 4 for t, h, w in out["image_grid_thw"].tolist())
    x = torch.tensor([[t for i in ids for t in ([IMG] * next(rows) if i == IMG else [i])]])
    return x, {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"],
               "mm_token_type_ids": (x == IMG).to(torch.int32)}


def reference(hf, path: str, ids: list[int], imgs: list) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and each one's log-probability."""
    x, kw = hf_inputs(path, ids, imgs)
    return hf_greedy_logprobs(hf, x, **kw)


def prompt(ids, imgs):
    return {"prompt_token_ids": ids, **({"multi_modal_data": {"image": [IMAGES[i] for i in imgs]}} if imgs else {})}


@pytest.mark.parametrize("budget", [512, 3], ids=["whole-prompts", "chunks-split-images"])
def test_greedy_tokens_and_logprobs_equal_transformers_with_mrope(qwen2_vl, budget):
    path, hf = qwen2_vl
    refs = [reference(hf, path, ids, [IMAGES[i] for i in imgs]) for ids, imgs in CASES]
    llm = LLM(path, dtype="float32", max_model_len=256, num_gpu_blocks_override=64, max_num_batched_tokens=budget,
              limit_mm_per_prompt={"image": 2})
    outs = llm.generate([prompt(ids, imgs) for ids, imgs in CASES], GREEDY, use_tqdm=False)
    assert_greedy_equal(outs, refs, LOGPROB_TOL)
    llm.shutdown()


def test_mrope_positions_equal_transformers_get_rope_index(qwen2_vl):
    path, hf = qwen2_vl
    ids, imgs = CASES[1]
    llm = LLM(path, dtype="float32", max_model_len=256, num_gpu_blocks_override=64, limit_mm_per_prompt={"image": 2})
    processed_ids, features = llm.llm_engine.inputs.multimodal(ids, {"image": [IMAGES[i] for i in imgs]})
    llm.shutdown()
    x, kw = hf_inputs(path, ids, [IMAGES[i] for i in imgs])
    assert processed_ids == x[0].tolist()
    want, delta = hf.model.get_rope_index(x, kw["mm_token_type_ids"], image_grid_thw=kw["image_grid_thw"])
    n = len(processed_ids)
    assert (rope_positions(features, 0, n) == want[:, 0].numpy()).all()
    # any window of the prompt alike (a chunk), and text after it: its 1-D position plus the delta
    assert (rope_positions(features, 3, 7) == want[:, 0, 3:10].numpy()).all()
    assert (rope_offsets(features, n, 4) == int(delta)).all()


def test_decode_steps_carry_only_1d_offsets_so_graphs_can_replay(qwen2_vl, monkeypatch):
    """Steps that reach image rows send [3, T] positions; every other step of an image request, decode
    included, sends offsets for its 1-D positions (what a graph's static positions take)."""
    path, _ = qwen2_vl
    seen = []
    execute = Worker.execute

    def spy(self, step, *args, **kwargs):
        if step.req_ids:
            seen.append((step.mm_places is not None, step.mrope_positions, step.rope_offsets, step.query_lens.copy()))
        return execute(self, step, *args, **kwargs)
    monkeypatch.setattr(Worker, "execute", spy)
    llm = LLM(path, dtype="float32", max_model_len=256, num_gpu_blocks_override=64)
    ids, imgs = CASES[0]  # a 2 x 3 image: 6 rows taking 3 positions, so what follows is 3 behind
    llm.generate([prompt(ids, imgs)], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    llm.shutdown()
    prefill, *decodes = seen
    assert prefill[0] and prefill[1] is not None and prefill[1].shape == (3, len(ids) - 1 + 6) and prefill[2] is None
    assert len(decodes) == 3 and all(not mm and pos is None and list(q) == [1] and list(off) == [-3]
                                     for mm, pos, off, q in decodes)


def test_tensor_parallel_ranks_give_transformers_tokens_with_windows_and_mrope(tmp_path):
    """Qwen2.5-VL's decoder split over 2 ranks (gloo), each rank encoding the images with its replicated
    tower, chunks splitting the images: transformers' tokens and log-probabilities."""
    path = str(tmp_path)
    hf = build_qwen2_vl(path, version="2.5")
    refs = [reference(hf, path, ids, [IMAGES[i] for i in imgs]) for ids, imgs in CASES[:2]]
    llm = LLM(path, device="cpu", dtype="float32", max_model_len=256, num_gpu_blocks_override=64,
              max_num_batched_tokens=3, limit_mm_per_prompt={"image": 2}, tensor_parallel_size=2,
              distributed_executor_backend="mp")
    try:
        outs = llm.generate([prompt(ids, imgs) for ids, imgs in CASES[:2]], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    assert_greedy_equal(outs, refs, LOGPROB_TOL)
