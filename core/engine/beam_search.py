"""Beam search over forked sequences: beams share KV blocks copy-on-write and fork on divergence.

Every live beam is a driven request of the scheduler (``Scheduler.add_driven``): this driver, not
the sampler, chooses its tokens. Each round, every beam computes its newest token and returns the top
``2 * beam_width`` next-token log-probabilities; the driver ranks all candidates, keeps the best
``beam_width`` that continue and records those that end (EOS or the length limit), exactly as
transformers' beam search does (``early_stopping=False``). A kept candidate reuses its parent's
sequence; a second child of the same parent forks it (``Scheduler.fork``: shared blocks, the partial
last block copied on its first write); parents with no child are aborted; each beam then takes its
token (``Scheduler.append_tokens``). The driver only asks the scheduler: it never writes its queues.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator

from kvforge.request import Request
from kvforge.sampling_params import SamplingParams
from kvforge.scheduler import TokenLogprobs

if TYPE_CHECKING:
    from kvforge.engine.llm_engine import LLMEngine


@dataclass
class BeamSearchParams:
    """beam_width beams; at most max_tokens new tokens; score = sum of logprobs / length ** length_penalty."""

    beam_width: int
    max_tokens: int
    length_penalty: float = 1.0
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise ValueError(f"beam_width must be an integer >= 1, got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")


@dataclass
class BeamSearchSequence:
    tokens: list[int]  # prompt + generated
    cum_logprob: float
    score: float
    text: str | None = None
    finish_reason: str | None = None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first


@dataclass
class _Beam:
    req: Request
    cum: float
    ready: TokenLogprobs | None = None  # the log-probabilities at its newest position, once computed


@dataclass
class _Search:
    prompt: list[int]
    beams: list[_Beam]
    finished: list[tuple[float, float, list[int], str]] = field(default_factory=list)  # score, cum, gen, reason
    done: bool = False


def beam_search(engine: LLMEngine, prompts: list[list[int]], params: BeamSearchParams) -> list[BeamSearchOutput]:
    """Run beam search for every prompt (token ids) on ``engine`` (an LLMEngine).

    Prompts run in groups whose beams all fit in the KV pool at full length: beams never wait for
    blocks held by other beams (beams with nothing left to compute this round cannot be preempted).
    """
    for prompt in prompts:
        if len(prompt) + params.max_tokens > engine.max_model_len:
            raise ValueError(f"max_tokens: prompt ({len(prompt)}) + max_tokens ({params.max_tokens}) exceeds "
                             f"max_model_len={engine.max_model_len}")
    bs, pool = engine.kv_cache.block_size, engine.kv_cache.num_blocks
    need = [params.beam_width * -(-(len(p) + params.max_tokens + 1) // bs) for p in prompts]
    for p, n in zip(prompts, need):
        if n > pool:
            raise ValueError(f"beam_width: {params.beam_width} beams of {len(p) + params.max_tokens} tokens need "
                             f"{n} KV blocks; the pool has {pool}")
    outputs: list[BeamSearchOutput] = []
    group: list[list[int]] = []
    used = 0
    for p, n in zip(prompts, need):
        if group and used + n > pool:
            outputs += _beam_search_group(engine, group, params)
            group, used = [], 0
        group.append(p)
        used += n
    return outputs + (_beam_search_group(engine, group, params) if group else [])


def _beam_search_group(engine: LLMEngine, prompts: list[list[int]], params: BeamSearchParams) -> list[BeamSearchOutput]:
    w = params.beam_width
    eos = set(engine.eos_token_ids) if not params.ignore_eos else set()
    ids = itertools.count()
    searches = []
    for prompt in prompts:
        req = _new_request(f"beam-{next(ids)}", prompt, [], 2 * w, params.max_tokens)
        engine.scheduler.add_driven(req)
        searches.append(_Search(prompt, [_Beam(req, 0.0)]))
    by_id: dict[str, tuple[_Search, _Beam]] = {s.beams[0].req.request_id: (s, s.beams[0]) for s in searches}
    try:
        while any(not s.done for s in searches):
            engine.step()
            for rid, entries in engine.last_runner_output.logprobs.items():  # one token per beam per step
                if rid in by_id:
                    by_id[rid][1].ready = entries[0]
            for s in searches:
                if not s.done and all(b.ready is not None for b in s.beams):
                    _advance(engine, s, params, eos, ids, by_id)
    finally:
        live = [b.req.request_id for s in searches for b in s.beams if not b.req.finished]
        engine.scheduler.abort(live)
    outputs = []
    for s in searches:
        ranked = sorted(s.finished, key=lambda f: f[0], reverse=True)
        seqs = [BeamSearchSequence(s.prompt + gen, cum, score, _decode(engine, gen), reason)
                for score, cum, gen, reason in ranked]
        outputs.append(BeamSearchOutput(seqs))
    return outputs


def _new_request(rid: str, prompt: list[int], generated: list[int], k: int, max_tokens: int) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=k, ignore_eos=True)
    return Request(rid, list(prompt), params, max_tokens=max_tokens + 1, output_token_ids=list(generated))


def _advance(engine: LLMEngine, s: _Search, params: BeamSearchParams, eos: set[int], ids: Iterator[int],
             by_id: dict[str, tuple[_Search, _Beam]]) -> None:
    """One round of transformers' beam search for one prompt, on the beams' fresh logprobs."""
    w, lp = params.beam_width, params.length_penalty
    gen_len = len(s.beams[0].req.output_token_ids) + 1  # generated tokens once the new one is added
    cands = sorted(((b.cum + v, t, b) for b in s.beams if b.ready is not None  # (all are, by now)
                    for t, v in zip(b.ready.top_ids, b.ready.top_logprobs)), key=lambda c: c[0], reverse=True)[:2 * w]
    hit_max = gen_len >= params.max_tokens
    for rank, (cum, tok, beam) in enumerate(cands):
        if rank < w and (tok in eos or hit_max):
            gen = beam.req.output_token_ids + [tok]
            s.finished.append((cum / gen_len ** lp, cum, gen, "stop" if tok in eos else "length"))
    s.finished = sorted(s.finished, key=lambda f: f[0], reverse=True)[:w]
    keep = [c for c in cands if c[1] not in eos][:w]
    if hit_max or not keep:
        s.done = True
    else:
        best_running = keep[0][0] / gen_len ** lp
        full = len(s.finished) == w
        s.done = full and not best_running > min(f[0] for f in s.finished)
    if s.done:
        return
    # children: the first child of a parent takes over its sequence; others fork it
    sched = engine.scheduler
    new_beams: list[tuple[_Beam, int]] = []  # each with the token it takes
    reused: set[int] = set()
    for cum, tok, parent in keep:
        if id(parent) not in reused:
            reused.add(id(parent))
            child = parent
        else:
            req = _new_request(f"beam-{next(ids)}", s.prompt, parent.req.output_token_ids, 2 * w, params.max_tokens)
            sched.fork(parent.req, req)
            child = _Beam(req, cum)
            by_id[req.request_id] = (s, child)
        child.cum = cum
        new_beams.append((child, tok))
    for b in s.beams:
        if id(b) not in reused:
            sched.abort([b.req.request_id])
            by_id.pop(b.req.request_id, None)
    for b, tok in new_beams:
        sched.append_tokens(b.req, [tok])
        b.ready = None
    s.beams = [b for b, _ in new_beams]


def _decode(engine: LLMEngine, tokens: list[int]) -> str | None:
    return engine.tokenizer.decode(tokens, skip_special_tokens=True) if engine.tokenizer is not None else None
