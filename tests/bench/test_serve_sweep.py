"""``kvforge bench serve``'s sweep: the plan of its flags, vLLM's client (its arguments, its saved JSON)
and the medians and spreads over runs, against the real server on ``dummy:tiny`` and the stand-in
``vllm bench serve`` of tests/bench/fake_vllm."""
import json
import os

import pytest

from kvforge.bench import vllm_client
from kvforge.bench.metrics import percentile
from kvforge.bench.sweep import aggregate, plan_of

HERE = os.path.dirname(os.path.abspath(__file__))
FAKE = os.path.join(HERE, "fake_vllm")
N, IN, OUT = 4, 12, 4
ENGINE = ["--model", "dummy:tiny", "--device", "cpu", "--max-model-len", "128", "--num-gpu-blocks-override", "64"]
WORKLOAD = ["--num-prompts", str(N), "--input-len", str(IN), "--output-len", str(OUT)]


def bench(*argv: str) -> int:
    from kvforge.cli import main
    return main(["bench", *argv])


def serve_args(*argv: str):
    from kvforge.cli import build_parser
    return build_parser().parse_args(["bench", "serve", *ENGINE, *argv])


@pytest.fixture
def record(tmp_path, monkeypatch):
    path = tmp_path / "vllm-calls.jsonl"
    monkeypatch.setenv("FAKE_VLLM_RECORD", str(path))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")

    def calls(kind: str) -> list[dict]:
        lines = path.read_text().splitlines() if path.exists() else []
        return [c for c in map(json.loads, lines) if c["call"] == kind]
    return calls


# -- the plan -------------------------------------------------------------------------------------------
def test_plan_of_the_flags():
    single = plan_of(serve_args())
    assert single.points == [(float("inf"), None)] and single.runs == 1 and not single.aggregated
    assert single.clients == ("kvforge",)
    sweep = plan_of(serve_args("--request-rates", "2,8,inf", "--concurrencies", "1,16"))
    assert sweep.points == [(2, 1), (2, 16), (8, 1), (8, 16), (float("inf"), 1), (float("inf"), 16)]
    assert sweep.runs == 3 and sweep.aggregated and sweep.num_workloads == 18
    assert [sweep.seed_offset(p, r) for p in range(2) for r in range(3)] == [0, 1, 2, 3, 4, 5]
    assert plan_of(serve_args("--runs", "2")).aggregated  # one point, two runs: medians and spreads
    assert plan_of(serve_args("--vs", "vllm")).clients == ("kvforge", "vllm")
    assert plan_of(serve_args("--client", "vllm,kvforge,vllm")).clients == ("vllm", "kvforge")


@pytest.mark.parametrize("argv, flag", [
    (["--request-rates", "2,0"], "--request-rates"), (["--request-rate", "0"], "--request-rate"),
    (["--concurrencies", "4,0"], "--concurrencies"), (["--max-concurrency", "0"], "--max-concurrency"),
    (["--runs", "0"], "--runs"), (["--client", "guidellm"], "--client"),
    (["--client", "vllm", "--dataset", "edit"], "--client vllm"),
])
def test_bad_sweep_flags_name_the_flag(argv, flag):
    with pytest.raises(ValueError, match=flag):
        plan_of(serve_args(*argv))


def test_a_list_flag_that_does_not_parse_is_refused_by_argparse(capsys):
    with pytest.raises(SystemExit):
        serve_args("--request-rates", "2,fast")
    assert "--request-rates: expected comma-separated floats" in capsys.readouterr().err


# -- vLLM's client --------------------------------------------------------------------------------------
def argv_of(**overrides) -> list[str]:
    kwargs = dict(url="http://127.0.0.1:9", model="m", tokenizer="/tok", backend="openai", dataset="fixed",
                  num_prompts=10, input_len=512, output_len=128, range_ratio=0.5, prefix_len=None,
                  request_rate=8.0, max_concurrency=16, seed=3, result_dir="/res") | overrides
    argv = vllm_client.bench_serve_argv(**kwargs)
    assert argv[:2] == ["bench", "serve"]
    return argv


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_vllm_client_gets_the_same_load_in_its_own_flags():
    argv = argv_of()
    expected = {"--backend": "openai", "--base-url": "http://127.0.0.1:9", "--model": "m", "--tokenizer": "/tok",
                "--dataset-name": "random", "--random-input-len": "512", "--random-output-len": "128",
                "--random-range-ratio": "0.0", "--num-prompts": "10", "--request-rate": "8.0",
                "--max-concurrency": "16", "--seed": "3", "--percentile-metrics": "ttft,tpot,itl,e2el",
                "--metric-percentiles": "50,99", "--result-dir": "/res", "--temperature": "0"}
    assert {k: flag(argv, k) for k in expected} == expected
    assert {"--ignore-eos", "--save-result"} <= set(argv) and "--random-prefix-len" not in argv
    unlimited = argv_of(request_rate=float("inf"), max_concurrency=None, dataset="uniform", backend="vllm")
    assert flag(unlimited, "--request-rate") == "inf" and "--max-concurrency" not in unlimited
    assert flag(unlimited, "--random-range-ratio") == "0.5" and flag(unlimited, "--backend") == "vllm"
    prefix = argv_of(dataset="shared-prefix", prefix_len=384)
    assert flag(prefix, "--random-prefix-len") == "384" and flag(prefix, "--random-input-len") == "128"
    assert flag(argv_of(dataset="shared-prefix"), "--random-prefix-len") == "256"  # input-len // 2
    with pytest.raises(ValueError, match="'edit'"):
        argv_of(dataset="edit")


