"""The vLLM side of ``kvforge bench ... --vs vllm``: a script run in its own interpreter, importing vLLM
and the standard library only (never kvforge, whose pins may differ from vLLM's).

    python vllm_worker.py REQUEST.json RESULT.json

REQUEST: ``{"mode": "probe" | "throughput" | "latency", "llm_kwargs": {...}, ...}``:
- ``probe``: import vLLM; the result is ``{"vllm_version", "python"}``.
- ``throughput``: ``warmup`` (prompt token-id lists, ``warmup_tokens`` each), then ``requests``
  (``{"prompt": [ids], "max_tokens": n}``) added at once to ``llm.llm_engine`` with DELTA outputs and
  stepped to completion, a ``perf_counter`` stamp per delta: the loop kvforge's side runs. The result
  has ``seconds`` (first add to last output), ``load_seconds`` (``LLM(...)``), and per request
  ``stamps`` (seconds after the start, one per delta) and ``tokens``. Optional LoRA (``llm_kwargs``
  with ``enable_lora``): a request's ``"lora": {"name", "id", "path"}`` runs it under that adapter
  (vLLM's ``LoRARequest``), and ``warmup_loras`` (one such dict or null per warm-up prompt) does the
  same for the warm-up.
- ``latency``: ``batches`` of ``{"prompts", "max_tokens"}`` timed one ``llm.generate`` each; the
  result's ``seconds`` is one figure per batch.

``redraw`` (``{"std", "seed"}``, sent for random-weight models): once loaded, vLLM's weights are drawn
again as kvforge draws them (every norm weight 1, everything else N(0, std)) through
``llm.apply_model``; the result's ``redrawn_parameters`` counts them. vLLM's own dummy weights are
uniform in +-1e-3 with one seed for every tensor of a size: another model than kvforge's random one,
whose router spreads tokens over the experts otherwise (an MoE model's speed depends on it).

Every request is greedy with EOS ignored and no detokenisation; a request that generates a token
count other than asked is an error. On failure RESULT is ``{"error": "..."}`` and the exit status 1
(3 when vLLM does not import).
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback


def sampling_params(vllm, max_tokens: int, delta: bool = False):
    kwargs = dict(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    if delta:
        from vllm.sampling_params import RequestOutputKind
        kwargs["output_kind"] = RequestOutputKind.DELTA
    return vllm.SamplingParams(**kwargs)


def tokens_prompt(ids: list[int]):
    from vllm.inputs import TokensPrompt
    return TokensPrompt(prompt_token_ids=ids)


def lora_request(spec: dict | None):
    """vLLM's ``LoRARequest`` for ``{"name", "id", "path"}``, or None (the base model)."""
    if spec is None:
        return None
    from vllm.lora.request import LoRARequest
    return LoRARequest(lora_name=spec["name"], lora_int_id=spec["id"], lora_path=spec["path"])


def generate(llm, vllm, prompts: list[list[int]], max_tokens: list[int],
             loras: list[dict | None] | None = None) -> None:
    # NOTE: lora_request only when asked, so that a vLLM (or a stand-in) without LoRA support runs the rest
    extra = {"lora_request": [lora_request(s) for s in loras]} if loras else {}
    outs = llm.generate([tokens_prompt(p) for p in prompts], [sampling_params(vllm, n) for n in max_tokens],
                        use_tqdm=False, **extra)
    for out, want in zip(outs, max_tokens):
        got = len(out.outputs[0].token_ids)
        if got != want:
            raise RuntimeError(f"vLLM generated {got} tokens for a request, expected exactly {want}")


def redraw_weights(model, std: float, seed: int) -> int:
    """Runs inside vLLM's worker (``llm.apply_model``): kvforge's random weights, in place. Returns how
    many parameters were drawn."""
    import torch

    n = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.is_floating_point() or p.element_size() < 2:  # packed or float8 tensors stay
                continue
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                gen = torch.Generator(device=p.device)
                gen.manual_seed(seed * 1_000_003 + n)
                p.normal_(0.0, std, generator=gen)
            n += 1
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return n


def run_streamed(llm, vllm, requests: list[dict]) -> dict:
    engine = llm.llm_engine
    ids = [str(i) for i in range(len(requests))]
    stamps: dict[str, list[float]] = {i: [] for i in ids}
    tokens = dict.fromkeys(ids, 0)
    t0 = time.perf_counter()
    for rid, r in zip(ids, requests):
        extra = {"lora_request": lora_request(r["lora"])} if r.get("lora") else {}
        engine.add_request(rid, tokens_prompt(r["prompt"]), sampling_params(vllm, r["max_tokens"], delta=True),
                           **extra)
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter() - t0
        for out in outs:
            n = len(out.outputs[0].token_ids)
            if n:
                stamps[out.request_id].append(now)
                tokens[out.request_id] += n
    seconds = time.perf_counter() - t0
    for rid, r in zip(ids, requests):
        if tokens[rid] != r["max_tokens"]:
            raise RuntimeError(f"vLLM generated {tokens[rid]} tokens for request {rid}, expected exactly {r['max_tokens']}")
    return {"seconds": seconds, "stamps": [stamps[i] for i in ids], "tokens": [tokens[i] for i in ids]}


def main(argv: list[str]) -> int:
    request_path, result_path = argv
    with open(request_path) as f:
        req = json.load(f)

    def write(payload: dict) -> None:
        with open(result_path, "w") as f:
            json.dump(payload, f)

    if req.get("redraw"):  # apply_model sends a function to vLLM's engine-core process: pickled
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    try:
        import vllm
    except Exception as exc:  # ImportError, or a broken install raising anything else
        missing = getattr(exc, "name", None)
        write({"error": f"{type(exc).__name__}: {exc}", "missing": missing, "python": sys.executable})
        return 3
    result = {"vllm_version": getattr(vllm, "__version__", "unknown"), "python": sys.executable}
    if req["mode"] == "probe":
        write(result)
        return 0
    try:
        t0 = time.perf_counter()
        llm = vllm.LLM(**req["llm_kwargs"])
        result["load_seconds"] = time.perf_counter() - t0
        if req.get("redraw"):
            spec = req["redraw"]
            result["redrawn_parameters"] = sum(llm.apply_model(
                lambda model: redraw_weights(model, spec["std"], spec["seed"])))
        if req["mode"] == "throughput":
            warm = req["warmup"]
            generate(llm, vllm, warm, [req["warmup_tokens"]] * len(warm), req.get("warmup_loras"))
            result |= run_streamed(llm, vllm, req["requests"])
        elif req["mode"] == "latency":
            seconds = []
            for batch in req["batches"]:
                t = time.perf_counter()
                generate(llm, vllm, batch["prompts"], batch["max_tokens"])
                seconds.append(time.perf_counter() - t)
            result["seconds"] = seconds
        else:
            raise ValueError(f"unknown mode {req['mode']!r}")
    except Exception as exc:
        traceback.print_exc()
        write(result | {"error": f"{type(exc).__name__}: {exc}"})
        return 1
    write(result)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
