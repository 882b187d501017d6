"""``default``: the full set of vLLM sampling parameters, batched on the device.

Order, as vLLM's: masks (allowed tokens, bad words, ``min_tokens``, structured-output grammar),
logit bias, registered logits processors, penalties (repetition, frequency, presence) on the raw
logits, then temperature, top-k, top-p, min-p, and the draw. Greedy rows take the argmax of the
processed logits. Sampling draws ``argmax(probs / E)`` with ``E ~ Exponential(1)`` (equivalent to
drawing from ``probs``). Unseeded rows take ``E`` from torch's global stream; rows with a seed
take it keyed by (seed, output position) (``kvforge.keyed_random``): the token at a position is a
function of the request alone, whatever else shares the batch and whichever step draws it (a plain
step, or one verifying drafts: ``target`` gives the rejection sampler the same draw). Each
feature's tensors are built only when some row in the step uses it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Sequence

import numpy as np
import torch

from kvforge.keyed_random import TOKEN, keyed_draw, keyed_exponentials, row_keys
from kvforge.rank.input_buffers import h2d
from kvforge.request import Request
from kvforge.sampler import NO_TOKEN, LogitsProcessor, Sampler, output_position
from kvforge.spec_decode.rejection_sampler import TargetDistribution


class SeededRows(NamedTuple):
    """The step's rows of seeded sampled requests and their draws' keys (``kvforge.keyed_random``)."""

    rows: torch.Tensor  # [n] int64
    keys: torch.Tensor  # [n] int64: row_keys(seed, output position, TOKEN)
    every_row: bool  # every row of the step is one (no unkeyed draw needed)


@dataclass
class Draw:
    """How the step's rows draw (a step with any non-greedy row has one), per row on the device."""

    temperature: torch.Tensor  # [rows] float32 (greedy rows set to 1)
    greedy: torch.Tensor  # [rows] bool
    top_k: torch.Tensor | None = None  # [rows] int64, vocab size where disabled
    top_p: torch.Tensor | None = None  # [rows] float32
    min_p: torch.Tensor | None = None  # [rows] float32
    seeded: SeededRows | None = None  # None: no row has a seed


class Penalties(NamedTuple):
    """The repetition, frequency and presence penalties' inputs (:meth:`DefaultSampler._penalty_tensors`)."""

    counts: torch.Tensor  # [rows, vocab] float32, each token's count in the row's output
    seen: torch.Tensor  # [rows, vocab] bool, in the output (or the prompt, for repetition-penalty rows)
    presence: torch.Tensor  # [rows] float32
    frequency: torch.Tensor  # [rows] float32
    repetition: torch.Tensor  # [rows] float32


@dataclass
class SamplingState:
    """One step's sampling parameters, gathered by :meth:`DefaultSampler.prepare`."""

    any_greedy: bool
    draw: Draw | None = None  # None: every row is greedy
    banned: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, token ids) forced to -inf
    allowed: torch.Tensor | None = None  # [rows, vocab] bool, True = allowed (None: all)
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (rows, ids, values)
    penalties: Penalties | None = None
    grammar: Callable[[torch.Tensor], torch.Tensor] | None = None  # applies the structured-output bitmasks
    # (processor, its rows [n] int64, their requests)
    processors: list[tuple[LogitsProcessor, torch.Tensor, list[Request]]] = field(default_factory=list)

    @property
    def all_greedy(self) -> bool:
        return self.draw is None


