"""The speculation policy (docs/speculative.md#the-policy): drafts only where they pay."""
from kvforge.speculative import SpeculationPolicy


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
    assert _policy(acceptance=0.05).num_draft_tokens(["a"]) == 0


def test_rejections_and_empty_proposals_turn_a_request_off_and_release_forgets_it():
    p = _policy()
    for _ in range(20):
        p.observe("bad", drafted=4, accepted=0)
    assert p.num_draft_tokens(["bad"]) == 0
    p.release(["bad"])
    assert "bad" not in p.per_request


def test_an_estimate_drifts_back_while_off_so_drafting_is_tried_again():
    p = _policy()
    for _ in range(20):
        p.observe("r", drafted=4, accepted=0)
    steps = 0
    while p.num_draft_tokens(["r"]) == 0 and steps < 1000:
        steps += 1
    assert 0 < steps < 1000


def test_measured_step_rates_overrule_the_model():
    p = _policy(explore_every=1000)
    ids = _ids(64)
    for _ in range(5):  # drafting measured slower in this bucket (as when it costs async overlap)
        p.record_step(64, True, tokens=100, seconds=0.02)
        p.record_step(64, False, tokens=64, seconds=0.006)
    for _ in range(4):  # (the first decisions of a bucket explore)
        p.num_draft_tokens(ids)
    assert p.model_choice(ids) > 0 and p.num_draft_tokens(ids) == 0
    q = _policy(explore_every=1000)
    for _ in range(5):
        q.record_step(64, True, tokens=150, seconds=0.01)
        q.record_step(64, False, tokens=64, seconds=0.006)
    for _ in range(4):
        q.num_draft_tokens(ids)
    assert q.num_draft_tokens(ids) > 0


def test_the_other_mode_is_explored_now_and_then():
    p = _policy(explore_every=16, explore_steps=2)
    modes = [p.num_draft_tokens(["a"]) > 0 for _ in range(64)]
    assert modes.count(False) == 8 and modes.count(True) == 56  # 2 of every 16 decisions run plain
