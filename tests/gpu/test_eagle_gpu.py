"""EAGLE heads on CUDA with the triton backend: the target's decode and verification graphs write the
captured hidden states, the head's fill replays its graph of the same (size, q) and its decode steps
their own, and the drafts are the ones the eager head computes; greedy output (float32, so that kernels
summing in another order cannot flip a near tie) is the output without speculation."""
import pytest
import torch
from eagle_heads import build_target, perm, write_eagle1_head, write_eagle3_head

from kvforge import LLM, SamplingParams

pytestmark = pytest.mark.gpu
K = 3


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle-gpu")
    out = {"target": str(root / "t"), "identity": str(root / "i"), "eagle3": str(root / "h3"),
           "eagle": str(root / "h1")}
    hf = build_target(out["target"])
    write_eagle3_head(out["eagle3"], hf.config)
    hf_identity = build_target(out["identity"], identity=True)
    write_eagle1_head(out["eagle"], hf_identity.config, reproduce=True)
    return out


def _prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 128, (n,), generator=g).tolist() for n in (5, 9, 17, 24, 31, 40, 47, 60)]


def _run(model, spec=None, records=None, **kw):
    """(the engine, its greedy outputs); ``records`` gets every proposal: (the request's tokens, its drafts)."""
    llm = LLM(model=model, device="cuda", dtype="float32", attention_backend="triton", gpu_memory_utilization=0.2,
              max_model_len=256, max_num_seqs=16, speculative_config=spec, **kw)
    if records is not None:
        propose = llm.llm_engine.drafter.propose

        def recorded(batch):
            out = propose(batch)
            records.extend((tuple(r.all_token_ids), tuple(d)) for r, d in zip(batch.requests, out.token_ids) if d)
            return out
        llm.llm_engine.drafter.propose = recorded
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()],
                        SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    return llm, [list(o.outputs[0].token_ids) for o in outs]


def test_eagle3_on_cuda_graphs_gives_the_greedy_output_and_the_eager_drafts(dirs, check_no_blocks):
    plain = _run(dirs["target"])[1]
    spec = {"method": "eagle3", "model": dirs["eagle3"], "num_speculative_tokens": K, "policy": "fixed"}
    drafts: dict[bool, list] = {}
    for eager in (False, True):
        drafts[eager] = []
        llm, tokens = _run(dirs["target"], {**spec, "enforce_eager": eager}, records=drafts[eager])
        assert tokens == plain
        d = llm.llm_engine.drafter
        if not eager:  # the fill replayed its graphs (decode and 1 + k verification) and the decode steps theirs
            assert d.fill_graphs is not None and d.graphs is not None
            assert any(q == 1 + K and n > 0 for (_, q), n in d.fill_graphs.replays.items()), d.fill_graphs.replays
            assert sum(d.graphs.replays.values()) > 0
            assert llm.llm_engine.runner.num_graph_verifications > 0
        else:
            assert d.fill_graphs is None and d.graphs is None
        check_no_blocks(llm.llm_engine)
    # the same proposals whether the head ran in graphs or eagerly (the same outputs: the same requests'
    # tokens at each proposal); a random head's near ties may flip a few drafts between kernels
    graphed, eager_ = dict(drafts[False]), dict(drafts[True])
    assert len(graphed) > 50 and graphed.keys() == eager_.keys()
    same = sum(graphed[key] == eager_[key] for key in graphed)
    assert same >= 0.95 * len(graphed), (same, len(graphed))


def test_an_eagle1_head_that_reproduces_its_target_is_always_accepted_on_cuda(dirs, check_no_blocks):
    llm, tokens = _run(dirs["identity"], {"method": "eagle", "model": dirs["eagle"], "num_speculative_tokens": K,
                                          "policy": "fixed"})
    p = perm(128)
    for prompt, out in zip(_prompts(), tokens):
        want, token = [], prompt[-1]
        for _ in range(len(out)):
            token = int(p[token])
            want.append(token)
        assert out == want
    assert llm.llm_engine.get_stats()["spec_decode"]["acceptance_rate"] == 1.0
    check_no_blocks(llm.llm_engine)
