"""What the engine-core process sends its front end per step, before and after typed messages (issue 35).

    python benchmarks/step_output_bytes.py [--num-requests 32] [--input-len 512] [--json out.json]

Runs ``dummy:tiny`` on the CPU with ``--num-requests`` streaming requests of ``--input-len`` prompt tokens
(the issue-14 serving load is 512 in, 128 out), as the engine-core process runs them (``stream_deltas``,
the server's request ids), and takes the outputs of a decode step with every request running. For that
step it prints:

- bytes: ``("out", [(request_id, RequestOutput), ...])`` pickled (what the core sent before typed
  messages: every output carried its prompt and prompt token ids, every step), against
  ``StepOutputs([OutputDelta, ...])`` pickled (now: the prompt goes once, with the first delta);
- core microseconds: building the message and ``pickle.dumps`` (the core's ``_emit``);
- front-end microseconds: ``pickle.loads``, plus ``PromptCache.output`` for the typed message;

each the fastest of ``--repeats`` runs. The front end's rebuilt outputs are checked to equal the engine's.
The per-step host cost on the GPU under load is in docs/benchmarks.md (py-spy, gpu_serve_profile.sh).
"""
from __future__ import annotations

import argparse
import json
import pickle
import time
import uuid
from typing import Callable

PROTOCOL = pickle.HIGHEST_PROTOCOL


def fastest_us(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=400)
    ap.add_argument("--json")
    args = ap.parse_args()

    from kvforge import LLM, SamplingParams
    from kvforge.engine.messages import PromptCache, PromptSent, StepOutputs

    llm = LLM("dummy:tiny", device="cpu", max_model_len=args.input_len + 64, num_gpu_blocks_override=4096,
              max_num_seqs=args.num_requests, max_num_batched_tokens=args.num_requests * args.input_len)
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0)
    for _ in range(args.num_requests):
        rid = f"{uuid.uuid4().hex}:cmpl-{uuid.uuid4().hex}"  # the server's ids (X-Request-Id and the completion's)
        prompt = [(7 * i) % 100 + 1 for i in range(args.input_len)]
        engine.add_request(rid, prompt, params, stream_deltas=True)
    sent, cache = PromptSent(), PromptCache()
    outs = []
    for _ in range(4):  # prefill, then decode steps; the front end has each prompt after the first delta
        outs = engine.step()
        for o in outs:
            cache.output(pickle.loads(pickle.dumps(sent.delta(o), PROTOCOL)))
    assert len(outs) == args.num_requests and not any(o.finished for o in outs), "not a full decode step"

    old = ("out", [(o.request_id, o) for o in outs])
    old_bytes = pickle.dumps(old, PROTOCOL)
    new = StepOutputs([sent.delta(o) for o in outs])
    new_bytes = pickle.dumps(new, PROTOCOL)
    rebuilt = [cache.output(d) for d in pickle.loads(new_bytes).deltas]
    for a, b in zip(rebuilt, outs):
        assert (a.request_id, a.prompt_token_ids, a.outputs[0].token_ids) == (b.request_id, b.prompt_token_ids,
                                                                             b.outputs[0].token_ids)

    def emit_new() -> bytes:  # PromptSent.delta would mark the prompt sent: build deltas from a copy's state
        s = PromptSent()
        s._logprobs = dict(sent._logprobs)
        return pickle.dumps(StepOutputs([s.delta(o) for o in outs]), PROTOCOL)

    def read_new() -> list:
        c = PromptCache()
        c._prompts = {k: list(v) for k, v in cache._prompts.items()}
        return [c.output(d) for d in pickle.loads(new_bytes).deltas]

    row = {
        "num_requests": args.num_requests, "input_len": args.input_len,
        "bytes_before": len(old_bytes), "bytes_after": len(new_bytes),
        "core_us_before": fastest_us(lambda: pickle.dumps(("out", [(o.request_id, o) for o in outs]), PROTOCOL),
                                     args.repeats),
        "core_us_after": fastest_us(emit_new, args.repeats),
        "front_end_us_before": fastest_us(lambda: pickle.loads(old_bytes), args.repeats),
        "front_end_us_after": fastest_us(read_new, args.repeats),
    }
    llm.shutdown()
    print(f"decode step, {args.num_requests} requests of {args.input_len} prompt tokens (server ids):")
    print(f"  bytes        {row['bytes_before']:>9,} before  {row['bytes_after']:>9,} after")
    print(f"  core us      {row['core_us_before']:>9.1f} before  {row['core_us_after']:>9.1f} after  (build + pickle)")
    print(f"  front end us {row['front_end_us_before']:>9.1f} before  {row['front_end_us_after']:>9.1f} after  "
          "(unpickle + outputs)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(row, f, indent=1)


if __name__ == "__main__":
    main()
