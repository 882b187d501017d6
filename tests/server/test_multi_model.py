"""Several models behind one `kvforge serve`: the real default model and a tiny random one, each with
its own engine, routed by the request's `model` (the official `openai` client against a real server);
`/metrics` with one series per model; and the per-model engine options of `--model` and a config
file's `models` list."""
import os
import subprocess
import sys
import textwrap

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvforge.bench.servers import ProcessServer, free_port
from kvforge.cli import build_parser
from kvforge.server.cli import served_model_configs

IGNORE_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def two_models(default_model_path):
    """The default model served as `smol`, then `dummy:tiny` under its own name, in-process engines."""
    port = free_port()
    cmd = [sys.executable, "-m", "kvforge.cli", "serve", default_model_path, "--served-model-name", "smol",
           "--model", "dummy:tiny", "--device", "cpu", "--max-model-len", "256", "--num-gpu-blocks-override", "64",
           "--engine-in-process", "--port", str(port)]
    server = ProcessServer(cmd, port, 180, "kvforge serve (two models)")
    yield server
    server.stop()
    with open(server.log.name, errors="replace") as f:
        log = f.read()
    os.unlink(server.log.name)
    assert server.proc.returncode == 0, log[-3000:]


@pytest.fixture(scope="module")
def client(two_models):
    return openai.OpenAI(base_url=f"{two_models.url}/v1", api_key="unused", max_retries=0)


def families(server) -> dict:
    """`/metrics` parsed as Prometheus text; a family listed twice fails here."""
    parsed = list(text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text))
    names = [f.name for f in parsed]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    return {f.name: f for f in parsed}


def by_model(server, family: str, sample: str | None = None) -> dict[str, float]:
    """The value of each model's ``sample`` (default: the family's name) of ``family``."""
    return {s.labels["model_name"]: s.value for s in families(server)[family].samples if s.name == (sample or family)}


def test_models_list_names_both_models_with_their_roots(client, default_model_path):
    cards = client.models.list().data
    assert [m.id for m in cards] == ["smol", "dummy:tiny"]
    assert [m.root for m in cards] == [default_model_path, "dummy:tiny"]
    for m in cards:
        assert m.object == "model" and m.owned_by == "kvforge"
        assert m.model_extra["max_model_len"] == 256 and m.model_extra["parent"] is None


def test_each_name_is_answered_by_its_own_engine(two_models, client):
    before = by_model(two_models, "kvforge:generation_tokens", "kvforge:generation_tokens_total")
    chat = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Name a colour."}],
                                          max_tokens=3, temperature=0, extra_body=IGNORE_EOS)
    assert chat.model == "smol" and chat.usage.completion_tokens == 3
    tiny = client.completions.create(model="dummy:tiny", prompt=[5, 17, 300, 41], max_tokens=5, temperature=0,
                                     extra_body=IGNORE_EOS)
    assert tiny.model == "dummy:tiny" and tiny.usage.prompt_tokens == 4 and tiny.usage.completion_tokens == 5
    tiny_chat = client.chat.completions.create(model="dummy:tiny", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=2, extra_body=IGNORE_EOS)
    assert tiny_chat.model == "dummy:tiny" and tiny_chat.usage.completion_tokens == 2
    after = by_model(two_models, "kvforge:generation_tokens", "kvforge:generation_tokens_total")
    assert after["smol"] - before["smol"] == 3
    assert after["dummy:tiny"] - before["dummy:tiny"] == 7


def test_a_request_without_model_goes_to_the_first(two_models):
    before = by_model(two_models, "kvforge:generation_tokens", "kvforge:generation_tokens_total")
    r = httpx.post(f"{two_models.url}/v1/completions", json={"prompt": "Hello", "max_tokens": 2, **IGNORE_EOS},
                   timeout=60)
    assert r.status_code == 200 and r.json()["model"] == "smol"
    after = by_model(two_models, "kvforge:generation_tokens", "kvforge:generation_tokens_total")
    assert (after["smol"] - before["smol"], after["dummy:tiny"] - before["dummy:tiny"]) == (2, 0)


def test_tokenize_and_detokenize_route_by_model(two_models):
    for name in ("smol", "dummy:tiny"):
        r = httpx.post(f"{two_models.url}/tokenize", json={"model": name, "prompt": "Hello world"})
        assert r.status_code == 200 and r.json()["count"] > 0
        d = httpx.post(f"{two_models.url}/detokenize", json={"model": name, "tokens": r.json()["tokens"]})
        assert d.status_code == 200 and d.json()["prompt"] == "Hello world"
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
        r = httpx.post(f"{two_models.url}{path}", json={"model": "nope", **body})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_an_unknown_model_is_404_listing_the_served_names(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=1)
    err = info.value
    assert err.code == "model_not_found" and err.param == "model"
    assert "The model `gpt-4` does not exist" in err.message
    assert "smol" in err.message and "dummy:tiny" in err.message


