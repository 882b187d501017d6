"""LoRA adapters over HTTP, with the real default model and the official `openai` client: adapters from
`--lora-modules` and from `POST /v1/load_lora_adapter` answer under their own names exactly as
transformers + peft do; `/v1/models` lists them with their parent; unloading stops them (a request still
running under one finishes with it, and the name can be loaded again at once); bad adapters, corrupt files
included, are 400s naming the field and cost nothing else, with one rank or two."""
import json
import os
import pickle
import sys

import httpx
import openai
import pytest

from conftest import API_KEY, ServerProcess, metric
from kvforge.bench.servers import ProcessServer, free_port
from lora_adapters import SPECS, AdapterSpec, make_adapter, peft_greedy

GREEDY = {"temperature": 0.0, "max_tokens": 8, "extra_body": {"ignore_eos": True}}
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def adapter_dir(hf_base, tmp_path_factory):
    out = tmp_path_factory.mktemp("loras")
    return {s.name: make_adapter(hf_base, str(out), s, scale=4.0) for s in SPECS}  # strong: each changes PROMPT


@pytest.fixture(scope="module")
def two_rank_start(default_model_path):
    """The two-rank server of the last test, started first, side by side with ``lora_server`` (a server
    start on the real model is mostly one busy core: two at once take little longer than one)."""
    s = ServerProcess("--served-model-name", "smol", "--max-model-len", "256", "--num-gpu-blocks-override", "64",
                      "--pipeline-parallel-size", "2", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16",
                      "--allow-runtime-lora-updating", model=default_model_path, wait=False)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def lora_server(default_model_path, adapter_dir, two_rank_start):
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
def expected(hf_base, adapter_dir, hf_tokenizer):
    """transformers + peft's greedy text of PROMPT under each adapter (None: the base model)."""
    tok = hf_tokenizer
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
            ({"lora_name": "gone", "lora_path": str(tmp_path / "nowhere")}, "lora_path", "is not a LoRA adapter"),
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


@pytest.fixture(scope="module")
def corrupt_dirs(adapter_dir, tmp_path_factory):
    """Adapter directories with a valid config and broken weights: a 3-byte safetensors file, and a pickle
    ``.bin`` that would create the file ``ran`` if it were unpickled (it never is)."""
    out = tmp_path_factory.mktemp("corrupt")
    config = open(os.path.join(adapter_dir["sql"], "adapter_config.json")).read()
    dirs = {}
    for name, weights in (("adapter_model.safetensors", b"abc"),
                          ("adapter_model.bin", pickle.dumps({"x": _RunsCode(str(out / "ran"))}))):
        d = out / name.replace(".", "_")
        d.mkdir()
        (d / "adapter_config.json").write_text(config)
        (d / name).write_bytes(weights)
        dirs[name] = str(d)
    return dirs


class _RunsCode:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _load(url: str, name: str, path: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}, timeout=60)


def _assert_corrupt_files_refused(url: str, corrupt_dirs: dict) -> None:
    for weights, path in corrupt_dirs.items():
        r = _load(url, "x", path)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "lora_path" and "lora_path" in err["message"] and weights in err["message"], err
    assert not os.path.exists(os.path.join(os.path.dirname(path), "ran"))


def test_corrupt_adapter_files_are_400s_naming_lora_path(lora_server, client, corrupt_dirs, expected):
    _assert_corrupt_files_refused(lora_server.url, corrupt_dirs)
    assert {m.id for m in client.models.list().data} == {"smol", "sql", "chat"}
    assert complete(client, "sql") == expected["sql"]


def test_missing_and_non_adapter_paths_get_the_same_message(lora_server, tmp_path):
    """The message does not tell a client which paths exist on the server."""
    missing, plain = str(tmp_path / "nowhere"), str(tmp_path / "plain")
    os.mkdir(plain)
    with open(os.path.join(plain, "notes.txt"), "w") as f:
        f.write("not an adapter")
    messages = []
    for path in (missing, plain, "/etc"):
        r = _load(lora_server.url, "x", path)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "lora_path" and "not a LoRA adapter directory" in err["message"], err
        messages.append(err["message"].replace(repr(path), "PATH"))
    assert messages[0] == messages[1] == messages[2], messages


def test_unloading_an_adapter_in_use_frees_its_name_and_the_request_finishes_with_it(lora_server, client,
                                                                                      adapter_dir, expected):
    url, tokens = lora_server.url, 48
    body = {"model": "g0", "prompt": PROMPT, "max_tokens": tokens, "temperature": 0.0, "ignore_eos": True}
    assert _load(url, "g0", adapter_dir["math"]).status_code == 200
    reference = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    text, usage, finish = "", None, None
    with httpx.stream("POST", f"{url}/v1/completions", timeout=60,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
                break
        assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "g0"}).status_code == 200
        r2 = _load(url, "g0", adapter_dir["sql"])  # was: 400 'g0' is already adapter id N
        assert r2.status_code == 200, r2.text
        assert metric(lora_server, "kvforge:num_requests_running") == 1  # the stream ran through both calls
        assert complete(client, "g0") == expected["sql"]  # the new adapter serves the name
        for line in lines:
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                for choice in chunk["choices"]:
                    text += choice["text"]
                    finish = choice.get("finish_reason") or finish
                usage = chunk.get("usage") or usage
    # the stream finished normally, all of it under the adapter it started with
    assert finish == "length" and usage["completion_tokens"] == tokens
    assert text == reference
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "g0"}).status_code == 200


@pytest.fixture(scope="module")
def two_rank_server(two_rank_start):
    two_rank_start.wait_healthy(180)
    return two_rank_start


def test_two_ranks_survive_corrupt_adapter_files(two_rank_server, corrupt_dirs, adapter_dir, expected):
    """A bad file fails only its load: no rank exits (issue 34: it was 500 WorkerFailure, then exit 1)."""
    url = two_rank_server.url
    _assert_corrupt_files_refused(url, corrupt_dirs)
    assert httpx.get(f"{url}/health").status_code == 200 and two_rank_server.proc.poll() is None
    assert _load(url, "sql", adapter_dir["sql"]).status_code == 200
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    assert complete(client, "sql") == expected["sql"] and complete(client, "smol") == expected[None]
