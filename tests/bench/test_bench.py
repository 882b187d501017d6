"""``kvforge bench``: workloads, percentiles, roofline, and each subcommand end to end on ``dummy:tiny``."""
import importlib.util
import json
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from kvforge.bench.metrics import (
    H200_BANDWIDTH,
    H200_FLOPS,
    Precision,
    attention_flops,
    decode_step_floor_s,
    decode_steps,
    kv_bytes_per_token,
    layer_params,
    param_count,
    percentile,
    precision_for,
    prefill_work,
    roofline,
    step_weight_bytes,
    summarize,
)
from kvforge.bench.workloads import BenchRequest, length_range, make_workload

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
N, IN, OUT = 8, 16, 8
ENGINE = ["--model", "dummy:tiny", "--device", "cpu", "--max-model-len", "256", "--num-gpu-blocks-override", "128"]
WORKLOAD = ["--num-prompts", str(N), "--input-len", str(IN), "--output-len", str(OUT)]


def bench(*argv: str) -> int:
    from kvforge.cli import main
    return main(["bench", *argv])


def load_json(path) -> dict:
    with open(path) as f:
        return json.load(f)


# -- helpers -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("q", [0, 1, 25, 50, 90, 99, 100])
def test_percentile_matches_numpy(q):
    values = [3.0, 1.0, 4.0, 1.5, 9.0, 2.6, 5.0]
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert percentile([7.0], q) == 7.0


def test_percentile_edges_and_summary():
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError, match="q must be in"):
        percentile([1.0], 101)
    assert summarize([]) is None
    s = summarize([0.001, 0.002, 0.003], 1e3)
    assert s["mean"] == pytest.approx(2.0) and s["p50"] == pytest.approx(2.0) and s["n"] == 3


def test_roofline_matches_documented_h200_estimate():
    from kvforge.model.config import ModelConfig

    mc = ModelConfig.from_preset("llama-3-8b")
    workload = [BenchRequest([i, 1] + [0] * 510, 256) for i in range(256)]
    # docs/benchmarks.md: ~13,326 output tok/s for W1 (every decode step's matmuls compute-bound at batch 256)
    floor = roofline(mc, workload, 256, 2, H200_BANDWIDTH, H200_FLOPS)
    assert floor.tok_s == pytest.approx(13326, rel=1e-3) and floor.compute_bound_steps == floor.decode_steps == 255


def tiny_shape():
    # layers 2, hidden 8, 2 heads of 4 (q = 8), 1 KV head (kv = 4), intermediate 16, vocab 32, untied
    return SimpleNamespace(num_hidden_layers=2, hidden_size=8, num_attention_heads=2, num_key_value_heads=1,
                           head_dim=4, intermediate_size=16, vocab_size=32, tie_word_embeddings=False)


def test_model_shape_arithmetic_by_hand():
    mc = tiny_shape()
    assert layer_params(mc) == 2 * (8 * (8 + 2 * 4) + 8 * 8 + 3 * 8 * 16) == 1152
    assert param_count(mc) == 1152 + 2 * 32 * 8  # embedding and LM head both stored
    assert step_weight_bytes(mc, 2) == (1152 + 256) * 2  # the embedding table is only gathered
    assert kv_bytes_per_token(mc, 2) == 2 * 2 * 1 * 4 * 2
    assert attention_flops(mc, 1) == 4 * 2 * 2 * 4


def test_prefill_counts_a_shared_prefix_once():
    # sorted: [1,2,3] computes 3 tokens (positions 0..2: 1+2+3 = 6 pairs); [1,2,4,5] shares 2, computes
    # positions 2..3 (3+4 = 7 pairs); an identical prompt still computes its last token (4 keys)
    w = [BenchRequest([1, 2, 4, 5], 2), BenchRequest([1, 2, 3], 3)]
    assert prefill_work(w) == (5, 13)
    assert prefill_work(w + [BenchRequest([1, 2, 3], 1)]) == (6, 16)


def test_decode_steps_are_ideal_continuous_batching():
    w = [BenchRequest([1, 2, 3], 3), BenchRequest([1, 2, 4, 5], 2), BenchRequest([9], 1)]
    # 2 slots: A (3 in) decodes at contexts 4, 5; B (4 in) at 5; C makes one token at prefill
    assert decode_steps(w, 2) == [(2, 4 + 5), (1, 5)]
    assert decode_steps(w, 1) == [(1, 4), (1, 5), (1, 5)]


