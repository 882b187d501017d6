"""``kvforge bench throughput``: the whole workload offline at once, then the peers on the same workload.

Measurement (one approach for every column): after a warm-up ``LLM.generate`` of different prompts,
every request is added to the ``LLMEngine`` at once with ``stream_deltas=True`` and the engine is
stepped to completion by hand: the loop ``LLM.generate`` runs, plus a ``perf_counter`` stamp per delta.
``seconds`` is first ``add_request`` to last output. TTFT and TPOT come from ``RequestOutput.metrics``
(TTFT = first_token_time - arrival_time; TPOT = (finished_time - first_token_time) / (output_len - 1));
ITL is the gap between a request's consecutive deltas (one token each without speculative decoding).
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Sequence

import torch

from kvforge.bench import report
from kvforge.bench.ceilings import Ceilings, for_device
from kvforge.bench.metrics import engine_precision, roofline, summarize
from kvforge.bench.peers import free_memory, run_peer, sync
from kvforge.bench.spec_stats import describe as describe_spec
from kvforge.bench.spec_stats import spec_delta
from kvforge.bench.workloads import BenchRequest, check_fits, make_workload

#: output tokens of each warm-up request
WARM_TOKENS = 4


def build_llm(args: argparse.Namespace) -> tuple[Any, float]:
    """The kvforge ``LLM`` for the engine flags, and the seconds its construction took."""
    from kvforge import LLM
    from kvforge.cli import engine_kwargs

    kwargs = engine_kwargs(args)
    t0 = time.perf_counter()
    llm = LLM(kwargs.pop("model", None), config=kwargs.pop("config", None), **kwargs)
    return llm, time.perf_counter() - t0


def workload_for(args: argparse.Namespace, vocab_size: int, num_prompts: int | None = None,
                 seed_offset: int = 0, tokenizer: Any = None) -> list[BenchRequest]:
    return make_workload(args.dataset, num_prompts or args.num_prompts, args.input_len, args.output_len,
                         vocab_size, seed=(args.seed or 0) + seed_offset, range_ratio=args.range_ratio,
                         prefix_len=args.prefix_len, tokenizer=tokenizer)


def warm_prompts(args: argparse.Namespace, vocab_size: int, n: int) -> list[list[int]]:
    """Prompts unlike the workload's (another seed), so that no timed prompt is prefix-cached."""
    return [r.prompt_token_ids for r in make_workload("fixed", min(8, n), args.input_len, WARM_TOKENS,
                                                      vocab_size, seed=(args.seed or 0) + 1_000_003)]


def warm_up(llm: Any, args: argparse.Namespace, n: int, loras: Sequence[Any] | None = None) -> None:
    """A short generate of :func:`warm_prompts`; with ``loras`` (``LoRARequest`` objects), warm-up prompt i runs
    under ``loras[i % len(loras)]``, so that those adapters are loaded before anything is timed."""
    from kvforge import SamplingParams

    prompts = warm_prompts(args, llm.llm_engine.model_config.vocab_size, n)
    lora_kwargs = {"lora_request": [loras[i % len(loras)] for i in range(len(prompts))]} if loras else {}
    llm.generate(prompts, SamplingParams(max_tokens=WARM_TOKENS, ignore_eos=True), use_tqdm=False, **lora_kwargs)
    sync(llm.llm_engine.device)