def test_vllm_client_reads_vllms_saved_result():
    # the keys `vllm bench serve --save-result` writes (vllm/benchmarks/serve.py), less the per-request lists
    saved = {"date": "20261128-120000", "backend": "vllm", "model_id": "m", "num_prompts": 200, "request_rate": 8.0,
             "max_concurrency": None, "duration": 25.6, "completed": 199, "failed": 1, "total_input_tokens": 101888,
             "total_output_tokens": 25472, "request_throughput": 7.77, "output_throughput": 995.0,
             "total_token_throughput": 4975.0, "mean_ttft_ms": 30.1, "median_ttft_ms": 27.4, "std_ttft_ms": 5.0,
             "p50_ttft_ms": 27.4, "p99_ttft_ms": 52.9, "mean_tpot_ms": 5.1, "median_tpot_ms": 5.08,
             "p50_tpot_ms": 5.08, "p99_tpot_ms": 5.74, "mean_itl_ms": 5.1, "median_itl_ms": 4.9, "p50_itl_ms": 4.9,
             "p99_itl_ms": 9.0, "mean_e2el_ms": 680.0, "median_e2el_ms": 670.0, "p50_e2el_ms": 670.0,
             "p99_e2el_ms": 750.0, "errors": ["", "HTTP 500", ""]}
    row = vllm_client.row_from_result(saved)
    assert (row["seconds"], row["completed"], row["failed"], row["errors"]) == (25.6, 199, 1, ["HTTP 500"])
    assert (row["output_tokens"], row["prompt_tokens"], row["vllm_output_throughput"]) == (25472, 101888, 995.0)
    assert row["ttft_ms"] == {"mean": 30.1, "p50": 27.4, "p99": 52.9, "n": 199}
    assert row["tpot_ms"]["p50"] == 5.08 and row["itl_ms"] == {"mean": 5.1, "p50": 4.9, "p99": 9.0, "n": None}
    assert row["e2e_ms"]["p99"] == 750.0
    # an older vLLM: no "failed", only the median
    old = {k: v for k, v in saved.items() if k not in ("failed", "p50_ttft_ms", "errors")}
    assert vllm_client.row_from_result(old)["failed"] == 1 and vllm_client.row_from_result(old)["ttft_ms"]["p50"] == 27.4


# -- the sweep ------------------------------------------------------------------------------------------
def test_aggregate_gives_the_median_and_spread_of_each_point_by_hand():
    def run(engine, ttft, tok_s, failed=0, rate=2.0):
        return {"engine": engine, "client": "kvforge", "request_rate": rate, "max_concurrency": 1, "failed": failed,
                "ttft_ms": {"p50": ttft, "p99": 2 * ttft}, "tpot_ms": {"p50": 1.0}, "itl_ms": None,
                "output_tok_s": tok_s}
    records = [run("A", 1.0, 100.0), run("A", 10.0, 300.0, failed=2), run("B", 5.0, 50.0), run("A", 2.0, 200.0),
               {"engine": "A", "client": "kvforge", "request_rate": 2.0, "max_concurrency": 1, "error": "boom"},
               run("A", 7.0, 70.0, rate=8.0)]
    a, b, a8 = aggregate(records)
    assert (a["engine"], a["request_rate"], b["engine"], a8["request_rate"]) == ("A", 2.0, "B", 8.0)
    assert (a["runs_ok"], a["runs"], a["failed"], a["run_errors"]) == (3, 4, 2, ["boom"])
    assert a["ttft_p50_ms"] == {"median": 2.0, "min": 1.0, "max": 10.0, "n": 3}
    assert a["ttft_p99_ms"] == {"median": 4.0, "min": 2.0, "max": 20.0, "n": 3}
    assert a["output_tok_s"] == {"median": 200.0, "min": 100.0, "max": 300.0, "n": 3}
    assert a["itl_p50_ms"] is None and a["tpot_p50_ms"]["median"] == 1.0
    assert b["ttft_p50_ms"] == {"median": 5.0, "min": 5.0, "max": 5.0, "n": 1} and a8["runs"] == 1


