"""Images through the engine (issue 39), on a tiny random LLaVA-1.5 built by transformers: greedy tokens
equal transformers' for prompts with 0, 1 and 2 images of different sizes batched together, with prefix
caching on and with a chunk budget that splits an image's placeholders across steps; a repeated image hits
the prefix cache and another image behind the same tokens does not; each image is encoded once; bad
inputs are a ValueError naming the field. The media loader's limits are checked on their own."""
from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch

from kvforge import LLM, SamplingParams
from kvforge.multimodal.media import MediaLimits, image_hash, load_image
from model_architectures import LLAVA_IMAGE_ROWS, LLAVA_IMAGE_TOKEN, build_llava

PIL = pytest.importorskip("PIL.Image")
IMG = LLAVA_IMAGE_TOKEN
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def picture(h: int, w: int, seed: int):
    return PIL.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llava"))
    return path, build_llava(path)


@pytest.fixture(scope="module")
def images():
    return [picture(40, 60, 0), picture(33, 28, 1), picture(50, 50, 2)]


def reference(hf, path, ids: list[int], imgs: list, max_new_tokens: int = 8) -> list[int]:
    """transformers' greedy tokens: the prompt with each placeholder expanded, the processor's pixels."""
    from transformers import CLIPImageProcessor

    expanded = [t for i in ids for t in ([IMG] * LLAVA_IMAGE_ROWS if i == IMG else [i])]
    kw = {"pixel_values": CLIPImageProcessor.from_pretrained(path)(images=imgs, return_tensors="pt")["pixel_values"]
          } if imgs else {}
    with torch.no_grad():
        out = hf.generate(torch.tensor([expanded]), max_new_tokens=max_new_tokens, do_sample=False, **kw)
    return out[0, len(expanded):].tolist()


def prompt(ids, imgs):
    return {"prompt_token_ids": ids, **({"multi_modal_data": {"image": imgs}} if imgs else {})}


CASES = [([5, 6, IMG, 7, 8], [0]), ([9, IMG, 10, IMG, 11, 12], [0, 1]), ([13, 14, 15], []), ([21, IMG, 22], [2])]


@pytest.mark.parametrize("budget", [512, 3], ids=["whole-prompts", "chunks-split-images"])
def test_greedy_tokens_equal_transformers_with_0_1_2_images_batched(llava, images, budget, monkeypatch):
    path, hf = llava
    from kvforge.plugins.models.llava import LlavaForConditionalGeneration

    encoded = []
    embed = LlavaForConditionalGeneration.embed_multimodal
    monkeypatch.setattr(LlavaForConditionalGeneration, "embed_multimodal",
                        lambda self, fs: encoded.extend(f.content_hash for f in fs) or embed(self, fs))
    llm = LLM(path, device="cpu", max_model_len=128, num_gpu_blocks_override=64, max_num_batched_tokens=budget,
              limit_mm_per_prompt={"image": 2}, enable_prefix_caching=True)
    prompts = [prompt(ids, [images[i] for i in which]) for ids, which in CASES]
    outs = llm.generate(prompts, GREEDY)
    refs = [reference(hf, path, ids, [images[i] for i in which]) for ids, which in CASES]
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert sorted(encoded) == sorted(image_hash(images[i]) for i in (0, 1, 2))  # each image once, split or not
    # the image matters: another picture in the same place changes the answer, as transformers' does
    other = llm.generate([prompt(CASES[0][0], [images[2]])], GREEDY)[0].outputs[0].token_ids
    assert other == reference(hf, path, CASES[0][0], [images[2]]) != refs[0]


def test_preempted_image_requests_keep_their_tokens_and_are_not_encoded_again(llava, images, monkeypatch):
    """Too few KV blocks for the batch: requests are preempted and recomputed, and their images come from
    the encoder cache, not the tower, the second time."""
    path, hf = llava
    from kvforge.plugins.models.llava import LlavaForConditionalGeneration

    encoded = []
    embed = LlavaForConditionalGeneration.embed_multimodal
    monkeypatch.setattr(LlavaForConditionalGeneration, "embed_multimodal",
                        lambda self, fs: encoded.extend(f.content_hash for f in fs) or embed(self, fs))
    llm = LLM(path, device="cpu", max_model_len=24, num_gpu_blocks_override=6, block_size=4,
              limit_mm_per_prompt={"image": 2}, enable_prefix_caching=False)
    cases = [([5, 6, IMG, 7, 8], [0]), ([9, IMG, 10, IMG, 11], [0, 1]), ([21, IMG, 22], [2])]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = llm.generate([prompt(ids, [images[i] for i in which]) for ids, which in cases], params)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == [
        reference(hf, path, ids, [images[i] for i in which], 10) for ids, which in cases]
    assert sorted(encoded) == sorted(image_hash(images[i]) for i in (0, 1, 2))


