"""What the driver pickles for its other ranks per step, before and after typed messages (issue 35).

    python benchmarks/rank_message_bytes.py [--num-requests 32] [--output-len 48] [--json out.json]

Runs ``dummy:tiny`` on the CPU (one rank: the messages do not depend on the executor) with
``--num-requests`` requests at once, records every ``StepInput`` the engine hands its executor, and
packs them in order with a ``StepEncoder``, as the ``mp`` and ``ray`` executors do. For the decode
steps with every request running, it prints per step:

- bytes: ``("exec", step)`` pickled (the tuple the ranks got before typed messages), and the
  ``ExecuteStep`` pickled (what they get now);
- driver microseconds: ``pickle.dumps`` of the tuple, against ``StepEncoder.encode`` + ``pickle.dumps``;
- rank microseconds: ``pickle.loads``, against ``pickle.loads`` + ``StepDecoder.decode``
  (each the fastest of ``--repeats`` runs: the least disturbed by other work on the machine).

Twice: with ``LLM.generate``'s request ids ("0", "1", ...) and with the server's
(``<X-Request-Id>:cmpl-<hex>``, 74 characters). Steps get no reply (the ranks answer calls only); a
call and its reply are measured too (``BatchState``, and its ``CallDone`` against ``("ok", value)``).
Every packed step is checked to come back equal to the engine's, field for field.
"""
from __future__ import annotations

import argparse
import json
import pickle
import statistics
import time
import uuid
from typing import Any, Callable

import numpy as np

PROTOCOL = pickle.HIGHEST_PROTOCOL


def record_steps(num_requests: int, output_len: int, server_ids: bool) -> list[Any]:
    """Every StepInput the engine builds while it runs ``num_requests`` requests to ``output_len`` tokens."""
    from kvforge import LLM, SamplingParams

    llm = LLM("dummy:tiny", device="cpu", max_model_len=512, num_gpu_blocks_override=1024,
              max_num_seqs=num_requests, async_scheduling=False)
    engine = llm.llm_engine
    steps: list[Any] = []
    run = engine.executor.execute_model

    def recording(step, prev_tokens=None, prompt_sink=None):
        steps.append(step)
        return run(step, prev_tokens, prompt_sink)

    engine.executor.execute_model = recording  # type: ignore[method-assign]  # a probe on this engine only
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    for i in range(num_requests):
        rid = f"{uuid.uuid4().hex}:cmpl-{uuid.uuid4().hex}" if server_ids else str(i)
        engine.add_request(rid, f"request {i} asks something of a tiny model", params)
    while engine.has_unfinished_requests():
        engine.step()
    llm.shutdown()
    return steps


def same_step(a: Any, b: Any) -> bool:
    from dataclasses import fields

    for f in fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            if not (isinstance(x, np.ndarray) and isinstance(y, np.ndarray) and x.dtype == y.dtype
                    and np.array_equal(x, y)):
                return False
        elif x != y:
            return False
    return True


def micros(fn: Callable[[Any], object], arg: Any, repeats: int) -> float:
    """The fastest of ``repeats`` calls of ``fn(arg)``, in microseconds (the least disturbed by other work)."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter_ns()
        fn(arg)
        times.append(time.perf_counter_ns() - t)
    return min(times) / 1000


def measure(num_requests: int, output_len: int, server_ids: bool, repeats: int) -> dict[str, Any]:
    from kvforge.rank.step_codec import StepDecoder, StepEncoder

    steps = record_steps(num_requests, output_len, server_ids)
    encoder, decoder = StepEncoder(), StepDecoder()
    packed = []
    for step in steps:  # in order, as an executor packs them
        msg = encoder.encode(step)
        back = decoder.decode(pickle.loads(pickle.dumps(msg, PROTOCOL)))
        assert same_step(step, back), f"step {len(packed)} did not come back equal"
        packed.append(msg)
    decode_steps = [i for i, s in enumerate(steps)
                    if len(s.req_ids) == num_requests and s.num_tokens == num_requests and not s.dropped]
    rows: dict[str, list[float]] = {k: [] for k in ("old_bytes", "new_bytes", "old_driver_us", "new_driver_us",
                                                       "old_rank_us", "new_rank_us")}
    for i in decode_steps:
        step, msg = steps[i], packed[i]
        old = pickle.dumps(("exec", step), PROTOCOL)
        new = pickle.dumps(msg, PROTOCOL)
        rows["old_bytes"].append(len(old))
        rows["new_bytes"].append(len(new))
        # the encoder knows every id by now (steady state): encoding again sends none of them
        rows["old_driver_us"].append(micros(lambda s: pickle.dumps(("exec", s), PROTOCOL), step, repeats))
        rows["new_driver_us"].append(micros(lambda s: pickle.dumps(encoder.encode(s), PROTOCOL), step, repeats))
        rows["old_rank_us"].append(micros(pickle.loads, old, repeats))
        rows["new_rank_us"].append(micros(lambda b: decoder.decode(pickle.loads(b)), new, repeats))
    out: dict[str, Any] = {k: round(statistics.mean(v), 1) for k, v in rows.items()}
    out["decode_steps"] = len(decode_steps)
    out["all_steps"] = len(steps)
    out["first_step_bytes"] = {"old": len(pickle.dumps(("exec", steps[0]), PROTOCOL)),
                               "new": len(pickle.dumps(packed[0], PROTOCOL))}
    return out


def call_bytes() -> dict[str, int]:
    from kvforge.rank.messages import BatchState, CallDone

    value = {"requests": 32, "blocks": 96}
    return {"old_call": len(pickle.dumps(("rpc", "batch_state", (), {}), PROTOCOL)),
            "new_call": len(pickle.dumps(BatchState(), PROTOCOL)),
            "old_reply": len(pickle.dumps(("ok", value), PROTOCOL)),
            "new_reply": len(pickle.dumps(CallDone(value), PROTOCOL))}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--repeats", type=int, default=200, help="timed runs of each step (the median is kept)")
    p.add_argument("--json", default=None, help="also write the figures to this file")
    args = p.parse_args()
    results: dict[str, Any] = {"num_requests": args.num_requests}
    for ids in ("short", "server"):
        results[ids] = r = measure(args.num_requests, args.output_len, ids == "server", args.repeats)
        print(f"{ids} ids, decode step of {args.num_requests} requests (mean of {r['decode_steps']} steps): "
              f"{r['old_bytes']:.0f} -> {r['new_bytes']:.0f} bytes; driver {r['old_driver_us']} -> "
              f"{r['new_driver_us']} us (pickle -> encode + pickle); rank {r['old_rank_us']} -> "
              f"{r['new_rank_us']} us (unpickle -> unpickle + decode); first step (the prompts) "
              f"{r['first_step_bytes']['old']} -> {r['first_step_bytes']['new']} bytes")
    results["calls"] = c = call_bytes()
    print(f"a call (BatchState): {c['old_call']} -> {c['new_call']} bytes; its reply: {c['old_reply']} -> "
          f"{c['new_reply']} bytes")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
