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