class DefaultSampler(Sampler[SamplingState]):
    name = "default"

    # -- per step: gather parameters ----------------------------------------------------------------
    def prepare(self, requests: Sequence[Request]) -> SamplingState:
        params = [r.sampling_params for r in requests]
        dev, vocab = self.device, self.vocab_size
        greedy = [p.temperature == 0.0 for p in params]
        st = SamplingState(any(greedy))
        if not all(greedy):
            temperature = [p.temperature if p.temperature > 0 else 1.0 for p in params]
            draw = st.draw = Draw(h2d(temperature, torch.float32, dev), h2d(greedy, torch.bool, dev))
            if any(0 < p.top_k < vocab for p in params):
                draw.top_k = h2d([p.top_k if 0 < p.top_k < vocab else vocab for p in params], torch.long, dev)
            if any(p.top_p < 1.0 for p in params):
                draw.top_p = h2d([p.top_p for p in params], torch.float32, dev)
            if any(p.min_p > 0.0 for p in params):
                draw.min_p = h2d([p.min_p for p in params], torch.float32, dev)
            seeded = [i for i, p in enumerate(params) if p.seed is not None and not greedy[i]]
            if seeded:
                draw.seeded = _seeded_rows(requests, seeded, dev)
        self._masks(requests, st)
        if any(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0 for p in params):
            st.penalties = self._penalty_tensors(requests)
        if any(r.grammar is not None for r in requests):
            from kvforge.engine.structured_output import grammar_bitmask_applier
            st.grammar = grammar_bitmask_applier(requests, vocab, dev)
        if self.get_processor is not None and any(p.logits_processors for p in params):
            names = sorted({n for p in params for n in (p.logits_processors or [])})
            for name in names:
                rows = [i for i, p in enumerate(params) if name in (p.logits_processors or [])]
                st.processors.append((self.get_processor(name), h2d(rows, torch.long, dev),
                                      [requests[i] for i in rows]))
        return st

    def _masks(self, requests: Sequence[Request], st: SamplingState) -> None:
        ban_rows: list[int] = []
        ban_ids: list[int] = []
        bias_rows, bias_ids, bias_vals = [], [], []
        allowed_rows = []
        for row, req in enumerate(requests):
            p = req.sampling_params
            if p.min_tokens and len(req.output_token_ids) < p.min_tokens:
                stop_ids = list(p._eos_token_ids) + list(p.stop_token_ids or [])
                ban_rows += [row] * len(stop_ids)
                ban_ids += stop_ids
            if req.bad_words_token_ids:
                for ids in req.bad_words_token_ids:
                    prefix = ids[:-1]
                    if not prefix or req.output_token_ids[-len(prefix):] == prefix:
                        ban_rows.append(row)
                        ban_ids.append(ids[-1])
            if p.logit_bias:
                bias_rows += [row] * len(p.logit_bias)
                bias_ids += list(p.logit_bias)
                bias_vals += list(p.logit_bias.values())
            if p.allowed_token_ids is not None:
                allowed_rows.append(row)
        dev = self.device
        if ban_rows:
            st.banned = (h2d(ban_rows, torch.long, dev), h2d(ban_ids, torch.long, dev))
        if bias_rows:
            st.bias = (h2d(bias_rows, torch.long, dev), h2d(bias_ids, torch.long, dev),
                       h2d(bias_vals, torch.float32, dev))
        if allowed_rows:
            allowed = torch.ones(len(requests), self.vocab_size, dtype=torch.bool)
            for row in allowed_rows:
                allowed[row] = False
                allowed[row, requests[row].sampling_params.allowed_token_ids] = True
            st.allowed = allowed.to(dev)

    def _penalty_tensors(self, requests: Sequence[Request]) -> Penalties:
        """Output-token counts [rows, vocab] and a prompt+output presence mask, from flat index lists."""
        dev, vocab = self.device, self.vocab_size
        params = [r.sampling_params for r in requests]
        out_rows = np.repeat(np.arange(len(requests)), [len(r.output_token_ids) for r in requests])
        out_ids = np.fromiter((t for r in requests for t in r.output_token_ids), dtype=np.int64,
                              count=len(out_rows))
        counts = torch.zeros(len(requests), vocab, dtype=torch.float32, device=dev)
        if len(out_ids):
            counts.index_put_((torch.from_numpy(out_rows).to(dev), torch.from_numpy(out_ids).to(dev)),
                              torch.ones(len(out_ids), device=dev), accumulate=True)
        seen = counts > 0
        if any(p.repetition_penalty != 1.0 for p in params):
            rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
            pr = np.repeat(rows, [len(requests[i].prompt_token_ids) for i in rows])
            pi = np.fromiter((t for i in rows for t in requests[i].prompt_token_ids), dtype=np.int64, count=len(pr))
            seen[torch.from_numpy(pr).to(dev), torch.from_numpy(pi).to(dev)] = True
        f = lambda name: torch.tensor([getattr(p, name) for p in params], dtype=torch.float32, device=dev)  # noqa
        return Penalties(counts, seen, f("presence_penalty"), f("frequency_penalty"), f("repetition_penalty"))

    # -- per step: sample -----------------------------------------------------------------------------
    def process(self, logits: torch.Tensor, st: SamplingState) -> torch.Tensor:
        """Everything before temperature: masks, bias, processors, penalties. logits: [rows, vocab]."""
        if st.banned is not None:
            logits = logits.index_put(st.banned, torch.tensor(float("-inf"), device=logits.device))
        if st.allowed is not None:
            logits = logits.masked_fill(~st.allowed, float("-inf"))
        if st.grammar is not None:
            logits = st.grammar(logits)
        if st.bias is not None:
            rows, ids, vals = st.bias
            logits = logits.index_put((rows, ids), vals, accumulate=True)
        for proc, rows, reqs in st.processors:
            logits = logits.clone()
            logits[rows] = proc.apply(logits[rows], reqs)
        if st.penalties is not None:
            counts, seen, presence, frequency, repetition = st.penalties
            rep = repetition[:, None]
            penalised = torch.where(logits > 0, logits / rep, logits * rep)
            logits = torch.where(seen, penalised, logits)
            logits = logits - frequency[:, None] * counts - presence[:, None] * (counts > 0).float()
        return logits

    def sample(self, logits: torch.Tensor, state: SamplingState) -> torch.Tensor:
        # logits: [rows, vocab] float32
        logits = self.process(logits, state)
        # one reduction gives both the greedy tokens and the rows with nothing to sample: a row whose
        # every logit is -inf (its masks exclude the whole vocabulary) or holding a NaN (max propagates it)
        top, greedy_tokens = logits.max(dim=-1)
        sampleable = top > float("-inf")
        draw = state.draw
        if draw is None:  # every row is greedy
            return torch.where(sampleable, greedy_tokens, NO_TOKEN)
        probs = self._probs(logits, draw)
        seeded = draw.seeded
        if seeded is not None and seeded.every_row:
            noise = keyed_exponentials(seeded.keys, probs.shape[-1])
        else:
            noise = torch.empty_like(probs).exponential_()
            if seeded is not None:
                noise[seeded.rows] = keyed_exponentials(seeded.keys, probs.shape[-1])
        tokens = (probs / noise).argmax(dim=-1)
        if state.any_greedy:
            tokens = torch.where(draw.greedy, greedy_tokens, tokens)
        return torch.where(sampleable, tokens, NO_TOKEN)

    def target(self, logits: torch.Tensor, state: SamplingState) -> TargetDistribution:
        logits = self.process(logits, state)
        top, greedy_tokens = logits.max(dim=-1)
        target = TargetDistribution(greedy_tokens, top > float("-inf"))
        draw = state.draw
        if draw is not None:
            target.greedy, target.probs = draw.greedy, self._probs(logits, draw)
            if draw.seeded is not None:  # the tokens sample() would draw at the seeded rows
                rows = draw.seeded.rows
                target.seeded = torch.zeros_like(draw.greedy).index_fill_(0, rows, True)
                target.seeded_tokens = greedy_tokens.index_copy(0, rows, keyed_draw(target.probs[rows],
                                                                                    draw.seeded.keys))
        return target

    @staticmethod
    def _probs(logits: torch.Tensor, draw: Draw) -> torch.Tensor:
        """Processed logits -> the distribution sampled rows draw from: temperature, top-k, top-p, min-p."""
        logits = logits / draw.temperature[:, None]
        logits = apply_top_k_top_p(logits, draw.top_k, draw.top_p)
        probs = torch.softmax(logits, dim=-1)
        if draw.min_p is not None:
            top = probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < draw.min_p[:, None] * top, 0.0)
        return probs

    def reads_history(self, request: Request) -> bool:
        """Penalties, ``min_tokens``, bad words, logits processors and a grammar read the generated tokens;
        a seeded draw reads the output position."""
        p = request.sampling_params
        return bool(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0 or p.min_tokens
                    or request.bad_words_token_ids or p.logits_processors or request.grammar is not None
                    or (p.seed is not None and not p.greedy))

    def plain_greedy(self, request: Request) -> bool:
        p = request.sampling_params
        return (p.greedy and p.logprobs is None and not p.logit_bias and p.allowed_token_ids is None
                and not self.reads_history(request))


def _seeded_rows(requests: Sequence[Request], rows: list[int], device: torch.device) -> SeededRows:
    """The keys of the seeded rows' draws: (seed, output position, TOKEN), one copy to the device."""
    seeds = [requests[i].sampling_params.seed or 0 for i in rows]
    keys = row_keys(seeds, [output_position(requests[i]) for i in rows], TOKEN)
    packed = h2d(np.concatenate([np.asarray(rows, dtype=np.int64), keys]), torch.long, device)
    n = len(rows)
    return SeededRows(packed[:n], packed[n:], n == len(requests))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask (to -inf) the logits outside each row's top-k and top-p nucleus. logits: [rows, vocab]."""
    if top_k is None and top_p is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        remove |= torch.arange(vocab, device=logits.device)[None, :] >= top_k[:, None]
    if top_p is not None:
        probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
        # mass strictly before each token; the top token is always kept (even where top_p rounds to 0)
        before = probs.cumsum(dim=-1) - probs
        remove[:, 1:] |= before[:, 1:] >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