def run_streamed(engine: Any, workload: list[BenchRequest], lora_requests: Sequence[Any] | None = None) -> dict:
    """Run the workload through ``engine`` (all requests at once), stamping every streamed delta.
    ``lora_requests``: one ``LoRARequest`` (or None: the base model) per request of ``workload``."""
    from kvforge import SamplingParams

    if lora_requests is not None and len(lora_requests) != len(workload):
        raise ValueError(f"lora_requests: got {len(lora_requests)} for {len(workload)} requests")
    loras = lora_requests if lora_requests is not None else [None] * len(workload)
    t0 = time.perf_counter()
    ids = [engine.add_request(None, r.prompt_token_ids,
                              SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True),
                              stream_deltas=True, **({"lora_request": lora} if lora is not None else {}))
           for r, lora in zip(workload, loras)]
    stamps: dict[str, list[float]] = {i: [] for i in ids}
    counts = dict.fromkeys(ids, 0)
    metrics: dict[str, Any] = {}
    try:
        while engine.has_unfinished_requests():
            outs = engine.step()
            now = time.perf_counter()
            for out in outs:
                n = len(out.outputs[0].token_ids)
                if n:
                    stamps[out.request_id].append(now)
                    counts[out.request_id] += n
                if out.finished:
                    metrics[out.request_id] = out.metrics
    except BaseException:
        engine.abort_request([i for i in ids if i not in metrics])
        raise
    elapsed = time.perf_counter() - t0
    for rid, r in zip(ids, workload):
        if counts[rid] != r.output_len:  # EOS is ignored: anything else is an engine bug
            raise RuntimeError(f"request {rid} generated {counts[rid]} tokens, expected exactly {r.output_len}")
    ms = [metrics[i] for i in ids]
    return {
        "seconds": elapsed, "output_tokens": sum(counts.values()),
        "ttft_ms": summarize((m.first_token_time - m.arrival_time for m in ms), 1e3),
        "tpot_ms": summarize(((m.finished_time - m.first_token_time) / (r.output_len - 1)
                              for m, r in zip(ms, workload) if r.output_len > 1), 1e3),
        "itl_ms": summarize((b - a for i in ids for a, b in zip(stamps[i], stamps[i][1:])), 1e3),
        "e2e_ms": summarize((m.finished_time - m.arrival_time for m in ms), 1e3),
    }


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type} ({torch.get_num_threads()} threads)"


def derive(rows: list[dict], workload: list[BenchRequest], roofline: float | None) -> None:
    """Fill rates, the ratio to the first (kvforge) row and the fraction of the roofline, in place."""
    n_prompt = sum(r.input_len for r in workload)
    for row in rows:
        if row.get("error") or not row.get("seconds"):
            continue
        s = row["seconds"]
        n_req = row.get("completed", len(workload))
        row.setdefault("num_requests", n_req)
        row.setdefault("prompt_tokens", n_prompt if n_req == len(workload) else None)
        row["output_tok_s"] = row["output_tokens"] / s
        row["total_tok_s"] = (row["output_tokens"] + row["prompt_tokens"]) / s if row["prompt_tokens"] else None
        row["req_s"] = n_req / s
        row["roofline_frac"] = row["output_tok_s"] / roofline if roofline else None
    base = rows[0].get("output_tok_s")
    for row in rows:
        row["ratio"] = row["output_tok_s"] / base if base and row.get("output_tok_s") else None


def describe(args: argparse.Namespace, model: str, device: str, workload: list[BenchRequest],
             roofline: float | None, ceilings: Ceilings) -> str:
    n_in, n_out = sum(r.input_len for r in workload), sum(r.output_len for r in workload)
    head = (f"{model} on {device}: {len(workload)} requests ({args.dataset}), {n_in:,} prompt + {n_out:,} "
            f"output tokens (EOS ignored)")
    return head + (f"; roofline {roofline:,.0f} output tok/s" if roofline else "") + "\n" + ceilings.describe()


def engine_config(args: argparse.Namespace) -> Any:
    """The ``EngineConfig`` of the engine flags (its ``torch_device`` is where the bench runs)."""
    from kvforge.cli import engine_kwargs
    from kvforge.config import EngineConfig

    kwargs = engine_kwargs(args)
    return EngineConfig.create(kwargs.pop("config", None), model=kwargs.pop("model", None), **kwargs)


def model_of(args: argparse.Namespace) -> tuple[Any, Any, Any, Any]:
    """``(config, source, model config, tokenizer)`` of the engine flags, without building an engine."""
    from kvforge.model.loader import load_model_config, resolve_model_source
    from kvforge.model.tokenizer_source import tokenizer_for

    config = engine_config(args)
    source = resolve_model_source(config.model, config.load_format)
    mc = load_model_config(source)
    tokenizer = tokenizer_for(config, source, mc) if args.dataset == "edit" else None
    return config, source, mc, tokenizer


def vllm_peer(args: argparse.Namespace, client: bool = False):
    """The probed ``VllmPeer`` when ``--vs vllm`` is given or vLLM's ``client`` is asked for (``ValueError``
    if vLLM does not import), else None."""
    if "vllm" not in args.vs and not client:
        return None
    from kvforge.bench.vllm_peer import VllmPeer

    peer = VllmPeer(python=args.vllm_python or sys.executable, path=list(args.vllm_path),
                    redraw_dummy=getattr(args, "vllm_dummy_weights", "kvforge") == "kvforge")
    print(f"vLLM {peer.probe()} in {peer.python}", file=sys.stderr)
    return peer