def test_roofline_takes_the_slower_ceiling_of_each_kernel_kind():
    mc = tiny_shape()
    w = [BenchRequest([1, 2, 3], 3), BenchRequest([1, 2, 4, 5], 2)]
    # bandwidth-bound: 1000 B/s, 1e5 FLOP/s. Step 1 (batch 2, contexts 9): weights 2816 B = 2.816 s
    # against 2 * 1408 * 2 FLOPs = 0.056 s; KV 9 * 32 B = 0.288 s against 9 * 64 FLOPs = 0.006 s.
    # Step 2 (batch 1, context 5): 2.816 + 0.160. Prefill: 2 * 1152 * 5 + 2 * 256 * 2 + 64 * 13 FLOPs.
    floor = roofline(mc, w, 2, 2, 1000.0, 1e5)
    assert floor.decode_s == pytest.approx(2.816 + 0.288 + 2.816 + 0.160)
    assert floor.prefill_s == pytest.approx((11520 + 1024 + 832) / 1e5)
    assert floor.tok_s == pytest.approx(5 / (floor.decode_s + floor.prefill_s)) and floor.compute_bound_steps == 0
    # compute-bound matmuls and attention at 1000 FLOP/s: step 1 is 5.632 + 0.576 s
    assert decode_step_floor_s(mc, 2, 2, 9, 1000.0, 1000.0) == pytest.approx(5.632 + 0.576)
    # the knee is at 2816 / 1000 * 1000 / (2 * 1408) = 1 sequence: batch 2 is past it, batch 1 on it
    assert roofline(mc, w, 2, 2, 1000.0, 1000.0).compute_bound_steps == 1
    assert roofline(mc, w, 2, 2, 1000.0, 500.0).compute_bound_steps == 2


