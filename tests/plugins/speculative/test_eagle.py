"""EAGLE-1 and EAGLE-3 heads (``speculative_config={"method": "eagle" | "eagle3", "model": ...}``) on tiny
random Llamas, on the CPU: greedy output identical to no speculation whatever the engine does (prefix
caching, chunking, preemption), every draft equal to the head's forward computed by hand in torch from
transformers' hidden states, and heads built to know their target accepted as they should."""
from __future__ import annotations

import pytest
import torch
from eagle_heads import build_target, perm, write_eagle1_head, write_eagle3_head

from kvforge import LLM, SamplingParams
from kvforge.spec_decode.drafter import TargetModel

K = 3


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """Saved targets and heads: a random target with random heads of both kinds, an identity target
    with heads that know it. Values: path, and the transformers target / the head's tensors."""
    root = tmp_path_factory.mktemp("eagle")
    out = {"target": str(root / "target"), "identity": str(root / "identity")}
    out["hf"] = build_target(out["target"])
    out["hf_identity"] = build_target(out["identity"], identity=True)
    for name, write, kw in [("eagle3", write_eagle3_head, {}), ("eagle", write_eagle1_head, dict(num_layers=2, fc_bias=True))]:
        out[name] = str(root / name)
        out[name + "_tensors"] = write(out[name], out["hf"].config, **kw)
    out["eagle_reproduce"] = str(root / "eagle_reproduce")
    write_eagle1_head(out["eagle_reproduce"], out["hf_identity"].config, reproduce=True)
    out["eagle3_first"] = str(root / "eagle3_first")
    write_eagle3_head(out["eagle3_first"], out["hf_identity"].config, first_draft_right=True,
                      target_model=out["hf_identity"])
    return out


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(0, 128, (20,), generator=g).tolist()  # two and a half blocks of 8, shared
    return [shared + torch.randint(0, 128, (n,), generator=g).tolist() for n in (3, 11)] + [
        torch.randint(0, 128, (n,), generator=g).tolist() for n in (4, 9, 17, 26, 33, 40)]


PROMPTS = _prompts()
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def _llm(model: str, spec: dict | None = None, **kw) -> LLM:
    kw = {"device": "cpu", "dtype": "float32", "max_model_len": 128, "block_size": 8, **kw}
    return LLM(model=model, speculative_config=spec, **kw)


def _generate(llm: LLM, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                               use_tqdm=False)]


@pytest.fixture(scope="module")
def baseline(dirs):
    return _generate(_llm(dirs["target"], num_gpu_blocks_override=64))


@pytest.mark.parametrize("method", ["eagle3", "eagle"])
def test_greedy_output_is_identical_with_caching_chunking_and_preemption(method, dirs, baseline, check_no_blocks):
    spec = {"method": method, "model": dirs[method], "num_speculative_tokens": K, "policy": "fixed"}
    # 24-token chunks, a pool too small for every prompt at once, the first two prompts sharing blocks
    llm = _llm(dirs["target"], spec, max_num_batched_tokens=24, num_gpu_blocks_override=14, enable_prefix_caching=True,
               max_model_len=96)
    assert _generate(llm) == baseline
    stats = llm.llm_engine.get_stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0, stats
    assert stats["spec_decode"]["num_draft_tokens"] > 100  # drafts were proposed and verified every step
    check_no_blocks(llm.llm_engine)


# -- the head's forward, by hand ---------------------------------------------------------------------
def _rms(x, w, eps=1e-6):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta=10000.0):  # x [T, heads, D], rotate-half RoPE
    d = x.shape[-1]
    freqs = pos[:, None].double() / theta ** (torch.arange(0, d, 2).double() / d)
    cos, sin = torch.cat([freqs, freqs], -1).cos().float(), torch.cat([freqs, freqs], -1).sin().float()
    return x * cos[:, None] + torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1) * sin[:, None]


def _attention(t, prefix, x, pos, heads=4, kv_heads=2):  # causal self-attention of the rows x [T, in]
    q, k, v = (x @ t[f"{prefix}self_attn.{n}_proj.weight"].T for n in "qkv")
    T = len(x)
    q, k, v = q.view(T, heads, -1), k.view(T, kv_heads, -1), v.view(T, kv_heads, -1)
    q, k = _rope(q, pos), _rope(k, pos)
    k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(T, -1)
    return o @ t[f"{prefix}self_attn.o_proj.weight"].T


