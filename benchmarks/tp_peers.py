"""Tensor parallelism side by side: kvforge or vLLM, one engine per process, on a Llama-shaped model
with random bf16 weights, the same prompt token ids (kvforge's ``make_workload``, seed 0).

    python benchmarks/tp_peers.py --engine kvforge|vllm --preset llama-3-8b --tp 2 [--pp 1] [--w1] [--batch1]

Rows (one JSON line each on stdout, prefixed ``ROW``):
- ``w1``: 256 prompts x 512 in x 256 out, EOS ignored: output tokens per second.
- ``batch1``: one 512-token prompt; the decode step is (time of 129 tokens - time of 1 token) / 128,
  each the best of 3 runs: the prefill cancels out.
vLLM gets a directory holding only the preset's ``config.json`` and ``load_format="dummy"``, as kvforge
gets ``dummy:<preset>``. ``bash benchmarks/gpu_tp.sh`` runs the table of docs/distributed.md.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time


def make_llm(args: argparse.Namespace):
    from kvforge.model.config import ModelConfig

    mc = ModelConfig.from_preset(args.preset)
    if args.engine == "kvforge":
        from kvforge import LLM, SamplingParams

        llm = LLM(f"dummy:{args.preset}", tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp,
                  max_model_len=args.max_model_len, gpu_memory_utilization=args.gpu_memory_utilization,
                  **{k: json.loads(v) for k, v in (kv.split("=", 1) for kv in args.engine_arg)})
        return llm, SamplingParams, mc.vocab_size, lambda ids: {"prompt_token_ids": ids}
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    d = tempfile.mkdtemp()
    hf = mc.to_hf_dict()
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(hf, f)
    # NOTE: with several GPUs, vLLM 0.25/0.26's fuse_allreduce_rms compile pass picks FlashInfer's MNNVL
    # all-reduce on one node, which creates NVLink multicast objects (cuMulticastCreate, never allowed on
    # these shared machines) and, with multicast off, reads a null multicast pointer: the "cuBLAS illegal
    # memory access" of vLLM issue 34948 (fixed by its PR 49043). The pass stays off here.
    extra = {"compilation_config": {"pass_config": {"fuse_allreduce_rms": False}}} if args.tp * args.pp > 1 else {}
    llm = LLM(model=d, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", tensor_parallel_size=args.tp,
              pipeline_parallel_size=args.pp,
              max_model_len=args.max_model_len, gpu_memory_utilization=args.gpu_memory_utilization, **extra)
    return llm, SamplingParams, mc.vocab_size, lambda ids: TokensPrompt(prompt_token_ids=ids)


def params(SamplingParams, engine: str, n: int):
    extra = {"detokenize": False} if engine == "vllm" else {}
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **extra)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--engine", choices=["kvforge", "vllm"], required=True)
    p.add_argument("--preset", default="llama-3-8b")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--w1", action="store_true")
    p.add_argument("--batch1", action="store_true")
    p.add_argument("--engine-arg", action="append", default=[], metavar="KEY=JSON",
                   help="another kvforge EngineConfig field, e.g. async_scheduling=false")
    p.add_argument("--profile", action="store_true", help="print a torch profile of a batch-1 run")
    p.add_argument("--trace-dir", default=None, help="with --profile: write each rank's Chrome trace there "
                   "(benchmarks/tp_trace_summary.py reads them)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    args = p.parse_args()
    from kvforge.bench.workloads import make_workload

    t0 = time.perf_counter()
    llm, SamplingParams, vocab, prompt = make_llm(args)
    ready = time.perf_counter() - t0
    base = {"engine": args.engine, "preset": args.preset, "tp": args.tp, "pp": args.pp, "ready_s": round(ready, 1),
            **({"engine_args": args.engine_arg} if args.engine_arg else {})}
    if args.batch1:
        ids = make_workload("fixed", 1, 512, 128, vocab)[0].prompt_token_ids

        def best(n: int) -> float:
            times = []
            for _ in range(3):
                t = time.perf_counter()
                llm.generate([prompt(ids)], params(SamplingParams, args.engine, n), use_tqdm=False)
                times.append(time.perf_counter() - t)
            return min(times)
        best(8)  # warm-up
        one, many = best(1), best(129)
        print("ROW", json.dumps(base | {"row": "batch1", "prefill_s": round(one, 4),
                                        "decode_step_ms": round((many - one) / 128 * 1e3, 3)}), flush=True)
        if args.profile and args.engine == "kvforge":  # where a batch-1 decode step's time goes, on every rank
            llm.start_profile()
            llm.generate([prompt(ids)], params(SamplingParams, args.engine, 33), use_tqdm=False)
            for table in llm.stop_profile(args.trace_dir):
                print(table, flush=True)
    if args.w1:
        work = make_workload("fixed", 256, 512, 256, vocab)
        prompts = [prompt(r.prompt_token_ids) for r in work]
        llm.generate(prompts[:16], params(SamplingParams, args.engine, 8), use_tqdm=False)  # warm-up
        t = time.perf_counter()
        outs = llm.generate(prompts, params(SamplingParams, args.engine, 256), use_tqdm=False)
        elapsed = time.perf_counter() - t
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        print("ROW", json.dumps(base | {"row": "w1", "seconds": round(elapsed, 2), "output_tokens": tokens,
                                        "tok_s": round(tokens / elapsed)}), flush=True)
    if args.engine == "kvforge":
        llm.shutdown()
    os._exit(0)  # vLLM's workers and NCCL teardown can outlive a clean exit


if __name__ == "__main__":
    main()
