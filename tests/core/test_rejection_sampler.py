"""The rejection sampler keeps the target distribution exactly (docs/speculative.md#verification)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvforge.keyed_random import TOKEN, keyed_draw, row_keys
from kvforge.sampler import NO_TOKEN
from kvforge.spec_decode.rejection_sampler import TargetDistribution, rejection_sample

V = 6
N = 200_000  # draws per case
#: total-variation bound: with N draws over V tokens the expected TV is about sqrt(V / (2 pi N)) ~ 0.002
TV_BOUND = 0.01
P = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.10, 0.00])


def _tv(tokens: torch.Tensor, p: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=V).float()
    return 0.5 * (counts / counts.sum() - p).abs().sum().item()


def _batch(q: torch.Tensor | None, k: int, draft: int | None = None):
    """N requests with k drafts each drawn from q (or all equal to ``draft``), and p at every row."""
    torch.manual_seed(0)
    if q is not None:
        drafts = torch.multinomial(q, N * k, replacement=True).view(N, k)
        draft_probs = q.expand(N, k, V).contiguous()
    else:
        drafts = torch.full((N, k), draft)
        draft_probs = None
    rows = N * (k + 1)
    target = TargetDistribution(greedy_tokens=torch.zeros(rows, dtype=torch.long),
                                sampleable=torch.ones(rows, dtype=torch.bool),
                                greedy=torch.zeros(rows, dtype=torch.bool), probs=P.expand(rows, V).contiguous())
    first = torch.arange(N) * (k + 1)
    return target, drafts, torch.full((N,), k), first, draft_probs


@pytest.mark.parametrize("name,q", [
    ("q close to p", torch.tensor([0.25, 0.25, 0.20, 0.10, 0.10, 0.10])),
    ("q zero where p is not", torch.tensor([0.0, 0.0, 0.5, 0.3, 0.1, 0.1])),
    ("q far from p", torch.tensor([0.02, 0.02, 0.02, 0.02, 0.02, 0.90])),
])
def test_emitted_tokens_follow_the_target_whatever_the_draft_distribution(name, q):
    target, drafts, nd, first, dp = _batch(q, 2)
    out = rejection_sample(target, drafts, nd, first, dp)
    assert (out.num_emitted >= 1).all() and (out.num_emitted <= 3).all()
    assert _tv(out.tokens[:, 0], P) < TV_BOUND
    second = out.tokens[out.num_emitted >= 2, 1]
    assert len(second) > 1000 and _tv(second, P) < 3 * TV_BOUND  # fewer draws here
    assert not (out.tokens == 5).any()  # p(5) = 0: never emitted, though q proposes it most


def test_a_drafter_without_probabilities_is_one_hot():
    """n-gram drafts: q = one-hot at the draft; the draft is accepted with probability p(draft)."""
    target, drafts, nd, first, _ = _batch(None, 1, draft=1)
    out = rejection_sample(target, drafts, nd, first, None)
    assert _tv(out.tokens[:, 0], P) < TV_BOUND
    accepted = (out.num_accepted == 1).float().mean().item()
    assert abs(accepted - P[1].item()) < 0.01


def test_greedy_rows_accept_exactly_the_argmax_run():
    # request 0: drafts [3, 4, 1] against argmax [3, 4, 2, 5]: accepts 2, then emits 2
    # request 1: drafts [0] against argmax [1, 7]: rejects at once, emits 1
    # request 2: no drafts, argmax [6]: emits 6
    greedy = torch.tensor([3, 4, 2, 5, 1, 7, 6])
    target = TargetDistribution(greedy, torch.ones(7, dtype=torch.bool))
    drafts = torch.tensor([[3, 4, 1], [0, 0, 0], [0, 0, 0]])
    out = rejection_sample(target, drafts, torch.tensor([3, 1, 0]), torch.tensor([0, 4, 6]))
    assert out.num_emitted.tolist() == [3, 1, 1]
    assert out.tokens[0, :3].tolist() == [3, 4, 2] and out.tokens[1, 0] == 1 and out.tokens[2, 0] == 6
    assert out.accepted_by_position.tolist() == [1, 1, 0]


def test_all_drafts_accepted_gives_a_bonus_token():
    greedy = torch.tensor([3, 4, 9])
    out = rejection_sample(TargetDistribution(greedy, torch.ones(3, dtype=torch.bool)), torch.tensor([[3, 4]]),
                           torch.tensor([2]), torch.tensor([0]))
    assert out.tokens[0].tolist() == [3, 4, 9] and out.num_accepted.item() == 2


def test_a_row_with_nothing_to_sample_ends_in_no_token():
    greedy = torch.tensor([3, 4, 9])
    sampleable = torch.tensor([True, False, True])
    out = rejection_sample(TargetDistribution(greedy, sampleable), torch.tensor([[3, 5]]), torch.tensor([2]),
                           torch.tensor([0]))
    assert out.tokens[0, :2].tolist() == [3, NO_TOKEN] and out.num_emitted.item() == 2


def _seeded(target: TargetDistribution, k: int) -> TargetDistribution:
    """``target`` with every request seeded (request b's seed is b), as ``DefaultSampler.target`` makes
    it: at row j of a request, the keyed draw at output position j."""
    rows = len(target.greedy_tokens)
    b, j = np.divmod(np.arange(rows), k + 1)
    keys = torch.from_numpy(row_keys(b.tolist(), j, TOKEN))
    target.seeded = torch.ones(rows, dtype=torch.bool)
    target.seeded_tokens = keyed_draw(target.probs, keys)
    return target


@pytest.mark.parametrize("name,q", [
    ("one-hot", None),
    ("q close to p", torch.tensor([0.25, 0.25, 0.20, 0.10, 0.10, 0.10])),
    ("q far from p", torch.tensor([0.02, 0.02, 0.02, 0.02, 0.02, 0.90])),
])
def test_seeded_requests_emit_the_keyed_draws_which_follow_the_target(name, q):
    """Coupled verification: over N seeds, the emitted tokens follow p at each position (they are the
    keyed draws, whatever the drafts), and a draft d is accepted with probability p(d)."""
    target, drafts, nd, first, dp = _batch(q, 2, draft=1)
    target = _seeded(target, 2)
    out = rejection_sample(target, drafts, nd, first, dp)
    keyed = target.seeded_tokens.view(N, 3)
    emitted = torch.arange(3)[None, :] < out.num_emitted[:, None]
    assert torch.equal(torch.where(emitted, out.tokens, NO_TOKEN), torch.where(emitted, keyed, NO_TOKEN))
    assert _tv(out.tokens[:, 0], P) < TV_BOUND
    second = out.tokens[out.num_emitted >= 2, 1]
    assert len(second) > 1000 and _tv(second, P) < 3 * TV_BOUND
    accepted = (out.num_accepted >= 1).float().mean().item()
    want = P[1].item() if q is None else (q * P).sum().item()  # P(draft == the keyed draw)
    assert abs(accepted - want) < 0.01


def test_seeded_requests_emit_the_same_tokens_whatever_the_drafts():
    """Drafter invariance: perfect drafts (the keyed draws themselves) are all accepted, random ones
    mostly not, and both runs emit the keyed draws, position for position."""
    k, n = 3, 4096
    target, _, nd, first, _ = _batch(None, k, draft=0)
    target = _seeded(TargetDistribution(target.greedy_tokens[:n * 4], target.sampleable[:n * 4],
                                        target.greedy[:n * 4], target.probs[:n * 4]), k)
    keyed = target.seeded_tokens.view(n, k + 1)
    perfect = rejection_sample(target, keyed[:, :k].contiguous(), nd[:n], first[:n])
    assert (perfect.num_accepted == k).all() and torch.equal(perfect.tokens, keyed)
    torch.manual_seed(1)
    random = rejection_sample(target, torch.randint(0, V, (n, k)), nd[:n], first[:n])
    emitted = torch.arange(k + 1)[None, :] < random.num_emitted[:, None]
    assert torch.equal(random.tokens[emitted], keyed[emitted]) and (random.num_accepted < k).float().mean() > 0.9


@pytest.mark.parametrize("greedy", [True, False])
def test_a_uniform_batch_verifies_as_with_explicit_rows(greedy):
    """Uniform batches (every request K drafts, the CUDA-graph layout) take a shorter path, greedy a
    path of its own: both give what the explicit rows give, unsampleable final rows included."""
    B, K = 300, 3
    g = torch.Generator().manual_seed(5)
    greedy_tokens = torch.randint(0, 3, (B * (K + 1),), generator=g)
    sampleable = torch.rand(B * (K + 1), generator=g) > 0.1
    drafts = torch.randint(0, 3, (B, K), generator=g)
    target = TargetDistribution(greedy_tokens, sampleable)
    if not greedy:
        target.greedy = torch.rand(B * (K + 1), generator=g) > 0.5
        target.probs = torch.softmax(torch.randn(B * (K + 1), V, generator=g), dim=1)
    explicit = (torch.full((B,), K), torch.arange(B) * (K + 1))
    torch.manual_seed(3)
    want = rejection_sample(target, drafts, *explicit)
    torch.manual_seed(3)
    got = rejection_sample(target, drafts)
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.num_emitted, want.num_emitted)
    assert torch.equal(got.accepted_by_position, want.accepted_by_position)
    assert (want.tokens == NO_TOKEN).any() and (want.num_accepted > 0).any()  # the cases the test is about occur


def test_the_graph_head_verifies_a_uniform_greedy_step():
    """``greedy_verify_head`` (captured in CUDA graphs) emits each sequence's greedy tokens up to its
    first wrong draft, and NO_TOKEN from an unsampleable row on."""
    from kvforge.rank.cuda_graphs import greedy_verify_head

    class Identity(torch.nn.Module):
        def compute_logits(self, hidden):
            return hidden

    q, V2 = 4, 10
    logits = torch.full((3 * q, V2), -1.0)
    argmax = [[5, 6, 7, 8], [1, 2, 3, 4], [9, 9, 9, 9]]
    for b, row in enumerate(argmax):
        for j, t in enumerate(row):
            logits[b * q + j, t] = 1.0
    logits[2 * q + 1] = float("-inf")  # sequence 2, row 1: nothing to sample
    ids = torch.tensor([[0, 5, 6, 0], [0, 1, 0, 3], [0, 9, 9, 9]]).flatten()  # own token, then 3 drafts
    out = greedy_verify_head(Identity(), logits, ids, 3, q)
    assert out[0].tolist() == [5, 6, 7, NO_TOKEN, 3]  # drafts 5, 6 accepted, then the argmax 7
    assert out[1].tolist() == [1, 2, NO_TOKEN, NO_TOKEN, 2]  # draft 1 accepted, 0 rejected: emits 2
    assert out[2].tolist() == [9, NO_TOKEN, NO_TOKEN, NO_TOKEN, 2]  # row 1 unsampleable: it ends there