def _mlp(t, prefix, x):
    gate, up = x @ t[f"{prefix}mlp.gate_proj.weight"].T, x @ t[f"{prefix}mlp.up_proj.weight"].T
    return (torch.nn.functional.silu(gate) * up) @ t[f"{prefix}mlp.down_proj.weight"].T


def _head_rows(method, t, hf, ids, hidden, pos):
    """The head's pre-norm outputs and target-vocabulary logits of rows (ids [T], hidden [T, ...])."""
    embed = hf.model.embed_tokens.weight[ids]
    if method == "eagle3":
        x = torch.cat([_rms(embed, t["midlayer.input_layernorm.weight"]), _rms(hidden, t["midlayer.hidden_norm.weight"])], -1)
        res = hidden + _attention(t, "midlayer.", x, pos)
        out = res + _mlp(t, "midlayer.", _rms(res, t["midlayer.post_attention_layernorm.weight"]))
        draft_logits = _rms(out, t["norm.weight"]) @ t["lm_head.weight"].T
        logits = torch.full((len(ids), hf.config.vocab_size), float("-inf"))
        logits[:, torch.arange(len(t["d2t"])) + t["d2t"]] = draft_logits
        return out, logits
    x = torch.cat([embed, hidden], -1) @ t["fc.weight"].T + t.get("fc.bias", 0)
    for i in range(sum(1 for n in t if n.endswith("o_proj.weight"))):
        normed = x if i == 0 else _rms(x, t[f"layers.{i}.input_layernorm.weight"])
        x = x + _attention(t, f"layers.{i}.", normed, pos)
        x = x + _mlp(t, f"layers.{i}.", _rms(x, t[f"layers.{i}.post_attention_layernorm.weight"]))
    return x, hf.lm_head(x)


