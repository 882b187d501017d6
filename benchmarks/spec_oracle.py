"""What ``draft_model`` costs per step and what it would give at a set acceptance rate.

Two random-weight (``dummy:``) models never agree, and in bfloat16 a random model's greedy output
even changes with the shape of the step that computes it (its top logits are near-ties), so neither
a real acceptance rate nor a known greedy continuation exists for them. This script therefore makes
the continuation known: both models are the dummy models with one addition at the end of their
forward (``ForcedLlama``), which raises the logit of token ``forced(p)`` for the token at position
``p`` by 30 (a gather and an add per token, about nothing next to the model; ``--no-force`` measures
the plain model to show it). The greedy output is then ``forced(p)`` whatever the numerics, and:

  off     the target alone
  draft   ``draft_model`` with the draft model, policy fixed: the draft model proposes the forced
          tokens (all accepted); the time ``Drafter.propose`` takes per step is the drafting overhead
  oracle  the same drafter, which still runs the draft model every step (so its cost is paid), but
          whose proposals are then corrupted: draft i stays right with probability r given that
          drafts 1..i-1 were, r chosen so that the expected share of accepted drafts,
          (r + r^2 + ... + r^k) / k, is ``--acceptance``; the first wrong draft is replaced by
          another token and the rest follow it. Greedy verification accepts exactly the right
          prefix, so the measured acceptance lands on the set one.

    python benchmarks/spec_oracle.py off|draft [--batch-size 1] [--no-force]
    python benchmarks/spec_oracle.py oracle --acceptance 0.7
Prints one JSON line: wall time, tokens per second, engine steps, TPOT, drafting time per step,
the acceptance, and whether every output was the forced continuation.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
import types

import torch

from kvforge import LLM, SamplingParams
from kvforge.hookspecs import hookimpl
from kvforge.plugin_manager import get_plugin_manager
from kvforge.plugins.models.llama import LlamaForCausalLM
from kvforge.plugins.speculative.draft_model import DraftModelDrafter

MARGIN = 30.0  # logits


def forced(positions, vocab: int):
    """The token the forced models put at each position (a fixed pseudo-random function)."""
    return (positions * 2654435761 + 97) % vocab


class ForcedLlama(LlamaForCausalLM):
    """The dummy Llama whose top logit for the token at position p is ``forced(p)`` (by ``MARGIN``):
    the final hidden state of position p - 1 gets ``MARGIN * w / |w|^2`` added, ``w`` that token's
    row of the LM head. Static shapes and no host work: it runs inside CUDA graphs as well."""

    def forward(self, input_ids, positions, kv_caches, attn_meta):
        hidden = super().forward(input_ids, positions, kv_caches, attn_meta)
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        rows = weight[forced(positions + 1, weight.shape[0])].float()
        return hidden + (rows * (MARGIN / rows.pow(2).sum(-1, keepdim=True))).to(hidden.dtype)


def per_position_rate(acceptance: float, k: int) -> float:
    """r with (r + ... + r^k) / k = acceptance (bisection; the left side grows with r)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid ** i for i in range(1, k + 1)) / k < acceptance:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def force_acceptance(proposal, batch, rng: random.Random, rate: float, vocab: int) -> None:
    """Replace a proposal's drafts in place: draft i is the forced token with probability ``rate`` given that
    drafts 1..i-1 were, else a wrong one; verification is greedy (q one-hot)."""
    for b, r in enumerate(batch.requests):
        drafts = proposal.token_ids[b]
        right = 0
        while right < len(drafts) and rng.random() < rate:
            right += 1
        proposal.token_ids[b] = [int(forced(r.num_tokens + j, vocab)) + (j >= right) for j in range(len(drafts))]
    proposal.draft_probs = None


