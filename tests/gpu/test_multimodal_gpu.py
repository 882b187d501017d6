"""Images on the GPU with CUDA graphs captured (issue 39): the tiny LLaVA's greedy tokens equal transformers'
(float32) when prompt chunks of one token a request (the shape the decode graphs capture) land on image
placeholders, so such steps must run eagerly and merge the images (GPU machine)."""
import numpy as np
import pytest
import torch

from kvforge import LLM, SamplingParams
from model_architectures import LLAVA_IMAGE_ROWS, LLAVA_IMAGE_TOKEN, build_llava

pytestmark = pytest.mark.gpu
PIL = pytest.importorskip("PIL.Image")


def test_one_token_chunks_on_image_placeholders_run_eagerly_with_graphs_captured(tmp_path):
    from transformers import CLIPImageProcessor

    hf = build_llava(str(tmp_path), head_dim=32)  # (16, the CPU tests', is below the Triton backend's sizes)
    rng = np.random.default_rng(0)
    images = [PIL.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in ((40, 60), (33, 28))]
    cases = [[5, LLAVA_IMAGE_TOKEN, 6], [7, 8, LLAVA_IMAGE_TOKEN]]
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=128, num_gpu_blocks_override=64,
              max_num_batched_tokens=2)  # two requests, one token each a step: uniform q=1 steps
    assert llm.llm_engine.runner.graphs is not None
    outs = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": img}}
                         for ids, img in zip(cases, images)],
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    processor = CLIPImageProcessor.from_pretrained(str(tmp_path))
    for ids, img, out in zip(cases, images, outs):
        expanded = [t for i in ids for t in ([LLAVA_IMAGE_TOKEN] * LLAVA_IMAGE_ROWS if i == LLAVA_IMAGE_TOKEN else [i])]
        with torch.no_grad():
            ref = hf.generate(torch.tensor([expanded]), pixel_values=processor(images=[img], return_tensors="pt")[
                "pixel_values"], max_new_tokens=8, do_sample=False)[0, len(expanded):].tolist()
        assert out.outputs[0].token_ids == ref
    assert sum(llm.llm_engine.runner.graphs.replays.values()) > 0  # the decode steps still replayed graphs


def test_qwen2_5_vl_decode_graphs_take_mrope_offsets_and_give_transformers_tokens(tmp_path):
    """Qwen2.5-VL's text after an image rotates behind its 1-D position: decode steps replay CUDA graphs with
    those offsets in their static positions, and the tokens and log-probabilities are transformers'."""
    from transformers import AutoImageProcessor

    from model_architectures import QWEN2VL_IMAGE_TOKEN, build_qwen2_vl

    img_token = QWEN2VL_IMAGE_TOKEN
    # (head_dim = hidden / heads: transformers 5.17 on the GPU machine ignores an explicit head_dim for it)
    hf = build_qwen2_vl(str(tmp_path), version="2.5", head_dim=32, hidden_size=128)
    rng = np.random.default_rng(0)
    image = PIL.fromarray(rng.integers(0, 255, (60, 90, 3), dtype=np.uint8))  # 2 x 3 merged rows
    ids = [5, img_token + 1, img_token, img_token + 2, 6, 7]
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=128, num_gpu_blocks_override=64)
    out = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": image}}],
                       SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0), use_tqdm=False)[0]
    replays = sum(llm.llm_engine.runner.graphs.replays.values())
    pixels = AutoImageProcessor.from_pretrained(str(tmp_path))(images=[image], return_tensors="pt")
    x = torch.tensor([[t for i in ids for t in ([img_token] * 6 if i == img_token else [i])]])
    with torch.no_grad():
        g = hf.generate(x, pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"],
                        mm_token_type_ids=(x == img_token).to(torch.int32), max_new_tokens=8, do_sample=False,
                        output_scores=True, return_dict_in_generate=True)
    ref = g.sequences[0, x.shape[1]:].tolist()
    assert list(out.outputs[0].token_ids) == ref and replays > 0
    logprobs = [float(torch.log_softmax(s[0].float(), -1)[t]) for s, t in zip(g.scores, ref)]
    assert max(abs(step[t].logprob - lp) for step, t, lp in zip(out.outputs[0].logprobs, ref, logprobs)) < 1e-3
