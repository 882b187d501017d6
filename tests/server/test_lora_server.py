"""LoRA adapters over HTTP, with the real default model and the official `openai` client: adapters from
`--lora-modules` and from `POST /v1/load_lora_adapter` answer under their own names exactly as
transformers + peft do; `/v1/models` lists them with their parent; unloading stops them; bad adapters
are 400s naming the field and cost nothing else."""
import os
import sys

import httpx
import openai
import pytest

from conftest import API_KEY
from kvforge.bench.serve import ProcessServer, free_port
from lora_adapters import SPECS, AdapterSpec, make_adapter, peft_greedy

GREEDY = {"temperature": 0.0, "max_tokens": 8, "extra_body": {"ignore_eos": True}}
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def adapter_dir(hf_base, tmp_path_factory):
    out = tmp_path_factory.mktemp("loras")
    return {s.name: make_adapter(hf_base, str(out), s, scale=4.0) for s in SPECS}  # strong: each changes PROMPT


@pytest.fixture(scope="module")
def lora_server(default_model_path, adapter_dir):
    port = free_port()
    cmd = [sys.executable, "-m", "kvforge.cli", "serve", default_model_path, "--served-model-name", "smol",
           "--device", "cpu", "--max-model-len", "256", "--num-gpu-blocks-override", "64", "--port", str(port),
           "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16", "--allow-runtime-lora-updating",
           "--lora-modules", f"sql={adapter_dir['sql']}", f'{{"name": "chat", "path": "{adapter_dir["chat"]}"}}']
    server = ProcessServer(cmd, port, 180, "kvforge serve (LoRA)")
    yield server
    server.stop()
    os.unlink(server.log.name)


@pytest.fixture(scope="module")
def client(lora_server):
    return openai.OpenAI(base_url=f"{lora_server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def expected(hf_base, adapter_dir, default_model_path):
    """transformers + peft's greedy text of PROMPT under each adapter (None: the base model)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.dirname(default_model_path),
                                        gguf_file=os.path.basename(default_model_path))
    ids = tok.encode(PROMPT)
    return {name: tok.decode(peft_greedy(hf_base, None if name is None else adapter_dir[name], [ids], 8)[0],
                             skip_special_tokens=True)
            for name in (None, "sql", "chat", "math")}


def complete(client, model: str) -> str:
    return client.completions.create(model=model, prompt=PROMPT, **GREEDY).choices[0].text


def test_models_list_the_adapters_with_their_parent(client, adapter_dir, default_model_path):
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"smol", "sql", "chat"}
    assert cards["smol"].parent is None and cards["smol"].root == default_model_path
    for name in ("sql", "chat"):
        assert cards[name].parent == "smol" and cards[name].root == adapter_dir[name]


def test_each_adapter_answers_as_peft_does(client, expected):
    for name in ("sql", "chat"):
        out = client.completions.create(model=name, prompt=PROMPT, **GREEDY)
        assert out.model == name and out.choices[0].text == expected[name], name
    assert complete(client, "smol") == expected[None]
    assert all(expected[name] != expected[None] for name in ("sql", "chat", "math")), expected


def test_load_and_unload_at_run_time(lora_server, client, adapter_dir, expected):
    url = lora_server.url
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "math", "lora_path": adapter_dir["math"]})
    assert r.status_code == 200, r.text
    assert "math" in {m.id for m in client.models.list().data}
    assert complete(client, "math") == expected["math"]
    r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "math"})
    assert r.status_code == 200, r.text
    assert "math" not in {m.id for m in client.models.list().data}
    with pytest.raises(openai.NotFoundError):
        complete(client, "math")
    r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "math"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "lora_name"


def test_bad_adapters_are_400s_naming_the_field_and_cost_nothing_else(lora_server, client, hf_base, tmp_path,
                                                                      expected):
    url = lora_server.url
    big = make_adapter(hf_base, str(tmp_path), AdapterSpec("big", 32, 16, ("q_proj",)))
    for body, field, words in (
            ({"lora_name": "big", "lora_path": big}, "lora_path", "max_lora_rank=16"),
            ({"lora_name": "gone", "lora_path": str(tmp_path / "nowhere")}, "lora_path", "is not a directory"),
            ({"lora_name": "sql", "lora_path": big}, "lora_name", "already served"),
            ({"lora_name": "x", "lora_path": big, "base_model_name": "nope"}, "model", "does not exist")):
        r = httpx.post(f"{url}/v1/load_lora_adapter", json=body)
        assert r.status_code in (400, 404), r.text
        err = r.json()["error"]
        assert err["param"] == field and words in err["message"], err
    assert {m.id for m in client.models.list().data} == {"smol", "sql", "chat"}
    assert complete(client, "sql") == expected["sql"]


def test_runtime_updating_is_off_by_default(server):
    r = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/tmp"},
                   headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 404 and "--allow-runtime-lora-updating" in r.json()["error"]["message"]
