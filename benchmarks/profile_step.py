"""Where an engine step's time goes: scheduling, input preparation, GPU forward, sampling, output.

    python benchmarks/profile_step.py --model dummy:llama-3-8b --num-prompts 256 --input-len 512 --output-len 128

Each phase is wrapped with a device synchronisation before and after, so the split is exact but the
total is slower than an unprofiled run (the CPU can no longer run ahead of the GPU).
"""
from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="dummy:llama-3-8b")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--enforce-eager", action="store_true")
    args = p.parse_args()

    from kvforge import LLM, SamplingParams

    # synchronous steps: with async scheduling the phases overlap the GPU, and the syncs below would
    # serialise them anyway
    llm = LLM(args.model, attention_backend=args.attention_backend, enforce_eager=args.enforce_eager,
              async_scheduling=False)
    eng = llm.llm_engine
    vocab = eng.model_config.vocab_size
    prompts = torch.randint(100, vocab - 100, (args.num_prompts, args.input_len),
                            generator=torch.Generator().manual_seed(0)).tolist()
    llm.generate(prompts[:4], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    times: dict[str, float] = defaultdict(float)

    def timed(name, fn):
        def wrapper(*a, **k):
            sync()
            t = time.perf_counter()
            r = fn(*a, **k)
            sync()
            times[name] += time.perf_counter() - t
            return r
        return wrapper

    runner = eng.runner
    eng.scheduler.schedule = timed("schedule", eng.scheduler.schedule)
    runner.builder.build = timed("input prep: step input", runner.builder.build)
    runner.worker._lay_out_step = timed("input prep: layout", runner.worker._lay_out_step)
    runner.attn.build_metadata = timed("input prep: attention metadata", runner.attn.build_metadata)
    runner.model.forward = timed("GPU: model forward (eager)", runner.model.forward)
    if runner.graphs is not None:
        runner.graphs.replay = timed("GPU: model forward (graph replay)", runner.graphs.replay)
    runner.model.compute_logits = timed("GPU: logits", runner.model.compute_logits)
    runner.sampler.prepare = timed("sampling: prepare", runner.sampler.prepare)
    runner.sampler.sample = timed("sampling: sample", runner.sampler.sample)
    eng.scheduler.update = timed("update: scheduler", eng.scheduler.update)
    eng.scheduler.advance = timed("update: scheduler advance", eng.scheduler.advance)
    from kvforge.rank.step_handle import StepHandle
    StepHandle.finish = timed("output: copy results to host", StepHandle.finish)
    StepHandle.result = timed("output: wait, tokens to Python", StepHandle.result)
    eng.outputs.detokenize = timed("output: detokenize, stop checks", eng.outputs.detokenize)
    eng.outputs.make_outputs = timed("output: make outputs", eng.outputs.make_outputs)
    step = eng.step
    n_steps = 0

    def counted():
        nonlocal n_steps
        n_steps += 1
        return step()

    eng.step = timed("step total", counted)
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True), use_tqdm=False)
    wall = time.perf_counter() - t0
    total = times.pop("step total")
    print(f"\n{args.model}, {args.num_prompts} x {args.input_len} in x {args.output_len} out, "
          f"backend {eng.attn_backend_name}, graphs {'on' if runner.graphs is not None else 'off'}: "
          f"{n_steps} steps, {wall:.2f} s wall (profiled)")
    print(f"{'phase':<40}{'ms/step':>10}{'share':>8}")
    for name, t in sorted(times.items(), key=lambda kv: -kv[1]):
        print(f"{name:<40}{t / n_steps * 1e3:>10.3f}{t / total:>8.1%}")
    other = total - sum(times.values())
    print(f"{'other (engine glue)':<40}{other / n_steps * 1e3:>10.3f}{other / total:>8.1%}")
    print(f"{'step total':<40}{total / n_steps * 1e3:>10.3f}{1:>8.0%}")


if __name__ == "__main__":
    main()
