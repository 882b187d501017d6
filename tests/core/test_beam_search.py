"""Beam search: blocks shared copy-on-write between beams, and the same best sequence as transformers."""
import pytest
import torch

from kvforge import LLM, BeamSearchParams


def test_beams_share_blocks_and_release_them(tiny_llm, check_no_blocks, monkeypatch):
    engine = tiny_llm.llm_engine
    prompt = list(range(200, 240))  # 40 tokens: 3 blocks
    seen = []
    real_step = engine.step

    def spy():
        out = real_step()
        live = [r for r in engine.scheduler.running if r.request_id in engine.scheduler.driven_ids]
        if len(live) == 4:
            blocks = {b for r in live for b in engine.kv_cache.block_table(r.request_id)}
            seen.append((len(blocks), sum(len(engine.kv_cache.block_table(r.request_id)) for r in live)))
        return out

    monkeypatch.setattr(engine, "step", spy)
    out = tiny_llm.beam_search([prompt], BeamSearchParams(beam_width=4, max_tokens=6, ignore_eos=True))[0]
    assert len(out.sequences) == 4
    assert all(len(s.tokens) == 46 and s.tokens[:40] == prompt for s in out.sequences)
    scores = [s.score for s in out.sequences]
    assert scores == sorted(scores, reverse=True)
    # 4 beams hold 4 x 3 block-table entries but only the 2 full prompt blocks are shared
    assert seen and all(distinct < total for distinct, total in seen)
    check_no_blocks(engine)


def test_beam_search_validation(tiny_llm):
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="max_tokens"):
        tiny_llm.beam_search([[1, 2, 3]], BeamSearchParams(beam_width=2, max_tokens=10 ** 4))


@pytest.mark.slow
def test_best_beam_matches_transformers(default_llm, hf_base, check_no_blocks):
    llm = default_llm
    tok = llm.get_tokenizer()
    prompts = ["The capital of France is", "def add(a, b):", "My favourite food is"]
    outs = llm.beam_search(prompts, BeamSearchParams(beam_width=4, max_tokens=12))
    for p, out in zip(prompts, outs):
        ids = tok(p, return_tensors="pt").input_ids
        with torch.no_grad():
            ref = hf_base.generate(ids, num_beams=4, max_new_tokens=12, do_sample=False, early_stopping=False,
                                 length_penalty=1.0, eos_token_id=2, pad_token_id=2)[0].tolist()
        best = out.sequences[0].tokens
        n = len(best)
        assert ref[:n] == best, (p, tok.decode(ref), out.sequences[0].text)
        assert all(t == 2 for t in ref[n:])  # only padding after our best sequence
    check_no_blocks(llm.llm_engine)


def test_small_pool_runs_prompts_in_groups(check_no_blocks):
    llm = LLM("dummy:tiny", device="cpu", num_gpu_blocks_override=10, max_model_len=128)
    prompts = [list(range(10, 39)), list(range(40, 70)), list(range(70, 100))]
    outs = llm.beam_search(prompts, BeamSearchParams(beam_width=3, max_tokens=12, ignore_eos=True))
    assert [len(o.sequences) for o in outs] == [3, 3, 3]
    assert all(s.tokens[:len(p)] == p for p, o in zip(prompts, outs) for s in o.sequences)
    check_no_blocks(llm.llm_engine)
    with pytest.raises(ValueError, match="beam_width"):
        llm.beam_search([list(range(100))], BeamSearchParams(beam_width=4, max_tokens=20))
