"""``--vs vllm`` on the CPU, against a stand-in vLLM (tests/bench/fake_vllm) run through the real
subprocess protocol: the same requests reach both engines, vLLM's row fills the same columns, and a
vLLM that does not import stops the run with an error naming what is missing."""
import json
import os
import sys

import pytest
import torch

from kvforge.bench.vllm_peer import BACKEND_LINE, VllmPeer, attention_backend
from kvforge.bench.workloads import make_workload
from kvforge.model.config import ModelConfig

HERE = os.path.dirname(os.path.abspath(__file__))
FAKE = os.path.join(HERE, "fake_vllm")
N, IN, OUT = 6, 12, 5
ENGINE = ["--model", "dummy:tiny", "--device", "cpu", "--max-model-len", "128", "--num-gpu-blocks-override", "64"]
VS = ["--vs", "vllm", "--vllm-path", FAKE]


@pytest.fixture
def record(tmp_path, monkeypatch):
    path = tmp_path / "vllm-calls.jsonl"
    monkeypatch.setenv("FAKE_VLLM_RECORD", str(path))

    def calls(kind: str) -> list[dict]:
        lines = path.read_text().splitlines() if path.exists() else []
        return [c for c in map(json.loads, lines) if c["call"] == kind]
    return calls


def bench(*argv: str) -> int:
    from kvforge.cli import main
    return main(["bench", *argv])


def test_throughput_sends_vllm_exactly_kvforges_requests(tmp_path, record, capsys):
    out = tmp_path / "tp.json"
    assert bench("throughput", *ENGINE, *VS, "--num-prompts", str(N), "--input-len", str(IN), "--output-len", str(OUT),
                 "--dataset", "uniform", "--seed", "3", "--json", str(out)) == 0
    data = json.loads(out.read_text())
    ours, vllm = data["rows"]
    assert vllm["engine"] == "vLLM 0.0.fake (FAKE_ATTN)" and vllm["attention_backend"] == "FAKE_ATTN"
    assert vllm.get("error") is None and vllm["output_tokens"] == ours["output_tokens"] == data["workload"]["output_tokens"]
    assert vllm["output_tok_s"] > 0 and vllm["ratio"] == pytest.approx(vllm["output_tok_s"] / ours["output_tok_s"])
    assert vllm["ttft_ms"]["n"] == N and vllm["itl_ms"]["n"] == data["workload"]["output_tokens"] - N
    # the very workload kvforge ran, in order, greedy, EOS ignored, no detokenisation, streamed as deltas
    mc = ModelConfig.from_preset("tiny")
    workload = make_workload("uniform", N, IN, OUT, mc.vocab_size, seed=3)
    sent = record("add_request")
    assert [c["prompt"] for c in sent] == [r.prompt_token_ids for r in workload]
    assert [c["max_tokens"] for c in sent] == [r.output_len for r in workload]
    assert all(c["temperature"] == 0 and c["ignore_eos"] and not c["detokenize"] and c["output_kind"] == "DELTA"
               for c in sent)
    warm = record("generate")  # the warm-up: other prompts than the timed ones
    assert warm and not {tuple(c["prompt"]) for c in warm} & {tuple(r.prompt_token_ids) for r in workload}
    (llm,) = record("LLM")
    kwargs = llm["kwargs"]
    assert kwargs["load_format"] == "dummy" and kwargs["dtype"] == "float32" and kwargs["skip_tokenizer_init"]
    assert "max_num_seqs" not in kwargs  # vLLM's own defaults
    text = capsys.readouterr()
    assert "vLLM 0.0.fake: attention backend FAKE_ATTN" in text.out and "[vllm] " in text.err


