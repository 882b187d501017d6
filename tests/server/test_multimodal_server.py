"""Images through ``kvforge serve`` with the official openai client (issue 39): a tiny random LLaVA-1.5
with the default model's tokenizer (an ``<image>`` token added) and a LLaVA-style chat template. A
data-URL image is answered with the engine's greedy tokens for the same prompt and image, its
placeholders counted in the usage; the same image twice hits the prefix cache, another does not; a bad
image, one image too many, a ``file://`` image without ``--allowed-local-media-path`` and an audio part
are each a 400 naming the part."""
from __future__ import annotations

import base64
import io

import numpy as np
import openai
import pytest

from conftest import ServerProcess, metric
from model_architectures import LLAVA_IMAGE_ROWS, build_llava

PIL = pytest.importorskip("PIL.Image")


def picture(h: int, w: int, seed: int):
    return PIL.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8))


def data_url(img) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory, tokenizer):
    import copy

    path = str(tmp_path_factory.mktemp("llava-served"))
    build_llava(path, tokenizer=copy.deepcopy(tokenizer))
    return path


@pytest.fixture(scope="module")
def served(llava_dir):
    s = ServerProcess("--limit-mm-per-prompt", '{"image": 2}', "--block-size", "4", "--served-model-name", "llava",
                      model=llava_dir)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)


def ask(*images, text="Describe this picture in detail, please."):
    return [{"role": "user", "content": [{"type": "text", "text": text},
                                         *({"type": "image_url", "image_url": {"url": u}} for u in images)]}]


GREEDY = dict(model="llava", max_tokens=6, temperature=0, extra_body={"ignore_eos": True})


def test_a_data_url_image_is_answered_as_the_engine_answers_it(client, llava_dir):
    from kvforge import LLM, SamplingParams
    from kvforge.tokenizer import load_tokenizer

    img = picture(40, 60, 0)
    r = client.chat.completions.create(messages=ask(data_url(img)), **GREEDY)
    tok = load_tokenizer(llava_dir)
    prompt = tok.apply_chat_template([{"role": "user", "content": [
        {"type": "text", "text": "Describe this picture in detail, please."}, {"type": "image"}]}],
        tokenize=False, add_generation_prompt=True)
    ids = tok.encode(prompt, add_special_tokens=False)
    assert r.usage.prompt_tokens == len(ids) - 1 + LLAVA_IMAGE_ROWS  # the image's placeholders count
    llm = LLM(llava_dir, device="cpu", max_model_len=128, num_gpu_blocks_override=32)
    want = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": img}}],
                        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].outputs[0]
    assert r.choices[0].message.content == want.text and r.usage.completion_tokens == 6
    other = client.chat.completions.create(messages=ask(data_url(picture(40, 60, 5))), **GREEDY)
    assert other.choices[0].message.content != r.choices[0].message.content  # the image is read


def test_the_same_image_twice_hits_the_prefix_cache_and_another_does_not(client, served):
    def hits() -> float:
        return metric(served, "kvforge:prefix_cache_hits_total")

    first, second = data_url(picture(30, 30, 11)), data_url(picture(30, 30, 12))
    client.chat.completions.create(messages=ask(first), **GREEDY)
    before = hits()
    client.chat.completions.create(messages=ask(first), **GREEDY)
    repeated = hits() - before
    before = hits()
    client.chat.completions.create(messages=ask(second), **GREEDY)
    other = hits() - before
    assert repeated >= other + LLAVA_IMAGE_ROWS, (repeated, other)  # the image's blocks hit only for the same image


@pytest.mark.parametrize("content, param, says", [
    ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}], "messages.0.content.0",
     "cannot be decoded"),
    ([{"type": "image_url", "image_url": {"url": "file:///etc/hostname"}}], "messages.0.content.0",
     "--allowed-local-media-path"),
    ([{"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}], "messages.0.content",
     "takes no audio"),
])
def test_a_bad_image_part_is_a_400_naming_the_part(client, content, param, says):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(messages=[{"role": "user", "content": content}], **GREEDY)
    assert err.value.body["param"] == param and says in err.value.body["message"]


def test_one_image_too_many_is_a_400_naming_it(client):
    url = data_url(picture(20, 20, 3))
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(messages=ask(url, url, url), **GREEDY)
    assert err.value.body["param"] == "messages.0.content.3" and "--limit-mm-per-prompt" in err.value.body["message"]


def test_a_responses_input_image_is_answered_as_chat_answers_the_same_image(client):
    img = data_url(picture(40, 60, 0))
    chat = client.chat.completions.create(messages=ask(img), **GREEDY)
    r = client.responses.create(model="llava", temperature=0, max_output_tokens=6, extra_body={"ignore_eos": True},
                                input=[{"role": "user", "content": [
                                    {"type": "input_text", "text": "Describe this picture in detail, please."},
                                    {"type": "input_image", "image_url": img}]}])
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens  # the placeholders counted alike
    follow = client.responses.create(model="llava", temperature=0, max_output_tokens=2, previous_response_id=r.id,
                                     input="And the colours?")
    assert follow.usage.input_tokens > r.usage.input_tokens + r.usage.output_tokens  # the image is in the chain
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="llava", max_output_tokens=2, input=[{"role": "user", "content": [
            {"type": "input_image", "file_id": "file-123"}]}])
    assert err.value.body["param"] == "input.0.content.0" and "file_id" in err.value.body["message"]


def test_an_anthropic_image_block_is_answered_as_chat_answers_the_same_image(served):
    import anthropic

    img = picture(40, 60, 0)
    chat = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0).chat.completions.create(
        messages=ask(data_url(img)), **GREEDY)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    claude = anthropic.Anthropic(base_url=served.url, api_key="unused", max_retries=0)
    blocks = [{"type": "text", "text": "Describe this picture in detail, please."},
              {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                           "data": base64.b64encode(buf.getvalue()).decode()}}]
    r = claude.messages.create(model="llava", max_tokens=6, messages=[{"role": "user", "content": blocks}],
                               extra_body={"temperature": 0, "ignore_eos": True})
    assert r.content[0].text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.count_tokens(model="llava", messages=[{"role": "user", "content": blocks}])
    assert "messages.0.content.1: count_tokens does not count images" in err.value.body["error"]["message"]