def test_metrics_hold_each_family_once_with_a_series_per_model(two_models, client):
    client.completions.create(model="dummy:tiny", prompt=[1, 2, 3], max_tokens=2, extra_body=IGNORE_EOS)
    client.completions.create(model="smol", prompt=[1, 2, 3], max_tokens=2, extra_body=IGNORE_EOS)
    assert set(by_model(two_models, "kvforge:num_requests_running")) == {"smol", "dummy:tiny"}
    assert set(by_model(two_models, "kvforge:kv_cache_usage_perc")) == {"smol", "dummy:tiny"}
    counts = by_model(two_models, "kvforge:e2e_request_latency_seconds", "kvforge:e2e_request_latency_seconds_count")
    assert set(counts) == {"smol", "dummy:tiny"} and min(counts.values()) >= 1


# -- per-model engine options, from the command line and a config file -------------------------------------------
def configs(*argv: str) -> list[tuple]:
    """``kvforge serve ARGV``'s per-model (EngineConfig, served names)."""
    return served_model_configs(build_parser().parse_args(["serve", *argv]))


def write(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_repeated_model_flags_share_gpu_memory(tmp_path):
    (a, a_names), (b, b_names) = configs("dummy:tiny", "--model", "dummy:smollm2-135m", "--max-model-len", "128",
                                         "--gpu-memory-utilization", "0.8", "--served-model-name", "t", "t2")
    assert (a.model, a_names, b.model, b_names) == ("dummy:tiny", ["t", "t2"], "dummy:smollm2-135m",
                                                    ["dummy:smollm2-135m"])
    assert a.gpu_memory_utilization == b.gpu_memory_utilization == pytest.approx(0.4)
    assert a.max_model_len == b.max_model_len == 128
    assert [c.model for c, _ in configs("--model", "dummy:tiny", "--model", "dummy:smollm2-135m")] == [
        "dummy:tiny", "dummy:smollm2-135m"]
    (one, names), = configs("dummy:tiny")  # one model: its options as given, no share
    assert one.gpu_memory_utilization == 0.9 and names == ["dummy:tiny"]


def test_a_toml_models_list_overrides_the_shared_options(tmp_path):
    path = write(tmp_path, "multi.toml", """\
        max_model_len = 512
        max_num_seqs = 8
        gpu_memory_utilization = 0.8
        [plugins.fcfs]
        long_prefill_token_threshold = 64

        [[models]]
        model = "dummy:tiny"
        served_model_name = "tiny"

        [[models]]
        model = "dummy:smollm2-135m"
        served_model_name = ["smol", "smol-alias"]
        max_model_len = 256
        gpu_memory_utilization = 0.3
        [models.plugins.fcfs]
        long_prefill_token_threshold = 32
        """)
    (tiny, tiny_names), (smol, smol_names) = configs("--config", path, "--max-num-seqs", "4",
                                                     "--max-model-len", "1024")
    assert (tiny.model, tiny_names, smol.model, smol_names) == ("dummy:tiny", ["tiny"], "dummy:smollm2-135m",
                                                                ["smol", "smol-alias"])
    assert tiny.gpu_memory_utilization == pytest.approx(0.4)  # the shared 0.8 over two models
    assert smol.gpu_memory_utilization == 0.3  # its own
    assert (tiny.max_model_len, smol.max_model_len) == (1024, 256)  # file < flag < entry
    assert tiny.max_num_seqs == smol.max_num_seqs == 4
    assert tiny.plugins == {"fcfs": {"long_prefill_token_threshold": 64}}
    assert smol.plugins == {"fcfs": {"long_prefill_token_threshold": 32}}


def test_a_yaml_models_list_follows_the_positional_model(tmp_path):
    path = write(tmp_path, "multi.yaml", """\
        device: cpu
        seed: 3
        models:
          - model: dummy:smollm2-135m
            served_model_name: smol
            seed: 7
            speculative:
              method: ngram
              num_speculative_tokens: 2
          - model: dummy:llama-3.2-1b
            load_format: dummy
        """)
    got = configs("dummy:tiny", "--served-model-name", "first", "--config", path)
    assert [(c.model, names) for c, names in got] == [("dummy:tiny", ["first"]), ("dummy:smollm2-135m", ["smol"]),
                                                      ("dummy:llama-3.2-1b", ["dummy:llama-3.2-1b"])]
    assert [c.gpu_memory_utilization for c, _ in got] == pytest.approx([0.3, 0.3, 0.3])
    assert [c.seed for c, _ in got] == [3, 7, 3]
    assert [c.device for c, _ in got] == ["cpu"] * 3
    assert got[1][0].speculative_config == {"method": "ngram", "num_speculative_tokens": 2}
    assert got[0][0].speculative_config is None and got[2][0].load_format == "dummy"


def test_a_served_name_given_twice_is_refused_naming_it(tmp_path):
    with pytest.raises(ValueError, match=r"served_model_name: 'dummy:tiny' names two models"):
        configs("dummy:tiny", "--model", "dummy:tiny")
    path = write(tmp_path, "dup.toml", """\
        [[models]]
        model = "dummy:smollm2-135m"
        served_model_name = ["smol", "x"]
        """)
    with pytest.raises(ValueError, match=r"served_model_name: 'x' names two models"):
        configs("dummy:tiny", "--served-model-name", "x", "--config", path)


def test_bad_models_entries_are_refused_naming_the_field(tmp_path):
    no_model = write(tmp_path, "no_model.toml", """\
        [[models]]
        model = "dummy:tiny"
        [[models]]
        served_model_name = "orphan"
        """)
    with pytest.raises(ValueError, match=r"models\[1\]\.model: required"):
        configs("--config", no_model)
    bad_name = write(tmp_path, "bad_name.yaml", "models:\n  - model: dummy:tiny\n    served_model_name: [1]\n")
    with pytest.raises(ValueError, match=r"models\[0\]\.served_model_name"):
        configs("--config", bad_name)
    unknown = write(tmp_path, "unknown.yaml", "models:\n  - model: dummy:tiny\n  - {model: dummy:tiny, colour: red}\n")
    with pytest.raises(ValueError, match=r"unknown engine option\(s\) \['colour'\]"):
        configs("--config", unknown)
    with pytest.raises(ValueError, match=r"models: must be a list"):
        configs("--config", write(tmp_path, "not_list.yaml", "models: dummy:tiny\n"))


def test_serve_refuses_a_name_given_twice_with_exit_status_2():
    proc = subprocess.run([sys.executable, "-m", "kvforge.cli", "serve", "dummy:tiny", "--model", "dummy:tiny",
                           "--device", "cpu"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "served_model_name: 'dummy:tiny' names two models" in proc.stderr


# -- the app's lifetime with two engines -----------------------------------------------------------------------
def test_health_needs_every_engine_and_the_lifespan_runs_both(tmp_path):
    import dataclasses

    from fastapi.testclient import TestClient

    from kvforge.engine.async_engine import AsyncLLMEngine
    from kvforge.server.app import create_app

    path = write(tmp_path, "two.yaml", """\
        device: cpu
        num_gpu_blocks_override: 32
        max_model_len: 256
        models:
          - {model: dummy:tiny, served_model_name: a}
          - {model: dummy:tiny, served_model_name: b, max_model_len: 128}
        """)
    engines = [(AsyncLLMEngine.from_config(c), names) for c, names in configs("--config", path)]
    with pytest.raises(ValueError, match="'a' is given twice"):
        create_app([(engines[0][0], ["a"]), (engines[1][0], ["a"])])
    app = create_app(engines)
    with TestClient(app) as c:
        assert all(e.is_running for e, _ in engines) and c.get("/health").status_code == 200
        assert [(m["id"], m["max_model_len"]) for m in c.get("/v1/models").json()["data"]] == [("a", 256), ("b", 128)]
        r = c.post("/tokenize", json={"model": "b", "prompt": "hi"})
        assert r.json()["max_model_len"] == 128
        # the registry changes while serving: `b` is renamed `b2`
        models = app.state.models
        models.add(dataclasses.replace(models.remove("b"), name="b2"))
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["a", "b2"]
        assert c.post("/tokenize", json={"model": "b", "prompt": "hi"}).status_code == 404
        assert c.post("/tokenize", json={"model": "b2", "prompt": "hi"}).json()["max_model_len"] == 128

        def broken():
            raise RuntimeError("device lost")

        engines[1][0].engine.step = broken
        r = c.post("/v1/completions", json={"model": "b2", "prompt": "hi", "max_tokens": 3})
        assert r.status_code == 503 and "device lost" in r.json()["error"]["message"]
        health = c.get("/health")
        assert health.status_code == 503
        assert health.json()["error"]["message"] == "engine is not running: b: RuntimeError('device lost')"
        r = c.post("/v1/completions", json={"model": "a", "prompt": "hi", "max_tokens": 3, **IGNORE_EOS})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert not any(e.is_running for e, _ in engines)