def test_sweep_against_the_real_server_with_both_clients(tmp_path, record, capsys):
    out = tmp_path / "sweep.json"
    assert bench("serve", *ENGINE, *WORKLOAD, "--request-rates", "40,inf", "--concurrencies", "2", "--runs", "2",
                 "--client", "kvforge,vllm", "--vllm-path", FAKE, "--bandwidth", "1e10", "--flops", "1e12",
                 "--json", str(out)) == 0
    data = json.loads(out.read_text())
    runs = data["runs"]
    # points, then runs, then clients; run k of point p seeded --seed + 2p + k, the same for both clients
    assert [(r["request_rate"], r["run"], r["client"], r["seed"]) for r in runs] == [
        (40, 0, "kvforge", 0), (40, 0, "vllm", 0), (40, 1, "kvforge", 1), (40, 1, "vllm", 1),
        (float("inf"), 0, "kvforge", 2), (float("inf"), 0, "vllm", 2), (float("inf"), 1, "kvforge", 3),
        (float("inf"), 1, "vllm", 3)]
    for r in runs:
        assert r["completed"] == N and r["failed"] == 0 and r["output_tokens"] == N * OUT and r["max_concurrency"] == 2
        assert r["roofline_frac"] > 0  # the ceilings given
    # vLLM's client: its flags, and its rows exactly what it saved
    sent = record("bench serve")
    assert len(sent) == 4 and all(c["tokenizer_json"] for c in sent)
    assert [flag(c["argv"], "--seed") for c in sent] == ["0", "1", "2", "3"]
    assert [flag(c["argv"], "--request-rate") for c in sent] == ["40.0", "40.0", "inf", "inf"]
    assert {flag(c["argv"], "--base-url") for c in sent} == {runs[0]["url"]}
    assert {flag(c["argv"], "--model") for c in sent} == {"dummy:tiny"}
    saved = [c["result"] for c in record("bench serve result")]
    for r, s in zip([r for r in runs if r["client"] == "vllm"], saved):
        assert (r["seconds"], r["ttft_ms"]["p50"], r["ttft_ms"]["p99"], r["tpot_ms"]["p50"], r["itl_ms"]["p50"]) == (
            s["duration"], s["p50_ttft_ms"], s["p99_ttft_ms"], s["p50_tpot_ms"], s["p50_itl_ms"])
        assert r["output_tok_s"] == pytest.approx(s["output_throughput"])
    # one row per (server, client, point): the median and spread of its two runs
    rows = data["rows"]
    assert [(r["client"], r["request_rate"], r["runs_ok"]) for r in rows] == [
        ("kvforge", 40, 2), ("vllm", 40, 2), ("kvforge", float("inf"), 2), ("vllm", float("inf"), 2)]
    for row in rows:
        mine = [r for r in runs if (r["client"], r["request_rate"]) == (row["client"], row["request_rate"])]
        for stat, figure in (("ttft_p50_ms", lambda r: r["ttft_ms"]["p50"]), ("ttft_p99_ms", lambda r: r["ttft_ms"]["p99"]),
                             ("tpot_p50_ms", lambda r: r["tpot_ms"]["p50"]), ("itl_p50_ms", lambda r: r["itl_ms"]["p50"]),
                             ("output_tok_s", lambda r: r["output_tok_s"])):
            values = [figure(r) for r in mine]
            assert row[stat] == {"median": pytest.approx(percentile(values, 50)), "min": min(values),
                                 "max": max(values), "n": 2}, stat
    assert data["sweep"] == {"request_rates": [40, float("inf")], "concurrencies": [2], "runs": 2,
                             "clients": ["kvforge", "vllm"]}
    assert data["ceilings"]["source"] == "--bandwidth, --flops"
    text = capsys.readouterr().out
    assert "rates 40, inf req/s x max concurrency 2, 2 runs each" in text and "TTFT p99 ms" in text
    assert "roofline ceilings of CPU: 0.01 TB/s copy, 1 TFLOP/s bf16 matmul (--bandwidth, --flops)" in text


def test_a_vllm_client_that_saves_nothing_is_an_error_run(tmp_path, record, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_VLLM_BENCH_FAIL", "1")
    out = tmp_path / "fail.json"
    assert bench("serve", *ENGINE, *WORKLOAD, "--client", "kvforge,vllm", "--vllm-path", FAKE,
                 "--json", str(out)) == 1
    ours, theirs = json.loads(out.read_text())["rows"]
    assert ours["completed"] == N and "error" not in ours
    assert "saved 0 results" in theirs["error"] and "fake failure" in theirs["error"]
    assert "kvforge serve (in-process), vllm client: vllm bench serve (status 1)" in capsys.readouterr().out
