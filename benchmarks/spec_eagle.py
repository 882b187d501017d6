"""What an EAGLE-3 head costs per step and what it gives at a set acceptance rate (issue 41's figures).

As in ``spec_oracle.py`` (read its docstring), the target is the dummy model with a forced continuation
(``ForcedLlama``: the greedy output is ``forced(p)`` whatever the numerics), since a random head never
agrees with a random target. The head is an EAGLE-3 checkpoint in the published layout (config.json and
safetensors: ``midlayer.*``, ``fc``, ``norm``, ``lm_head`` over a 32,000-token draft vocabulary with
``d2t``/``t2d``), written once with random weights for the target's shape (``tests/eagle_heads.py``):

  off     the target alone
  eagle   ``eagle3`` with the random head: the head runs every step (its fill over the step's rows, then
          k - 1 decode steps) and its drafts are rejected: the whole drafting cost, nothing gained
  oracle  the same drafter, whose proposals, once the head has run, are corrupted to a set acceptance:
          draft i stays the forced token with probability r given that drafts 1..i-1 were (r from
          ``--acceptance`` as in spec_oracle.py); ``--acceptance 1`` accepts every draft

    python benchmarks/spec_eagle.py off|eagle|oracle [--acceptance 0.7] [--batch-size 1] [--policy fixed]
    python benchmarks/spec_eagle.py oracle --model dummy:tiny --device cpu --input-len 32 --output-len 16
Prints one JSON line: wall time, tokens per second, TPOT, engine steps, the drafting time per step
(``Drafter.propose`` plus the fills of ``Drafter.observe``; with ``--phases`` the device is synchronised
around each, so that the device time is in it), the acceptance, and whether every output was forced.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
import types

import torch
from spec_oracle import (  # benchmarks/ is this script's directory
    ForcedLlama,
    force_acceptance,
    forced,
    per_position_rate,
)

from kvforge import LLM, SamplingParams
from kvforge.hookspecs import hookimpl
from kvforge.model.config import ModelConfig
from kvforge.model.loader import load_model_config, resolve_model_source
from kvforge.plugin_manager import get_plugin_manager
from kvforge.plugins.speculative.eagle import Eagle3Drafter

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from eagle_heads import write_eagle3_head  # noqa: E402


class OracleEagle3Drafter(Eagle3Drafter):
    """Test-only: the head runs, then its proposals are corrupted to a set acceptance (module docstring)."""

    name = "oracle_eagle3"
    rate = 1.0

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.rng = random.Random(0)

    def propose(self, batch):
        proposal = super().propose(batch)
        force_acceptance(proposal, batch, self.rng, self.rate, self.vocab_size)
        return proposal


def head_dir(mc: ModelConfig, draft_vocab: int, dtype: torch.dtype) -> str:
    """A random EAGLE-3 head for the target's shape, written once per shape into the temp directory."""
    L = mc.num_hidden_layers
    path = os.path.join(tempfile.gettempdir(), f"kvforge-eagle3-{mc.hidden_size}-{L}-{mc.vocab_size}-{draft_vocab}")
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        # vLLM's default layers where they fit (2, L // 2, L - 3), else the nearest that do
        write_eagle3_head(path, mc, draft_vocab=min(draft_vocab, mc.vocab_size), dtype=dtype,
                          aux_layer_ids=[min(2, L), L // 2, max(L - 3, 0)])
    return path


def timed(obj, name: str, acc: list[float], sync) -> None:
    """Add the wall time of every call of ``obj.name`` to ``acc[0]`` (the device synchronised around it
    with ``sync``)."""
    fn = getattr(obj, name)

    def wrapper(*a, **kw):
        sync()
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            sync()
            acc[0] += time.perf_counter() - t
    setattr(obj, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["off", "eagle", "oracle"])
    ap.add_argument("--model", default="dummy:llama-3-8b")
    ap.add_argument("--device", default=None, help="cpu for the script's check on a tiny model")
    ap.add_argument("--num-speculative-tokens", "-k", type=int, default=4)
    ap.add_argument("--acceptance", type=float, default=0.7)
    ap.add_argument("--policy", default="fixed", choices=["fixed", "auto"])
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--phases", action="store_true", help="synchronise the device around the drafter's calls")
    args = ap.parse_args()
    k = args.num_speculative_tokens
    pm = get_plugin_manager()
    pm.registries["model"]._entries["LlamaForCausalLM"].target = ForcedLlama  # this process only
    extra = {"device": args.device, "kv_cache_memory_gib": 0.5} if args.device == "cpu" else {}
    spec = None
    if args.mode != "off":
        mc = load_model_config(resolve_model_source(args.model))
        dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
        method = "eagle3" if args.mode == "eagle" else OracleEagle3Drafter.name
        spec = {"method": method, "model": head_dir(mc, args.draft_vocab, dtype), "num_speculative_tokens": k,
                "policy": args.policy}
    if args.mode == "oracle":
        plugin = types.SimpleNamespace(register_drafters=hookimpl(
            lambda register: register(OracleEagle3Drafter.name, OracleEagle3Drafter)))
        pm.register(plugin, "spec-eagle-benchmark")
        OracleEagle3Drafter.rate = per_position_rate(args.acceptance, k) if args.acceptance < 1 else 1.0
    llm = LLM(model=args.model, dtype=args.dtype, speculative_config=spec, **extra)
    eng = llm.llm_engine
    vocab = eng.model_config.vocab_size
    rng = random.Random(1234)

    def batch(n):
        return [[rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(n)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    warm, prompts = batch(args.batch_size), batch(args.batch_size)
    llm.generate([{"prompt_token_ids": p} for p in warm], params, use_tqdm=False)
    drafting, filling = [0.0], [0.0]
    if eng.spec is not None:
        sync = torch.cuda.synchronize if args.phases and torch.cuda.is_available() else (lambda: None)
        timed(eng.spec.drafter, "propose", drafting, sync)
        timed(eng.spec.drafter, "observe", filling, sync)
    before = dict(eng.get_stats()["spec_decode"] or {})
    steps, step = [0], eng.step

    def counting_step():
        steps[0] += 1
        return step()
    eng.step = counting_step
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    outputs = [list(o.outputs[0].token_ids) for o in outs]
    tokens = sum(len(o) for o in outputs)
    result = {"mode": args.mode, "model": args.model, "dtype": args.dtype, "batch_size": args.batch_size, "k": k,
              "policy": args.policy, "input_len": args.input_len, "output_len": args.output_len, "wall_s": wall,
              "tokens_per_s": tokens / wall, "steps": steps[0], "tpot_ms": 1e3 * wall / args.output_len,
              "propose_ms_per_step": 1e3 * drafting[0] / steps[0], "fill_ms_per_step": 1e3 * filling[0] / steps[0],
              "phases": args.phases}
    if spec is not None:
        after = eng.get_stats()["spec_decode"] or {}
        d = {key: after[key] - before.get(key, 0) for key in ("num_draft_tokens", "num_accepted_tokens", "num_steps",
                                                              "num_steps_without")}
        result.update(acceptance=d["num_accepted_tokens"] / max(d["num_draft_tokens"], 1),
                      steps_drafting=d["num_steps"], steps_without=d["num_steps_without"],
                      head_graphs=eng.spec.drafter.graphs is not None)
    result["outputs_forced"] = all(
        out == forced(torch.arange(len(p), len(p) + len(out)), vocab).tolist() for p, out in zip(prompts, outputs))
    if args.mode == "oracle":
        result["per_position_rate"] = OracleEagle3Drafter.rate
    print(json.dumps(result))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