def test_roofline_counts_quantized_weights_and_an_fp8_kv_cache_at_their_own_bytes():
    mc = tiny_shape()  # 1152 layer weights, 256 LM-head weights, 16 KV elements per token
    fp8 = precision_for("fp8", {}, None, 2, 1)
    assert fp8 == Precision(1, 2, 1, 2.0)  # FP8 layers (the LM head stays bf16), FP8 tensor cores, FP8 KV
    assert step_weight_bytes(mc, fp8) == 1152 * 1 + 256 * 2 and kv_bytes_per_token(mc, fp8) == 16
    # compute-bound at 1000 FLOP/s, batch 2, contexts 9: layer matmuls at twice the rate, the LM head not
    assert decode_step_floor_s(mc, fp8, 2, 9, 1e12, 1000.0) == pytest.approx(
        (2 * 1152 * 2 / 2 + 2 * 256 * 2) / 1000 + 9 * 64 / 1000)
    # INT4 with groups of 64 in bf16: half a byte plus a 2-byte scale and a 2-byte zero point per 64
    int4 = precision_for("awq", {}, {"quant_method": "awq", "group_size": 64}, 2, 2)
    assert int4.layer_bytes == 0.5 + 4 / 64 and int4.matmul_speedup == 1.0
    assert precision_for("int4", {"group_size": 32}, None, 2, 2).layer_bytes == 0.5 + 4 / 32
    ct = {"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {"num_bits": 8}}}}
    assert precision_for("compressed-tensors", {}, ct, 2, 2).layer_bytes == 1
    # a plugin's method kvforge cannot see into counts as the model dtype
    assert precision_for("dummy_int8", {}, None, 2, 2) == Precision(2, 2, 2)


# -- workloads ----------------------------------------------------------------------------------------
def test_fixed_workload_is_seeded():
    a = make_workload("fixed", N, IN, OUT, vocab_size=49152, seed=3)
    assert a == make_workload("fixed", N, IN, OUT, vocab_size=49152, seed=3)
    assert a != make_workload("fixed", N, IN, OUT, vocab_size=49152, seed=4)
    assert all(r.input_len == IN and r.output_len == OUT for r in a)
    assert all(100 <= t < 49152 - 100 for r in a for t in r.prompt_token_ids)


def test_uniform_lengths_in_range():
    w = make_workload("uniform", 200, 100, 40, vocab_size=49152, seed=0, range_ratio=0.5)
    assert all(50 <= r.input_len <= 150 and 20 <= r.output_len <= 60 for r in w)
    assert len({r.input_len for r in w}) > 20 and len({r.output_len for r in w}) > 10
    assert length_range(1, 0.9) == (1, 1)


def test_shared_prefix_prompts_share_exactly_the_prefix():
    w = make_workload("shared-prefix", N, 32, OUT, vocab_size=49152, seed=0, prefix_len=20)
    prefix = w[0].prompt_token_ids[:20]
    assert all(r.input_len == 32 and r.prompt_token_ids[:20] == prefix for r in w)
    assert len({tuple(r.prompt_token_ids[20:]) for r in w}) == N  # the rest is each prompt's own
    assert len({r.prompt_token_ids[20] for r in w}) > 1  # from the first token past the prefix
    default = make_workload("shared-prefix", 2, 32, OUT, vocab_size=49152)
    assert default[0].prompt_token_ids[:16] == default[1].prompt_token_ids[:16]  # input_len // 2


@pytest.mark.parametrize("kwargs, flag", [
    (dict(dataset="zipf"), "--dataset"), (dict(num_prompts=0), "--num-prompts"),
    (dict(output_len=0), "--output-len"), (dict(dataset="uniform", range_ratio=1.0), "--range-ratio"),
    (dict(dataset="shared-prefix", prefix_len=IN), "--prefix-len"),
])
def test_bad_workload_names_the_flag(kwargs, flag):
    args = dict(dataset="fixed", num_prompts=N, input_len=IN, output_len=OUT, vocab_size=1000) | kwargs
    with pytest.raises(ValueError, match=flag):
        make_workload(**args)


# -- subcommands --------------------------------------------------------------------------------------
def test_throughput_vs_hf_generate(tmp_path, capsys):
    out = tmp_path / "tp.json"
    assert bench("throughput", *ENGINE, *WORKLOAD, "--vs", "hf-generate", "--hf-batch-size", "4",
                 "--vs", "hf-continuous", "--json", str(out)) == 0
    data = load_json(out)
    ours, hf, cb = data["rows"]
    # transformers' continuous batching: a result, or (an API it does not know) an error in its row
    assert cb["engine"] == "transformers generate_batch"
    assert cb.get("error") or (cb["output_tokens"] == N * OUT and cb["output_tok_s"] > 0)
    assert ours["engine"].startswith("kvforge") and hf["engine"].startswith("transformers generate")
    for row in (ours, hf):
        assert row.get("error") is None
        assert row["output_tokens"] == N * OUT and row["output_tok_s"] > 0 and row["req_s"] > 0
    assert ours["ratio"] == 1.0 and hf["ratio"] > 0
    for key in ("ttft_ms", "tpot_ms", "itl_ms"):
        assert ours[key]["p50"] > 0 and ours[key]["p99"] >= ours[key]["p50"]
    assert ours["itl_ms"]["n"] == N * (OUT - 1)  # one delta per token
    assert data["roofline_tok_s"] is None and ours["roofline_frac"] is None  # CPU: no ceilings given
    assert data["workload"] == {"dataset": "fixed", "num_requests": N, "prompt_tokens": N * IN,
                                "output_tokens": N * OUT}
    table = capsys.readouterr().out
    assert "TTFT ms p50/p99" in table and "roofline n/a on CPU" in table


def test_legacy_wrapper_flags_and_roofline(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_throughput", os.path.join(ROOT, "benchmarks", "throughput.py"))
    wrapper = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(wrapper)
    out = tmp_path / "legacy.json"
    assert wrapper.main(["--model", "dummy:tiny", "--device", "cpu", "--num-prompts", "4", "--input-len", "8",
                         "--output-len", "4", "--attention-backend", "torch", "--dtype", "float32",
                         "--max-num-seqs", "2", "--max-num-batched-tokens", "64", "--seed", "1",
                         "--bandwidth", "1e10", "--flops", "1e12", "--json", str(out)]) == 0
    data = load_json(out)
    assert data["rows"][0]["engine"] == "kvforge (torch)" and data["rows"][0]["max_num_seqs"] == 2
    assert data["roofline_tok_s"] > 0 and 0 < data["rows"][0]["roofline_frac"]
    assert data["args"]["seed"] == 1 and data["dtype"] == "float32"


def test_latency(tmp_path, capsys):
    out = tmp_path / "lat.json"
    assert bench("latency", *ENGINE, "--batch-size", "4", "--input-len", str(IN), "--output-len", str(OUT),
                 "--num-iters-warmup", "1", "--num-iters", "3", "--bandwidth", "1e10", "--flops", "1e12",
                 "--json", str(out)) == 0
    row = load_json(out)["rows"][0]
    assert len(row["latencies_s"]) == 3 and row["latency_p99_s"] >= row["latency_p50_s"] > row["prefill_s"] > 0
    assert row["decode_step_s"] > 0 and row["decode_floor_s"] > 0 and row["floor_ratio"] > 0
    out = capsys.readouterr().out
    assert "decode step ms" in out
    # the header names the device, the ceilings and where they came from
    assert "roofline ceilings of CPU: 0.01 TB/s copy, 1 TFLOP/s bf16 matmul (--bandwidth, --flops)" in out


@pytest.mark.parametrize("rate", ["inf", "50"])
def test_serve_in_process(tmp_path, rate):
    out = tmp_path / "serve.json"
    assert bench("serve", *ENGINE, *WORKLOAD, "--dataset", "uniform", "--request-rate", rate,
                 "--max-concurrency", "4", "--json", str(out)) == 0
    data = load_json(out)
    row = data["rows"][0]
    assert row["completed"] == N and row["failed"] == 0 and row["errors"] == []
    assert row["output_tokens"] == data["workload"]["output_tokens"] and row["output_tok_s"] > 0
    assert row["cold_start_s"] > 0 and row["ttft_ms"]["n"] == N and row["e2e_ms"]["p50"] > 0
    if rate == "50":  # Poisson arrivals at 50/s: 8 requests take tens of ms at least to arrive
        assert row["seconds"] > 0.02


SPEC = ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "policy": "fixed"}']


@pytest.mark.parametrize("command,extra", [
    ("throughput", WORKLOAD),
    ("latency", ["--batch-size", "4", "--input-len", str(IN), "--output-len", "16", "--num-iters-warmup", "0",
                 "--num-iters", "2"]),
    ("serve", WORKLOAD),
])
def test_speculative_config_reaches_every_subcommand_and_its_report(tmp_path, capsys, command, extra):
    out = tmp_path / "spec.json"
    assert bench(command, *ENGINE, *SPEC, *extra, "--json", str(out)) == 0
    row = load_json(out)["rows"][0]
    spec = row["spec_decode"]
    assert spec["num_draft_tokens"] > 0 and sum(spec["accepted_by_position"]) == spec["num_accepted_tokens"]
    assert spec["mean_accepted_length"] == pytest.approx(1 + spec["num_accepted_tokens"] / spec["num_drafts"])
    if command == "throughput":
        assert row["output_tokens"] == N * OUT  # exactly the tokens asked for, drafts or not
    assert "speculative decoding:" in capsys.readouterr().out


def test_cli_entry_point_subprocess(tmp_path):
    out = tmp_path / "cli.json"
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "kvforge.cli", "bench", "throughput", *ENGINE, *WORKLOAD,
                           "--dataset", "shared-prefix", "--input-len", "40", "--prefix-len", "32", "--json", str(out)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "kvforge (" in proc.stdout and "output tok/s" in proc.stdout
    row = load_json(out)["rows"][0]
    assert row["output_tokens"] == N * OUT and row["prefix_cache_hits"] > 0  # two full blocks of the shared 32 tokens are reused


def test_bad_flag_is_rejected_before_loading(capsys):
    assert bench("throughput", *ENGINE, "--num-prompts", "0") == 2
    assert "--num-prompts" in capsys.readouterr().err
    assert bench("serve", *ENGINE, "--request-rate", "0") == 2


def test_plot_without_matplotlib(tmp_path, monkeypatch, capsys):
    from kvforge.bench.report import write_plot

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    assert write_plot(str(tmp_path / "p.png"), [{"engine": "kvforge", "output_tok_s": 1.0}],
                      "output_tok_s", "tok/s", "t") is False
    assert "matplotlib is not installed" in capsys.readouterr().err
    assert not (tmp_path / "p.png").exists()


def test_benchmarks_md_names_every_bench_flag():
    # engine flags are held to docs/configuration.md; every other flag of the three subcommands is here
    import argparse

    from kvforge.cli import add_engine_args, build_parser

    parser = build_parser()
    probe = argparse.ArgumentParser(add_help=False)
    add_engine_args(probe)
    engine = {s for a in probe._actions for s in a.option_strings}
    bench_sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["bench"]
    subs = next(a for a in bench_sub._actions if isinstance(a, argparse._SubParsersAction)).choices
    with open(os.path.join(ROOT, "docs", "benchmarks.md")) as f:
        text = f.read()
    missing = sorted({s for sub in subs.values() for a in sub._actions for s in a.option_strings
                      if s.startswith("--") and s != "--help" and s not in engine and f"`{s}" not in text})
    assert not missing, f"docs/benchmarks.md does not name {missing}"


def test_moe_roofline_counts_the_experts_a_step_reads():
    from kvforge.bench.metrics import active_layer_params, experts_touched
    from kvforge.model.config import ModelConfig

    mc = ModelConfig.from_preset("qwen3-30b-a3b")
    attn = mc.hidden_size * (32 * 128 + 2 * 4 * 128) + 32 * 128 * mc.hidden_size
    expert = 3 * mc.hidden_size * 768
    assert layer_params(mc) == 48 * (attn + 128 * expert)  # every stored expert
    assert active_layer_params(mc) == 48 * (attn + 8 * expert)  # one token's 8 experts: its FLOPs
    assert experts_touched(mc, 1) == pytest.approx(8)
    assert experts_touched(mc, 256) == pytest.approx(128 * (1 - (1 - 8 / 128) ** 256))  # all but ~0
    head = mc.vocab_size * mc.hidden_size * 2
    assert step_weight_bytes(mc, 2, 1) == pytest.approx(48 * (attn + 8 * expert) * 2 + head)
    dense = ModelConfig.from_preset("llama-3-8b")
    assert step_weight_bytes(dense, 2, 1) == step_weight_bytes(dense, 2)  # a dense step reads every weight
