import torch

from kvforge.plugins.sampling.default import DefaultSampler, apply_top_k_top_p
from kvforge.request import Request
from kvforge.sampling_params import SamplingParams


def reqs(*params):
    return [Request(str(i), [1], p) for i, p in enumerate(params)]


def sampler(vocab=10):
    return DefaultSampler(vocab_size=vocab, device=torch.device("cpu"))


def test_greedy_is_argmax():
    s = sampler()
    logits = torch.randn(3, 10)
    toks = s.sample(logits, s.prepare(reqs(*[SamplingParams(temperature=0)] * 3)))
    assert toks.tolist() == logits.argmax(-1).tolist()


def test_top_k_top_p_reference():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    top_k = torch.tensor([5, 50, 1, 10])
    top_p = torch.tensor([1.0, 0.5, 1.0, 0.3])
    masked = apply_top_k_top_p(logits, top_k, top_p)
    for row in range(4):
        kept = set(torch.nonzero(masked[row] > float("-inf")).flatten().tolist())
        order = logits[row].argsort(descending=True).tolist()
        ref = order[: int(top_k[row])]
        probs = torch.softmax(logits[row, ref], -1)
        cum, keep = 0.0, []
        for tok, p in zip(ref, probs.tolist()):
            if cum >= top_p[row]:
                break
            keep.append(tok)
            cum += p
        assert kept == set(keep)


def test_min_p_and_top_k_one_make_sampling_deterministic():
    s = sampler()
    logits = torch.tensor([[0.0, 5.0, 1.0, 4.9] + [-10.0] * 6])
    for params in (SamplingParams(top_k=1), SamplingParams(min_p=0.99)):
        for _ in range(20):
            assert s.sample(logits, s.prepare(reqs(params))).item() == 1


def test_sampling_follows_the_distribution():
    s = sampler(4)
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    logits = probs.log().expand(20000, 4).contiguous()
    toks = s.sample(logits, s.prepare(reqs(*[SamplingParams(temperature=1.0)] * 20000)))
    freq = torch.bincount(toks, minlength=4).float() / 20000
    assert torch.allclose(freq, probs, atol=0.02)


def test_seeded_rows_do_not_depend_on_the_batch():
    logits = torch.randn(1, 10).expand(3, 10).contiguous()

    def draw(batch_params, row, steps=5):
        s = sampler()
        rs = reqs(*batch_params)
        return [s.sample(logits[: len(rs)], s.prepare(rs))[row].item() for _ in range(steps)]

    alone = draw([SamplingParams(seed=123)], 0)
    mixed = draw([SamplingParams(temperature=0), SamplingParams(), SamplingParams(seed=123)], 2)
    assert alone == mixed
    assert draw([SamplingParams(seed=7)], 0, steps=20) != draw([SamplingParams(seed=8)], 0, steps=20)