@pytest.mark.parametrize("choice", ["kvforge", "vllm"])
def test_vllm_random_weights_are_drawn_again_as_kvforges(tmp_path, record, choice):
    """vLLM's dummy weights (uniform +-1e-3, one seed per tensor size) are another model than kvforge's;
    by default the worker draws them again as kvforge does: norms 1, the rest N(0, 0.02)."""
    out = tmp_path / "tp.json"
    assert bench("throughput", *ENGINE, *VS, "--num-prompts", "2", "--input-len", str(IN), "--output-len", "2",
                 "--vllm-dummy-weights", choice, "--json", str(out)) == 0
    vllm_row = json.loads(out.read_text())["rows"][1]
    if choice == "vllm":
        assert record("apply_model") == [] and vllm_row["redrawn_parameters"] is None
        return
    (call,) = record("apply_model")
    assert call["env"] == "1" and call["result"] == 5 and vllm_row["redrawn_parameters"] == 5
    for name, stats in call["params"].items():
        if name.endswith("norm.weight"):
            assert stats["all_ones"], name
        else:
            assert stats["std"] == pytest.approx(0.02, rel=0.1) and abs(stats["mean"]) < 0.005, name


def test_real_weights_are_not_redrawn(tmp_path):
    from kvforge.bench.vllm_peer import redraw_spec
    assert redraw_spec({"model": str(tmp_path), "seed": 3}) is None
    assert redraw_spec({"model": str(tmp_path), "load_format": "dummy", "seed": 3}) == {"std": 0.02, "seed": 3}
    assert redraw_spec({"model": str(tmp_path), "load_format": "dummy"}, redraw=False) is None


def test_dummy_preset_becomes_a_config_directory(tmp_path):
    from kvforge.bench.vllm_peer import llm_kwargs
    from kvforge.model.loader import resolve_model_source

    mc = ModelConfig.from_preset("llama-3-8b")
    kwargs = llm_kwargs(resolve_model_source("dummy:llama-3-8b"), mc, torch.bfloat16, 0, str(tmp_path))
    with open(os.path.join(kwargs["model"], "config.json")) as f:
        config = json.load(f)
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_key_value_heads"] == 8
    assert config["vocab_size"] == 128256 and config["torch_dtype"] == "bfloat16" and kwargs["dtype"] == "bfloat16"


def test_latency_runs_the_same_batches_on_vllm(tmp_path, record):
    out = tmp_path / "lat.json"
    assert bench("latency", *ENGINE, *VS, "--batch-size", "3", "--input-len", str(IN), "--output-len", str(OUT),
                 "--num-iters-warmup", "1", "--num-iters", "2", "--json", str(out)) == 0
    ours, vllm = json.loads(out.read_text())["rows"]
    assert vllm["engine"].startswith("vLLM 0.0.fake") and len(vllm["latencies_s"]) == 2
    assert len(vllm["prefill_latencies_s"]) == 2 and vllm["vs_kvforge"] > 0 and ours["vs_kvforge"] == 1.0
    sent = record("generate")
    mc = ModelConfig.from_preset("tiny")
    batches = [make_workload("fixed", 3, IN, OUT, mc.vocab_size, seed=i) for i in range(5)]  # 1 + 2 + 2 runs
    assert [c["prompt"] for c in sent] == [r.prompt_token_ids for b in batches for r in b]
    assert [c["max_tokens"] for c in sent] == [OUT] * 9 + [1] * 6  # the prefill-only runs last


def test_missing_vllm_is_named_before_anything_loads(capsys):
    assert bench("throughput", *ENGINE, "--vs", "vllm", "--vllm-python", sys.executable) == 2
    err = capsys.readouterr()
    assert "vLLM does not import" in err.err and "'vllm' is missing" in err.err and "--vllm-python" in err.err
    assert "output tok/s" not in err.out  # kvforge's run never started


def test_broken_vllm_names_its_missing_dependency(monkeypatch, capsys):
    monkeypatch.setenv("FAKE_VLLM_BROKEN", "1")
    assert bench("latency", *ENGINE, *VS, "--batch-size", "2") == 2
    assert "the module 'msgspec' is missing" in capsys.readouterr().err


