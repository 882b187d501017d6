"""What prompt logprobs (``echo`` + ``logprobs`` over HTTP) cost the engine on a CPU.

    python benchmarks/prompt_logprobs_cpu.py --num-prompts 2 --input-len 1200 --repeats 3

Each repeat takes new random prompts and runs them three times, ``max_tokens=1``: plain (every position
computed), plain again (a prefix-cache hit: one token computed), and with ``prompt_logprobs`` and
``logprobs`` (what ``echo=true, logprobs=k`` asks for), which never reads the prefix cache: every
position is needed, and a cached block holds keys and values, not the hidden states the log-probabilities
come from. Printed: the median process CPU seconds and wall seconds of each, and the ratios.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None, help="default: the default model (SmolLM2-135M)")
    p.add_argument("--num-prompts", type=int, default=2)
    p.add_argument("--input-len", type=int, default=1200)
    p.add_argument("--top", type=int, default=5, help="logprobs and prompt_logprobs asked for")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--json", default=None, help="also write the figures to this file")
    args = p.parse_args()

    import torch

    from kvforge import LLM, SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(args.model, device="cpu")
    vocab = llm.llm_engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)

    def prompts() -> list[list[int]]:
        return torch.randint(100, vocab - 100, (args.num_prompts, args.input_len), generator=gen).tolist()

    kinds = {"plain": SamplingParams(max_tokens=1, temperature=0),
             "plain_cached": SamplingParams(max_tokens=1, temperature=0),
             "prompt_logprobs": SamplingParams(max_tokens=1, temperature=0, logprobs=args.top,
                                               prompt_logprobs=args.top)}
    llm.generate(prompts(), kinds["prompt_logprobs"], use_tqdm=False)  # warm-up
    cpu: dict[str, list[float]] = {k: [] for k in kinds}
    wall: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(args.repeats):
        batch = prompts()
        for kind, params in kinds.items():  # plain_cached runs right after plain: its prefix is cached
            c, t = time.process_time(), time.perf_counter()
            out = llm.generate(batch, params, use_tqdm=False)
            cpu[kind].append(time.process_time() - c)
            wall[kind].append(time.perf_counter() - t)
            if kind == "prompt_logprobs":
                assert all(len(o.prompt_logprobs) == args.input_len for o in out)
    med = {k: {"cpu_s": round(statistics.median(cpu[k]), 3), "wall_s": round(statistics.median(wall[k]), 3)}
           for k in kinds}
    ratios = {"prompt_logprobs_vs_plain": round(med["prompt_logprobs"]["cpu_s"] / med["plain"]["cpu_s"], 2),
              "prompt_logprobs_vs_plain_cached":
                  round(med["prompt_logprobs"]["cpu_s"] / med["plain_cached"]["cpu_s"], 1)}
    for k, v in med.items():
        print(f"{k:16s} cpu {v['cpu_s']:7.2f} s   wall {v['wall_s']:7.2f} s")
    print("CPU ratios:", ratios)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "torch_threads": torch.get_num_threads(), "median": med,
                       "ratios": ratios, "cpu_s": cpu, "wall_s": wall}, f, indent=1)


if __name__ == "__main__":
    main()