class OracleDrafter(DraftModelDrafter):
    """Test-only: the draft model runs, then its proposals are corrupted to a set acceptance (see the
    module docstring)."""

    name = "oracle_draft_model"
    rate = 1.0

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.rng = random.Random(0)

    def propose(self, batch):
        proposal = super().propose(batch)
        force_acceptance(proposal, batch, self.rng, self.rate, self.vocab_size)
        return proposal


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["off", "draft", "oracle"])
    ap.add_argument("--model", default="dummy:llama-3-8b")
    ap.add_argument("--draft-model", default="dummy:llama-3.2-1b")
    ap.add_argument("--num-speculative-tokens", "-k", type=int, default=4)
    ap.add_argument("--acceptance", type=float, default=0.7)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--no-force", action="store_true", help="the plain dummy models (outputs not known)")
    ap.add_argument("--phases", action="store_true",
                    help="also time the drafter's forwards and draws, synchronising the device around each")
    args = ap.parse_args()
    k = args.num_speculative_tokens
    spec = None
    if args.mode != "off":
        method = "draft_model" if args.mode == "draft" else OracleDrafter.name
        spec = {"method": method, "model": args.draft_model, "num_speculative_tokens": k, "policy": "fixed"}
    pm = get_plugin_manager()
    if not args.no_force:
        pm.registries["model"]._entries["LlamaForCausalLM"].target = ForcedLlama  # this process only
    if args.mode == "oracle":
        plugin = types.SimpleNamespace(register_drafters=hookimpl(
            lambda register: register(OracleDrafter.name, OracleDrafter)))
        pm.register(plugin, "spec-oracle-benchmark")
        OracleDrafter.rate = per_position_rate(args.acceptance, k)
    llm = LLM(model=args.model, dtype=args.dtype, speculative_config=spec)
    eng = llm.llm_engine
    vocab = eng.model_config.vocab_size
    rng = random.Random(1234)

    def batch(n):
        return [[rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(n)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    warm, prompts = batch(args.batch_size), batch(args.batch_size)
    llm.generate([{"prompt_token_ids": p} for p in warm], params, use_tqdm=False)
    drafting = [0.0]
    if eng.spec is not None:
        propose = eng.spec.drafter.propose

        def timed(b):
            t = time.perf_counter()
            try:
                return propose(b)
            finally:
                drafting[0] += time.perf_counter() - t
        eng.spec.drafter.propose = timed
    phases: dict[str, list[float]] = {}
    if args.phases and eng.spec is not None:
        sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

        def synced(obj, name, key_of):
            fn = getattr(obj, name)

            def wrapper(*a, **kw):
                sync()
                t = time.perf_counter()
                out = fn(*a, **kw)
                sync()
                acc = phases.setdefault(key_of(a, kw), [0.0, 0])
                acc[0] += time.perf_counter() - t
                acc[1] += 1
                return out
            setattr(obj, name, wrapper)
        d = eng.spec.drafter
        synced(d, "_forward", lambda a, kw: "forward_decode" if kw.get("stage") else "forward_catch_up")
        synced(d, "_draw", lambda a, kw: "draw")
        result_graphs = d.graphs is not None
    before = dict(eng.get_stats()["spec_decode"] or {})
    steps = [0]
    step = eng.step

    def counting_step():
        steps[0] += 1
        return step()
    eng.step = counting_step
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    outputs = [list(o.outputs[0].token_ids) for o in outs]
    tokens = sum(len(o) for o in outputs)
    result = {"mode": args.mode, "forced": not args.no_force, "model": args.model, "dtype": args.dtype,
              "batch_size": args.batch_size, "k": k,
              "input_len": args.input_len, "output_len": args.output_len, "wall_s": wall,
              "tokens_per_s": tokens / wall, "steps": steps[0],
              "tpot_ms": 1e3 * wall / args.output_len,
              "drafting_ms_per_step": 1e3 * drafting[0] / steps[0] if spec else 0.0}
    if spec is not None:
        after = eng.get_stats()["spec_decode"]
        d = {key: after[key] - before.get(key, 0) for key in ("num_draft_tokens", "num_accepted_tokens")}
        result["acceptance"] = d["num_accepted_tokens"] / max(d["num_draft_tokens"], 1)
    if not args.no_force:
        result["outputs_forced"] = all(
            out == forced(torch.arange(len(p), len(p) + len(out)), vocab).tolist() for p, out in zip(prompts, outputs))
    if phases:
        result["draft_graphs"] = result_graphs
        result["phases_ms_per_call"] = {key: [round(1e3 * t / n, 3), n] for key, (t, n) in phases.items()}
    if args.mode == "oracle":
        result["per_position_rate"] = OracleDrafter.rate
    print(json.dumps(result))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