def test_a_vllm_run_that_goes_wrong_is_an_error_row(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_SHORT", "1")
    out = tmp_path / "tp.json"
    assert bench("throughput", *ENGINE, *VS, "--num-prompts", "2", "--input-len", str(IN), "--output-len", str(OUT),
                 "--json", str(out)) == 0
    ours, vllm = json.loads(out.read_text())["rows"]
    assert "expected exactly" in vllm["error"] and ours["output_tokens"] == 2 * OUT


@pytest.mark.parametrize("line, name", [
    ("INFO [cuda.py:318] Using FLASH_ATTN attention backend out of potential backends: ['FLASH_ATTN', 'FLASHINFER']",
     "FLASH_ATTN"),
    ("INFO [cuda.py:300] Using FLASHINFER backend.", "FLASHINFER"),
    ("Using AttentionBackendEnum.TRITON_ATTN backend.", "TRITON_ATTN"),
])
def test_backend_line(line, name):
    assert attention_backend(f"noise\n{line}\nmore") == name and BACKEND_LINE.search(line)


def test_vllm_path_goes_in_front_of_pythonpath(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/site")
    assert VllmPeer(path=["/vsite"]).env()["PYTHONPATH"] == os.pathsep.join(["/vsite", "/site"])


def test_serve_drives_both_servers_on_one_port_with_the_same_load(tmp_path, record, monkeypatch):
    # the stand-in `vllm serve` serves with kvforge on the CPU
    monkeypatch.setenv("FAKE_VLLM_SERVE_ARGS", "--device cpu --max-model-len 128 --num-gpu-blocks-override 64")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "serve.json"
    assert bench("serve", *ENGINE, *VS, "--num-prompts", "4", "--input-len", str(IN), "--output-len", "4",
                 "--max-concurrency", "2", "--json", str(out)) == 0
    rows = json.loads(out.read_text())["rows"]
    # each server driven by kvforge's client, then by vLLM's own (`vllm bench serve`)
    assert [(r["engine"], r["client"]) for r in rows] == [
        ("kvforge serve (process)", "kvforge"), ("kvforge serve (process)", "vllm"),
        ("vLLM 0.0.fake serve", "kvforge"), ("vLLM 0.0.fake serve", "vllm")]
    ours, vllm = rows[0], rows[2]
    assert ours["url"] == vllm["url"] and vllm["attention_backend"] == "FAKE_ATTN"
    for row in rows:
        assert row["completed"] == 4 and row["failed"] == 0 and row["output_tokens"] == 16 and row["cold_start_s"] > 0
    (serve,) = record("serve")
    argv = serve["argv"]
    assert argv[argv.index("--load-format") + 1] == "dummy" and argv[argv.index("--served-model-name") + 1] == "dummy:tiny"
    assert argv[argv.index("--port") + 1] == ours["url"].rsplit(":", 1)[1]
    assert serve["config_json"] and serve["tokenizer_json"]  # the preset's config, the default model's tokenizer
    # vLLM's client: the same flags against both servers but its backend name, one result each
    clients = [c["argv"] for c in record("bench serve")]
    assert [a[a.index("--backend") + 1] for a in clients] == ["openai", "vllm"]
    same = [{k: a[i + 1] for i, k in enumerate(a) if k.startswith("--") and k not in ("--backend", "--result-dir")}
            for a in clients]
    assert same[0] == same[1] and same[0]["--max-concurrency"] == "2" and same[0]["--base-url"] == ours["url"]
    saved = [c["result"] for c in record("bench serve result")]
    assert [r["ttft_ms"]["p50"] for r in (rows[1], rows[3])] == [s["p50_ttft_ms"] for s in saved]


def test_serve_vs_vllm_refuses_base_url(capsys):
    assert bench("serve", *ENGINE, *VS, "--base-url", "http://127.0.0.1:1") == 2
    assert "--base-url" in capsys.readouterr().err
