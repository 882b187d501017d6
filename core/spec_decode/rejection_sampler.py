"""Verification of draft tokens that keeps the target model's output distribution exactly.

For a request with drafts d_1..d_k the target forward gives k + 1 rows of distributions p_1..p_{k+1}
(row j predicts the token after d_1..d_{j-1}). Draft d_j is accepted with probability
min(1, p_j(d_j) / q_j(d_j)); at the first rejection the token is drawn from the residual
max(p_j - q_j, 0), normalised; when every draft is accepted a bonus token is drawn from p_{k+1}.
Each emitted token is then distributed as p (Leviathan et al., 2023; Chen et al., 2023). A drafter
without probabilities is q = one-hot at its draft. Greedy rows accept a draft iff it is the argmax
and emit the argmax at the first mismatch, so greedy output is token-for-token that of plain decoding.

Seeded requests are verified by coupling instead (Daliri et al., 2024, "drafter-invariant"
speculative decoding): the sampler gives the token it would draw at each row, ``argmax(p / E)``
with ``E`` keyed by the request's seed and the row's output position (``kvforge.keyed_random``);
draft d_j is accepted iff it is that token, and the final token is that token at its row. So the
token at every position is the one plain decoding draws there, whatever the drafts: a seeded
request's output does not depend on the drafter, on k, on the policy or on the batch. Its
distribution is p exactly (the exponential race over independent keys); the acceptance is the
probability that the draft equals the target's draw: p(d) for one-hot drafts (as above), and
at least (1 - TV) / (1 + TV) for a drafter that draws its drafts with the same keyed E.

Everything is vectorised over the batch on the device.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvforge.sampler import NO_TOKEN


@dataclass
class TargetDistribution:
    """What the target wants at each sampled row, as the sampler computed it (``Sampler.target``).

    ``probs`` rows of greedy rows are not read; ``probs`` is None when every row is greedy.
    NOTE: the rows of one request are all seeded or all not (the seed is the request's).
    """

    greedy_tokens: torch.Tensor  # [rows] int64: argmax of the processed logits
    sampleable: torch.Tensor  # [rows] bool: False where every logit is -inf or one is NaN
    greedy: torch.Tensor | None = None  # [rows] bool; None: every row greedy
    probs: torch.Tensor | None = None  # [rows, vocab] float32, the distribution to sample from
    seeded: torch.Tensor | None = None  # [rows] bool: rows of seeded sampled requests; None: none
    # [rows] int64: at seeded rows, the token the sampler draws there (keyed by seed and output
    # position); any value elsewhere
    seeded_tokens: torch.Tensor | None = None


@dataclass
class VerifiedTokens:
    """The result for a batch of ``B`` requests with at most ``K`` drafts each."""

    tokens: torch.Tensor  # [B, K + 1] int64: the emitted tokens first, then NO_TOKEN padding
    num_emitted: torch.Tensor  # [B] int64: accepted drafts + 1 (the last is NO_TOKEN if nothing could be sampled)
    num_accepted: torch.Tensor  # [B] int64

    def packed(self) -> torch.Tensor:
        """[B, K + 2] int64: row b is request b's ``tokens``, then its ``num_emitted`` (one copy to the host)."""
        return torch.cat([self.tokens, self.num_emitted[:, None]], dim=1)

    @property
    def accepted_by_position(self) -> torch.Tensor:
        """[K] int64: requests whose draft at position j was accepted (drafts are accepted as a run)."""
        K = self.tokens.shape[1] - 1
        return (self.num_accepted[:, None] > torch.arange(K, device=self.tokens.device)).sum(dim=0)


def rejection_sample(target: TargetDistribution, draft_tokens: torch.Tensor, num_drafts: torch.Tensor | None = None,
                     first_row: torch.Tensor | None = None, draft_probs: torch.Tensor | None = None) -> VerifiedTokens:
    """Verify the drafts of ``B`` requests.

    draft_tokens: [B, K] int64 (padding past a request's ``num_drafts`` is ignored).
    num_drafts: [B] int64, k_b in 0..K. first_row: [B] int64, the row of the request's first
    distribution; its rows are ``first_row[b] .. first_row[b] + k_b``. Both None: a uniform batch,
    every request with K drafts and rows ``b * (K + 1) ..`` (the layout of a CUDA-graph step).
    draft_probs: [B, K, vocab] float32, q of each draft position; None means one-hot at the draft
    (seeded requests do not read it: they are verified by coupling, see the module's docstring).
    """
    if num_drafts is None and target.probs is None:
        return _greedy_uniform(target, draft_tokens)
    dev = draft_tokens.device
    B, K = draft_tokens.shape
    if num_drafts is None:
        num_drafts = torch.full((B,), K, dtype=torch.long, device=dev)
        first_row = torch.arange(B, device=dev) * (K + 1)
    elif first_row is None:
        raise ValueError("rejection_sample: num_drafts needs first_row (both None: a uniform batch)")
    # None greedy: every row greedy (and then probs is None too)
    probs, greedy = (target.probs, target.greedy) if target.greedy is not None else (None, None)
    pos = torch.arange(K, device=dev)
    valid = pos[None, :] < num_drafts[:, None]  # [B, K]
    rows = first_row[:, None] + pos[None, :]  # [B, K] the row that judges draft j
    rows = torch.where(valid, rows, first_row[:, None])
    drafts = torch.where(valid, draft_tokens, 0)
    # a row with nothing to sample accepts no draft (its final token is then NO_TOKEN)
    greedy_match = (target.greedy_tokens[rows] == drafts) & target.sampleable[rows]  # [B, K]
    if probs is None or greedy is None:
        accept = greedy_match
    else:
        p = probs[rows, drafts]  # [B, K]
        q = (draft_probs.gather(2, drafts[:, :, None]).squeeze(2) if draft_probs is not None
             else torch.ones_like(p))
        u = torch.rand(B, K, device=dev)
        # u < p / q, written without dividing: q > 0 wherever the draft was drawn from q
        accept = torch.where(greedy[rows], greedy_match, u * q < p)
        if target.seeded is not None and target.seeded_tokens is not None:  # coupled: the draft is the draw
            seeded_match = (target.seeded_tokens[rows] == drafts) & target.sampleable[rows]
            accept = torch.where(target.seeded[rows], seeded_match, accept)
    accept &= valid
    run = accept.long().cumprod(dim=1)  # 1 while every draft so far was accepted
    num_accepted = run.sum(dim=1)
    last = first_row + num_accepted  # the row the final token comes from
    final = target.greedy_tokens[last]
    if probs is not None and greedy is not None:
        dist = probs[last]  # [B, vocab]
        rejected = num_accepted < num_drafts
        at = num_accepted.clamp(max=max(K - 1, 0))
        if K:
            if draft_probs is not None:
                q_at = draft_probs[torch.arange(B, device=dev), at]
                residual = (dist - q_at).clamp_min(0)
            else:
                residual = dist.scatter(1, drafts.gather(1, at[:, None]), 0.0)
            # NOTE: an all-zero residual (p == q) cannot be reached by a rejection; keep p there
            residual = torch.where(residual.sum(dim=1, keepdim=True) > 0, residual, dist)
            dist = torch.where(rejected[:, None], residual, dist)
        sampled = (dist / torch.empty_like(dist).exponential_()).argmax(dim=1)
        if target.seeded is not None and target.seeded_tokens is not None:
            # NOTE: a seeded request's final token is the sampler's keyed draw at its row: after a
            # rejection it is not the draft (the draft was rejected for being other than it), so it is
            # distributed as the residual of one-hot q, and as p after a full run (the bonus token)
            sampled = torch.where(target.seeded[last], target.seeded_tokens[last], sampled)
        final = torch.where(greedy[last], final, sampled)
    final = torch.where(target.sampleable[last], final, NO_TOKEN)
    tokens = torch.full((B, K + 1), NO_TOKEN, dtype=torch.long, device=dev)
    tokens[:, :K] = torch.where(run.bool(), drafts, NO_TOKEN)
    tokens.scatter_(1, num_accepted[:, None], final[:, None])
    return VerifiedTokens(tokens, num_accepted + 1, num_accepted)


def _greedy_uniform(target: TargetDistribution, drafts: torch.Tensor) -> VerifiedTokens:
    """Every row greedy, every request K drafts at rows b * (K + 1)..: the accepted drafts are the
    greedy tokens themselves, so the emitted tokens are the greedy tokens up to the first mismatch
    (a few kernels: a step at batch 1 is bound by launches, not by arithmetic)."""
    B, K = drafts.shape
    greedy = torch.where(target.sampleable, target.greedy_tokens, NO_TOKEN).view(B, K + 1)
    run = (greedy[:, :K] == drafts).cumprod(dim=1)  # drafts >= 0: an unsampleable row accepts nothing
    num_accepted = run.sum(dim=1)
    emitted = torch.cat([torch.ones_like(run[:, :1]), run], dim=1).bool()  # the run, then the final token
    return VerifiedTokens(torch.where(emitted, greedy, NO_TOKEN), num_accepted + 1, num_accepted)