def run(args: argparse.Namespace) -> int:
    peer = vllm_peer(args)
    ceilings = for_device(args, engine_config(args).torch_device)  # measured (if at all) on an idle GPU
    vllm_row = None
    if peer is not None:  # first, on a device nothing else holds yet
        import tempfile

        from kvforge.bench.vllm_peer import llm_kwargs, throughput_row

        config, source, mc, tokenizer = model_of(args)
        workload = workload_for(args, mc.vocab_size, tokenizer=tokenizer)
        with tempfile.TemporaryDirectory(prefix="kvforge-vllm-model-") as tmp:
            vllm_row = throughput_row(peer, llm_kwargs(source, mc, config.torch_dtype, args.seed or 0, tmp, config),
                                      workload, warm_prompts(args, mc.vocab_size, len(workload)), WARM_TOKENS)
    llm, load_s = build_llm(args)
    engine = llm.llm_engine
    mc, source, device, dtype = engine.model_config, engine.source, engine.device, engine.dtype
    workload = workload_for(args, mc.vocab_size, tokenizer=engine.tokenizer)
    check_fits(workload, engine.max_model_len)
    warm_up(llm, args, len(workload))
    before = engine.get_stats()
    ours = {"engine": f"kvforge ({engine.attn_backend_name})"} | run_streamed(engine, workload)
    after = engine.get_stats()
    ours |= {"load_seconds": load_s, "cuda_graph_capture_s": engine.cuda_graph_capture_s,
             "num_blocks": engine.num_blocks, "max_num_seqs": engine.config.max_num_seqs,
             "preemptions": after["num_preemptions"] - before["num_preemptions"],
             "prefix_cache_hits": after["prefix_cache_hits"] - before["prefix_cache_hits"],
             "spec_decode": spec_delta(before["spec_decode"], after["spec_decode"])}
    max_num_seqs, model_name = engine.config.max_num_seqs, source.name
    # the roofline at kvforge's precision (quantized weights, FP8 KV cache); the peers run the same
    precision = engine_precision(engine.config, mc, torch.empty((), dtype=dtype).element_size())
    del llm, engine
    free_memory()

    rows = [ours] + ([vllm_row] if vllm_row else [])
    rows += [run_peer(p, source, mc, workload, device, dtype, args.seed or 0, args.hf_batch_size)
             for p in args.vs if p != "vllm"]
    bandwidth, flops = ceilings.bandwidth, ceilings.flops
    floor = roofline(mc, workload, max_num_seqs, precision, bandwidth, flops) if bandwidth and flops else None
    roofline_tok_s = floor.tok_s if floor else None
    derive(rows, workload, roofline_tok_s)
    dev = device_name(device)
    print("\n" + describe(args, model_name, dev, workload, roofline_tok_s, ceilings))
    print(report.format_table(rows, report.THROUGHPUT_COLUMNS))
    if vllm_row:
        print(f"vLLM {vllm_row['vllm_version']}: attention backend {vllm_row['attention_backend'] or 'not logged'}; "
              f"ready after {vllm_row.get('load_seconds', float('nan')):.1f} s (kvforge: {load_s:.1f} s)")
    if ours["spec_decode"]:
        print(describe_spec(ours["spec_decode"]))
    finish(args, "throughput", dev, str(dtype).removeprefix("torch."), mc, workload, rows,
           {"roofline_tok_s": roofline_tok_s, "roofline": floor.as_dict() if floor else None,
            "bandwidth": bandwidth, "flops": flops, "ceilings": ceilings.as_dict()})
    if args.plot:
        report.write_plot(args.plot, rows, "output_tok_s", "output tokens/s",
                          describe(args, model_name, dev, workload, roofline_tok_s, ceilings), roofline_tok_s)
    return 0


def finish(args: argparse.Namespace, command: str, device: str, dtype: str, mc: Any,
           workload: list[BenchRequest], rows: list[dict], extra: dict) -> None:
    """Write ``--json``: the arguments, the device, the workload's totals and every row."""
    if not args.json:
        return
    payload = {"command": command, "args": {k: v for k, v in vars(args).items() if k != "func"},
               "device": device, "dtype": dtype, "model_config": mc.to_dict() if mc is not None else None,
               "workload": {"dataset": args.dataset, "num_requests": len(workload),
                            "prompt_tokens": sum(r.input_len for r in workload),
                            "output_tokens": sum(r.output_len for r in workload)},
               **extra, "rows": rows}
    report.write_json(args.json, payload)