@torch.no_grad()
def reference_drafts(method, t, hf, tokens, k):
    """The drafts of a request whose tokens are ``tokens``, with each draft's top-2 logit gap: head row p
    reads the target's state at p (three layers' for EAGLE-3, the final for EAGLE-1) and token p + 1;
    draft step j reads draft j and the head's previous output."""
    L = hf.config.num_hidden_layers
    states = hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    n = len(tokens) - 1  # rows 0 .. n - 1 (the newest token is row n - 1's next token)
    if method == "eagle3":
        hidden = torch.cat([states[i][0, :n] for i in (2, L // 2, L - 3)], -1) @ t["fc.weight"].T
    else:
        hidden = states[L][0, :n]
    ids = list(tokens[1:])
    drafts, gaps = [], []
    for _ in range(k):
        out, logits = _head_rows(method, t, hf, torch.tensor(ids), hidden, torch.arange(len(ids)))
        top = logits[-1].topk(2).values
        drafts.append(int(logits[-1].argmax()))
        gaps.append(float(top[0] - top[1]))
        ids.append(drafts[-1])
        hidden = torch.cat([hidden, out[-1:]])
    return drafts, gaps


@pytest.mark.parametrize("method", ["eagle3", "eagle"])
def test_every_draft_is_the_heads_forward_computed_by_hand(method, dirs):
    # chunked prompts (a chunk's last row reads the prompt's next token), verification steps (rows past
    # the accepted run rewritten later), and steps without drafts left in flight (async scheduling): the
    # head's KV cache must have no holes, whatever ran
    spec = {"method": method, "model": dirs[method], "num_speculative_tokens": K, "policy": "fixed"}
    llm = _llm(dirs["target"], spec, max_num_batched_tokens=16, num_gpu_blocks_override=64, async_scheduling=True,
               enable_prefix_caching=False)
    eng = llm.llm_engine
    decide, calls = eng.spec.policy.num_draft_tokens, [0]

    def every_third(ids):  # the policy drafts one step in three: the plain steps between are overlapped
        calls[0] += 1
        return decide(ids) if calls[0] % 3 == 0 else 0
    eng.spec.policy.num_draft_tokens = every_third
    records, propose = [], eng.spec.drafter.propose

    def recorded(batch):
        out = propose(batch)
        records.extend((list(r.all_token_ids), list(d)) for r, d in zip(batch.requests, out.token_ids) if d)
        return out
    eng.spec.drafter.propose = recorded
    launch, overlapped = eng.runner.launch, [0]

    def counted(out, kv, prev=None):
        overlapped[0] += prev is not None  # launched while the step before was in flight
        return launch(out, kv, prev=prev)
    eng.runner.launch = counted
    _generate(llm, PROMPTS[2:], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert overlapped[0] > 5
    compared = 0
    for tokens, drafts in records:
        want, gaps = reference_drafts(method, dirs[method + "_tensors"], dirs["hf"], tokens, len(drafts))
        for got, ref, gap in zip(drafts, want, gaps):
            if gap < 1e-3:  # a near-tie: float noise may pick either (and the chain after it)
                break
            assert got == ref, (tokens, drafts, want)
            compared += 1
    assert len(records) >= 20 and compared >= 0.9 * sum(len(d) for _, d in records), (len(records), compared)


def test_heads_that_know_the_target_are_accepted(dirs, check_no_blocks):
    # the identity target's greedy next token is perm(current); the EAGLE-1 head reproduces it (every draft
    # accepted), the EAGLE-3 head's first draft is always right (and its later ones are not)
    p = perm(128)
    prompts = PROMPTS[:4]
    chain = [[int(x) for x in _continue(p, prompt[-1], 16)] for prompt in prompts]
    for method, head, check in [("eagle", "eagle_reproduce", lambda s: s["acceptance_rate"] == 1.0),
                                ("eagle3", "eagle3_first", lambda s: s["accepted_by_position"][0] == s["num_drafts"])]:
        spec = {"method": method, "model": dirs[head], "num_speculative_tokens": K, "policy": "fixed"}
        llm = _llm(dirs["identity"], spec, num_gpu_blocks_override=64)
        assert _generate(llm, prompts) == chain
        stats = llm.llm_engine.get_stats()["spec_decode"]
        assert stats["num_drafts"] > 0 and check(stats), (method, stats)
        check_no_blocks(llm.llm_engine)


def _continue(p: torch.Tensor, token: int, n: int) -> list[int]:
    out = []
    for _ in range(n):
        token = int(p[token])
        out.append(token)
    return out


def test_sampled_drafts_come_from_the_draft_vocabulary_and_repeat_with_a_seed(dirs):
    spec = {"method": "eagle3", "model": dirs["eagle3"], "num_speculative_tokens": K, "policy": "fixed"}
    vocab = torch.arange(96) + dirs["eagle3_tensors"]["d2t"]  # the draft vocabulary, as target ids
    # (n = 2: the samples' first blocks are copied on write, in the head's cache too)
    params = SamplingParams(n=2, temperature=0.8, max_tokens=12, ignore_eos=True, seed=11)
    runs = []
    for _ in range(2):
        llm = _llm(dirs["target"], spec, num_gpu_blocks_override=64)
        probs, propose = [], llm.llm_engine.spec.drafter.propose

        def recorded(batch, propose=propose, probs=probs):
            out = propose(batch)
            probs.extend((d, q) for d, q in zip(out.token_ids, out.draft_probs or []) if d and q is not None)
            return out
        llm.llm_engine.spec.drafter.propose = recorded
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:3]], params, use_tqdm=False)
        runs.append([[list(c.token_ids) for c in o.outputs] for o in outs])
        assert probs
        for drafts, q in probs:
            assert q.shape == (len(drafts), 128)
            torch.testing.assert_close(q.sum(-1), torch.ones(len(drafts)))
            outside = torch.ones(128, dtype=torch.bool)
            outside[vocab] = False
            assert not q[:, outside].any() and all(d in set(vocab.tolist()) for d in drafts)
    assert runs[0] == runs[1]


def test_bad_eagle_configurations_are_value_errors(dirs, tmp_path):
    with pytest.raises(ValueError, match="'model'"):
        _llm(dirs["target"], {"method": "eagle3", "num_speculative_tokens": K})
    with pytest.raises(ValueError, match="no config.json"):
        _llm(dirs["target"], {"method": "eagle3", "model": str(tmp_path), "num_speculative_tokens": K})
    small = build_target(str(tmp_path / "small"), num_hidden_layers=2, hidden_size=32, head_dim=8)
    with pytest.raises(ValueError, match="width 64"):  # a head for another target
        _llm(str(tmp_path / "small"), {"method": "eagle3", "model": dirs["eagle3"], "num_speculative_tokens": K})
    write_eagle3_head(str(tmp_path / "h"), small.config)
    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids"):  # (2, 1, -1) does not fit 2 layers
        _llm(str(tmp_path / "small"), {"method": "eagle3", "model": str(tmp_path / "h"), "num_speculative_tokens": K})
    llm = _llm(dirs["target"], {"method": "eagle", "model": dirs["eagle"], "num_speculative_tokens": K},
               num_gpu_blocks_override=16)
    target = TargetModel(llm.llm_engine.runner.worker.model, llm.llm_engine.model_config, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        llm.llm_engine.spec.drafter.bind_target(target)