def test_a_repeated_image_hits_the_prefix_cache_and_another_image_does_not(llava, images):
    path, _ = llava
    llm = LLM(path, device="cpu", max_model_len=128, num_gpu_blocks_override=64, block_size=4,
              enable_prefix_caching=True)
    ids = [1, 2, 3, 4, 5, 6, 7, 8, IMG, 9, 10, 11, 12, 13, 14]  # the image's rows are positions 8-11: block 2
    first = llm.generate([prompt(ids, [images[0]])], GREEDY)[0]
    again = llm.generate([prompt(ids, [images[0]])], GREEDY)[0]
    other = llm.generate([prompt(ids, [images[1]])], GREEDY)[0]
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == 16 and again.outputs[0].token_ids == first.outputs[0].token_ids
    assert other.num_cached_tokens == 8  # the text before the image only


def test_bad_multimodal_inputs_are_a_value_error_naming_the_field(llava, images):
    path, _ = llava
    llm = LLM(path, device="cpu", max_model_len=64, num_gpu_blocks_override=16)
    cases = [
        (prompt([5, IMG, IMG], images[:2]), r"multi_modal_data.image: 2 images, more than the limit of 1"),
        (prompt([5, IMG], [b"not an image"]), r"multi_modal_data.image.0: the image cannot be decoded"),
        (prompt([5, 6], images[:1]), r"multi_modal_data: the prompt has 0 image placeholder\(s\)"),
        ({"prompt_token_ids": [5, IMG], "multi_modal_data": {"audio": [b""]}}, r"multi_modal_data.audio: unknown"),
    ]
    for bad, says in cases:
        with pytest.raises(ValueError, match=says):
            llm.generate([bad], GREEDY)
    assert llm.generate([prompt([5, IMG], images[:1])], GREEDY)[0].outputs[0].token_ids  # the engine lives on


def test_a_text_only_model_refuses_images_by_name(tiny_llm, images):
    with pytest.raises(ValueError, match="multi_modal_data: this model takes no images"):
        tiny_llm.generate([prompt([5, 6], images[:1])], GREEDY)


def _png(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def test_an_image_loads_from_a_data_url_or_allowed_file_alike_and_limits_hold(images, tmp_path):
    png = _png(images[0])
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    assert image_hash(load_image(url)) == image_hash(load_image(png)) == image_hash(images[0])
    (tmp_path / "a.png").write_bytes(png)
    with pytest.raises(ValueError, match="file:// images are off"):
        load_image(f"file://{tmp_path}/a.png")
    allowed = MediaLimits(allowed_local_media_path=str(tmp_path))
    assert image_hash(load_image(f"file://{tmp_path}/a.png", allowed)) == image_hash(images[0])
    with pytest.raises(ValueError, match="outside --allowed-local-media-path"):
        load_image(f"file://{tmp_path}/../a.png", allowed)
    with pytest.raises(ValueError, match="more than the limit of 100 bytes"):
        load_image(png, MediaLimits(max_image_bytes=100))
    with pytest.raises(ValueError, match="60x40 pixels, more than the limit of 1000"):
        load_image(url, MediaLimits(max_image_pixels=1000))
    with pytest.raises(ValueError, match="not valid base64"):
        load_image("data:image/png;base64,@@@")
    with pytest.raises(ValueError, match="not fetched from 'example.com'"):
        load_image("https://example.com/a.png", MediaLimits(allowed_media_domains=("localhost",)))


def test_tensor_parallel_ranks_each_encode_the_images_and_give_the_same_tokens(llava, images):
    """The tower is replicated (docs/multimodal.md): every rank encodes the step's images itself, the
    decoder is split over 2 ranks (gloo), and the tokens are transformers' with chunks splitting images."""
    path, hf = llava
    llm = LLM(path, device="cpu", max_model_len=128, num_gpu_blocks_override=64, max_num_batched_tokens=3,
              limit_mm_per_prompt={"image": 2}, tensor_parallel_size=2, distributed_executor_backend="mp")
    try:
        outs = llm.generate([prompt(ids, [images[i] for i in which]) for ids, which in CASES[:2]], GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == [
            reference(hf, path, ids, [images[i] for i in which]) for ids, which in CASES[:2]]
    finally:
        llm.shutdown()


def test_a_step_that_reaches_an_image_never_replays_a_cuda_graph():
    """A uniform step of one token a request (the shape decode graphs capture) can still be a prompt
    chunk landing on an image placeholder: the runner must run it eagerly, merging the image's rows."""
    from types import SimpleNamespace

    from kvforge.multimodal.encoder_cache import reaches_placeholders
    from kvforge.multimodal.inputs import MultiModalFeature

    image = MultiModalFeature("image", {}, offset=4, length=4, content_hash=1)
    at = lambda computed: SimpleNamespace(request_id="a", num_computed_tokens=computed, mm_features=(image,))  # noqa: E731
    text = SimpleNamespace(request_id="b", num_computed_tokens=0, mm_features=())
    assert not reaches_placeholders([at(3), text], {"a": 1, "b": 1})  # position 3: text before the image
    assert reaches_placeholders([at(3), text], {"a": 2, "b": 1})  # 3-4: its first row
    assert reaches_placeholders([at(7), text], {"a": 1, "b": 1})  # 7: its last row
    assert not reaches_placeholders([at(8), text], {"a": 1, "b": 1})  # decoding after it
