"""The speculation policy (docs/speculative.md#the-policy): drafts only where they pay."""
from kvforge.spec_decode.policy import SpeculationPolicy


def _policy(mode="auto", acceptance=0.9, **kw):
    return SpeculationPolicy(4, mode, knee_tokens=256, initial_acceptance=acceptance, **kw)


def _ids(n):
    return [str(i) for i in range(n)]


def test_fixed_always_asks_for_k():
    p = _policy("fixed", acceptance=0.01)
    assert p.num_draft_tokens(_ids(512)) == 4 and p.num_draft_tokens([]) == 0


def test_the_model_drafts_fully_under_the_knee_lowers_k_then_stops_past_it():
    p = _policy()
    assert p.model_choice(["a"]) == 4
    assert p.model_choice(_ids(32)) == 4  # 32 x 5 = 160 query tokens: under the knee
    assert 0 < p.model_choice(_ids(96)) < 4
    assert p.model_choice(_ids(256)) == 0


def test_low_acceptance_switches_speculation_off():
    assert _policy(acceptance=0.01).num_draft_tokens(["a"]) == 0


def test_acceptance_is_estimated_per_position_from_truncated_runs():
    """Runs of k = 8 drafts, each accepted with probability 0.75 until the first rejection: the
    estimate is the per-position 0.75 (not the 0.34 of drafts accepted), so E(8) is about 3.7."""
    import random
    rng = random.Random(0)
    p = SpeculationPolicy(8, "auto", knee_tokens=256, smoothing=0.01)
    for _ in range(3000):
        accepted = 0
        while accepted < 8 and rng.random() < 0.75:
            accepted += 1
        p.observe("r", 8, accepted)
    assert abs(p.acceptance("r") - 0.75) < 0.05
    assert 3.3 < p.expected_tokens(["r"], 8) < 4.1
    p.observe("new", 0, 0)  # a drafter that proposed nothing: a rejection
    assert p.acceptance("new") < p.acceptance("r")


def test_rejections_and_empty_proposals_turn_a_request_off_and_release_forgets_it():
    p = _policy()
    for _ in range(20):
        p.observe("bad", proposed=4, accepted=0)
    assert p.num_draft_tokens(["bad"]) == 0
    p.release(["bad"])
    assert "bad" not in p.per_request


def test_an_estimate_drifts_back_while_off_so_drafting_is_tried_again():
    p = _policy()
    for _ in range(20):
        p.observe("r", proposed=4, accepted=0)
    steps = 0
    while p.num_draft_tokens(["r"]) == 0 and steps < 1000:
        steps += 1
    assert 0 < steps < 1000


def _time(p, batch, drafting_s, plain_s, n=5):
    for _ in range(n):  # interleaved: as when drafting comes and goes every other step
        p.record_step(batch, True, drafting_s)
        p.record_step(batch, False, plain_s)


def test_measured_step_times_overrule_the_model():
    ids = _ids(64)  # alpha 0.9: the model drafts 3 each, about 220 tokens a step against 64
    p = _policy(explore_every=1000)
    _time(p, 64, drafting_s=0.03, plain_s=0.006)  # drafting measured 5x slower: 7.3k tokens/s < 10.7k
    for _ in range(4):  # (the first decisions of a bucket explore)
        p.num_draft_tokens(ids)
    assert p.model_choice(ids) > 0 and p.num_draft_tokens(ids) == 0
    q = _policy(explore_every=1000)
    _time(q, 64, drafting_s=0.01, plain_s=0.006)  # 22k tokens/s > 10.7k
    for _ in range(4):
        q.num_draft_tokens(ids)
    assert q.num_draft_tokens(ids) > 0


def test_the_other_mode_is_explored_now_and_then():
    p = _policy(explore_every=16, explore_steps=2)
    modes = [p.num_draft_tokens(["a"]) > 0 for _ in range(64)]
    assert modes.count(False) == 8 and modes.count(True) == 56  # 2 of every 16 decisions run plain
