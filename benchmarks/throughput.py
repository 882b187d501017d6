"""Offline throughput: kvforge vs transformers `generate` on the same workload, in one process.

    python benchmarks/throughput.py --model dummy:llama-3-8b --num-prompts 256 --input-len 512 \
        --output-len 256 --vs hf-generate --hf-batch-size 256

Every request has ``input_len`` random prompt tokens and generates exactly ``output_len`` tokens
(EOS ignored). Prints a table of output tokens/s, the ratio to each peer, and the fraction of a
roofline estimate (weights + KV bytes streamed per decode step at the measured copy bandwidth,
prefill FLOPs at the measured matmul rate).
"""
from __future__ import annotations

import argparse
import gc
import json
import time

import torch


def make_prompts(n: int, input_len: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (n, input_len), generator=g).tolist()


def run_kvforge(args, prompts) -> dict:
    from kvforge import LLM, SamplingParams

    kwargs = dict(attention_backend=args.attention_backend, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens, seed=args.seed)
    if args.dtype:
        kwargs["dtype"] = args.dtype
    if args.gpu_memory_utilization:
        kwargs["gpu_memory_utilization"] = args.gpu_memory_utilization
    t0 = time.perf_counter()
    llm = LLM(args.model, **kwargs)
    load_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[: min(8, len(prompts))], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    sync()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    sync()
    elapsed = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    assert n_out == len(prompts) * args.output_len, n_out
    mc = llm.llm_engine.model_config
    result = dict(engine=f"kvforge ({llm.llm_engine.attn_backend_name})", seconds=elapsed, output_tokens=n_out,
                  load_seconds=load_s, blocks=llm.llm_engine.num_blocks,
                  preemptions=llm.llm_engine.get_stats()["num_preemptions"])
    del llm, outs
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result | {"model_config": mc}


def run_hf_generate(args, prompts, mc) -> dict:
    from transformers import AutoModelForCausalLM, LlamaConfig

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[
        args.dtype or ("bfloat16" if device == "cuda" else "float32")]
    cfg = LlamaConfig(**{k: v for k, v in mc.to_hf_dict().items() if k not in ("architectures", "model_type")})
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, torch_dtype=dtype).eval()
    n_out = 0
    sync()
    t0 = time.perf_counter()
    for i in range(0, len(prompts), args.hf_batch_size):
        batch = torch.tensor(prompts[i:i + args.hf_batch_size], device=device)
        with torch.no_grad():
            out = model.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=args.output_len,
                                 min_new_tokens=args.output_len, do_sample=False, pad_token_id=0)
        n_out += (out.shape[1] - batch.shape[1]) * batch.shape[0]
    sync()
    elapsed = time.perf_counter() - t0
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return dict(engine=f"transformers generate (batch {args.hf_batch_size})", seconds=elapsed, output_tokens=n_out)


def roofline_tok_s(mc, args, bandwidth: float, flops: float) -> float:
    """Output tok/s if every decode step streamed weights + live KV at ``bandwidth`` and prefill ran at ``flops``."""
    itemsize = 2 if (args.dtype or "bfloat16") != "float32" else 4
    h, inter, layers, vocab = mc.hidden_size, mc.intermediate_size, mc.num_hidden_layers, mc.vocab_size
    q = mc.num_attention_heads * mc.head_dim
    kv = mc.num_key_value_heads * mc.head_dim
    params = layers * (h * (q + 2 * kv) + q * h + 3 * h * inter) + vocab * h * (1 if mc.tie_word_embeddings else 2)
    kv_bytes_per_token = 2 * layers * kv * itemsize
    batch = min(args.max_num_seqs, args.num_prompts)
    steps = -(-args.num_prompts // batch) * args.output_len
    avg_ctx = args.input_len + args.output_len / 2
    decode_s = steps * (params * itemsize + batch * avg_ctx * kv_bytes_per_token) / bandwidth
    prefill_s = 2 * params * args.num_prompts * args.input_len / flops
    return args.num_prompts * args.output_len / (decode_s + prefill_s)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="dummy:llama-3-8b")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--dtype", default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--gpu-memory-utilization", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vs", action="append", default=[], choices=["hf-generate"])
    p.add_argument("--hf-batch-size", type=int, default=256)
    p.add_argument("--bandwidth", type=float, default=4.25e12, help="measured copy bandwidth, bytes/s")
    p.add_argument("--flops", type=float, default=779e12, help="measured bf16 matmul rate, FLOP/s")
    p.add_argument("--json", default=None)
    args = p.parse_args()

    from kvforge.model_loader import load_model_config, resolve_model_source

    mc = load_model_config(resolve_model_source(args.model))
    prompts = make_prompts(args.num_prompts, args.input_len, mc.vocab_size, args.seed)
    ours = run_kvforge(args, prompts)
    ours.pop("model_config")
    rows = [ours]
    if "hf-generate" in args.vs:
        rows.append(run_hf_generate(args, prompts, mc))
    roof = roofline_tok_s(mc, args, args.bandwidth, args.flops)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"\n{args.model} on {device}: {args.num_prompts} requests x {args.input_len} prompt x "
          f"{args.output_len} output tokens (EOS ignored); roofline estimate {roof:,.0f} output tok/s")
    print(f"{'engine':<36}{'seconds':>10}{'output tok/s':>15}{'vs kvforge':>12}{'of roofline':>13}")
    for r in rows:
        tps = r["output_tokens"] / r["seconds"]
        r["output_tok_s"] = tps
        print(f"{r['engine']:<36}{r['seconds']:>10.2f}{tps:>15,.0f}{tps / rows[0]['output_tokens'] * rows[0]['seconds']:>11.2f}x"
              f"{tps / roof:>12.1%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "roofline_tok_s": roof, "device": device, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
