"""LoRA adapters on the real default model: kvforge's greedy tokens equal transformers + peft's, token for
token, with three adapters and the base model mixed in one batch; adapters never share prefix-cache blocks;
the max_loras budget and the host cache hold; bad adapters are ValueErrors that cost nothing else."""
from __future__ import annotations

import json
import os

import pytest

from kvforge import LLM, LoRARequest, SamplingParams
from lora_adapters import SPECS, AdapterSpec, greedy, make_adapter, peft_model

MAX_TOKENS = 10
TEXTS = ["The capital of France is", "SELECT name FROM users WHERE", "def fibonacci(n):", "Once upon a time, in a",
         "The three primary colours are", "import numpy as np\n", "Dear Sir or Madam,", "2 + 2 ="]
#: which adapter (index into SPECS, None: the base model) each of the batch's prompts runs under
ASSIGN = [0, 1, None, 2, 1, 0, 2, None, 0, 1]


@pytest.fixture(scope="module")
def adapters(hf_base, tmp_path_factory):
    out = tmp_path_factory.mktemp("loras")
    return [LoRARequest(s.name, i + 1, make_adapter(hf_base, str(out), s)) for i, s in enumerate(SPECS)]


@pytest.fixture(scope="module")
def llm():
    return LLM(None, device="cpu", enable_lora=True, max_loras=3, max_lora_rank=16, max_model_len=256,
               max_num_batched_tokens=48, **SMALL_POOL)  # a small budget: prompts are chunked


@pytest.fixture(scope="module")
def prompt_ids(llm):
    tok = llm.get_tokenizer()
    return [tok.encode(t) for t in TEXTS]


class References(dict):
    """transformers + peft greedy tokens, computed on first use: ``refs[k, i]`` for adapter index k (None: the
    base model) on prompt i of TEXTS. Each adapter's peft model is built once (a copy of the base model)."""

    def __init__(self, hf_base, adapters, prompt_ids):
        super().__init__()
        self.hf_base, self.adapters, self.prompt_ids = hf_base, adapters, prompt_ids
        self.models: dict[int | None, object] = {}

    def __missing__(self, key):
        k, i = key
        if k not in self.models:
            self.models[k] = peft_model(self.hf_base, None if k is None else self.adapters[k].lora_path)
        self[key] = greedy(self.models[k], [self.prompt_ids[i]], MAX_TOKENS)[0]
        return self[key]


@pytest.fixture(scope="module")
def references(hf_base, adapters, prompt_ids):
    return References(hf_base, adapters, prompt_ids)


#: a KV pool of 8,192 tokens (the CPU default would size one for 256 sequences at full length: gigabytes)
SMALL_POOL = {"num_gpu_blocks_override": 512}
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def _prompts(prompt_ids, n):
    return [{"prompt_token_ids": prompt_ids[i % len(prompt_ids)]} for i in range(n)]


def test_mixed_adapters_and_base_in_one_batch_match_peft_token_for_token(llm, adapters, prompt_ids, references,
                                                                         check_no_blocks):
    loras = [None if k is None else adapters[k] for k in ASSIGN]
    outs = llm.generate(_prompts(prompt_ids, len(ASSIGN)), GREEDY, lora_request=loras, use_tqdm=False)
    for i, (k, out) in enumerate(zip(ASSIGN, outs)):
        assert list(out.outputs[0].token_ids) == references[k, i % len(TEXTS)], (i, k)
    for k in (0, 1, 2):  # every adapter changes what the model says
        prompts = {i % len(TEXTS) for i, a in enumerate(ASSIGN) if a == k}
        assert any(references[k, i] != references[None, i] for i in prompts), SPECS[k].name
    check_no_blocks(llm.llm_engine)


def test_same_prompt_under_two_adapters_gets_no_prefix_cache_hit(llm, adapters, prompt_ids, references):
    prompt = {"prompt_token_ids": sum(prompt_ids, [])}  # two full blocks and more
    first = llm.generate(prompt, GREEDY, lora_request=adapters[0], use_tqdm=False)[0]
    other = llm.generate(prompt, GREEDY, lora_request=adapters[1], use_tqdm=False)[0]
    base = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    again = llm.generate(prompt, GREEDY, lora_request=adapters[0], use_tqdm=False)[0]
    base_again = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert other.num_cached_tokens == 0 and base.num_cached_tokens == 0
    # the same adapter hits its own blocks, exactly as the base model hits its own
    assert again.num_cached_tokens == base_again.num_cached_tokens > 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert other.outputs[0].token_ids != first.outputs[0].token_ids


def test_max_loras_budgets_distinct_adapters_per_step(adapters, prompt_ids, references):
    llm = LLM(None, device="cpu", enable_lora=True, max_loras=1, max_cpu_loras=3, max_model_len=256, **SMALL_POOL)
    engine = llm.llm_engine
    seen: list[set[int]] = []
    schedule = engine.scheduler.schedule

    def recording():
        out = schedule()
        seen.append({r.lora_int_id for r in out.scheduled} - {0})
        return out

    engine.scheduler.schedule = recording
    loras = [None if k is None else adapters[k] for k in ASSIGN]
    outs = llm.generate(_prompts(prompt_ids, len(ASSIGN)), GREEDY, lora_request=loras, use_tqdm=False)
    assert max(len(s) for s in seen) == 1 and len(set().union(*seen)) == 3
    for i, (k, out) in enumerate(zip(ASSIGN, outs)):
        assert list(out.outputs[0].token_ids) == references[k, i % len(TEXTS)], (i, k)


def test_host_cache_gives_back_the_least_recently_used_adapter(adapters, prompt_ids, references):
    llm = LLM(None, device="cpu", enable_lora=True, max_loras=1, max_cpu_loras=1, max_model_len=256, **SMALL_POOL)
    for k in (0, 1, 0, 2):
        out = llm.generate({"prompt_token_ids": prompt_ids[k]}, GREEDY, lora_request=adapters[k], use_tqdm=False)[0]
        assert list(out.outputs[0].token_ids) == references[k, k]
        assert [r.lora_int_id for r in llm.list_loras()] == [adapters[k].lora_int_id]
        worker = llm.llm_engine.executor.driver
        assert worker.lora.list() == [adapters[k].lora_int_id]
    assert llm.remove_lora(adapters[2].lora_int_id) and llm.list_loras() == []


def test_bad_adapters_are_value_errors_and_cost_nothing_else(llm, adapters, prompt_ids, references, tmp_path,
                                                             hf_base, check_no_blocks):
    bad_rank = make_adapter(hf_base, str(tmp_path), AdapterSpec("big", 32, 16, ("q_proj",)))
    with pytest.raises(ValueError, match="max_lora_rank=16"):
        llm.generate("hi", GREEDY, lora_request=LoRARequest("big", 50, bad_rank), use_tqdm=False)
    with pytest.raises(ValueError, match="lora_path"):
        llm.generate("hi", GREEDY, lora_request=LoRARequest("gone", 51, str(tmp_path / "nowhere")), use_tqdm=False)
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("zero", 0, adapters[0].lora_path)
    with pytest.raises(ValueError, match="lora_int_id: 1 is already adapter"):
        llm.add_lora(LoRARequest("other", adapters[0].lora_int_id, adapters[1].lora_path))
    # shapes that do not fit the model: an adapter whose lora_B has the wrong number of rows
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    from safetensors.torch import load_file, save_file
    tensors = load_file(os.path.join(adapters[0].lora_path, "adapter_model.safetensors"))
    key = next(k for k in tensors if k.endswith("q_proj.lora_B.weight"))
    tensors[key] = tensors[key][:-3]
    save_file(tensors, str(wrong / "adapter_model.safetensors"))
    cfg = json.load(open(os.path.join(adapters[0].lora_path, "adapter_config.json")))
    (wrong / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="do not fit the layer"):
        llm.add_lora(LoRARequest("wrong", 52, str(wrong)))
    cfg["use_dora"] = True
    (wrong / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="use_dora"):
        llm.add_lora(LoRARequest("dora", 53, str(wrong)))
    assert 52 not in {r.lora_int_id for r in llm.list_loras()}
    # nothing else was harmed: the next batch is still exact
    loras = [None if k is None else adapters[k] for k in ASSIGN[:4]]
    outs = llm.generate(_prompts(prompt_ids, 4), GREEDY, lora_request=loras, use_tqdm=False)
    for i, (k, out) in enumerate(zip(ASSIGN, outs)):
        assert list(out.outputs[0].token_ids) == references[k, i]
    check_no_blocks(llm.llm_engine)


def test_lora_request_without_enable_lora_is_refused(tiny_llm, adapters):
    with pytest.raises(ValueError, match="enable_lora"):
        tiny_llm.generate("hi", GREEDY, lora_request=adapters[0], use_tqdm=False)
    with pytest.raises(ValueError, match="lora_request: expected kvforge.LoRARequest"):
        LLM(None, device="cpu", enable_lora=True, max_model_len=64, **SMALL_POOL).generate(
            "hi", GREEDY, lora_request="sql", use_tqdm=False)


def test_removing_an_adapter_in_use_frees_its_name_and_its_requests_finish_with_it(llm, adapters, prompt_ids,
                                                                                   references, check_no_blocks):
    engine, worker = llm.llm_engine, llm.llm_engine.executor.driver
    old = LoRARequest("renamed", 60, adapters[2].lora_path)
    engine.add_request("under-old", {"prompt_token_ids": prompt_ids[3]}, GREEDY, lora_request=old)
    engine.step()  # the request runs under adapter 60
    assert engine.remove_lora(60) and 60 not in {r.lora_int_id for r in engine.list_loras()}
    assert not engine.remove_lora(60)  # already removed
    new = LoRARequest("renamed", 61, adapters[0].lora_path)
    assert engine.add_lora(new)  # the name is free at once (it was: 'renamed' is already adapter id 60)
    assert {60, 61} <= set(worker.lora.list())  # 60 stays on the rank while its request runs
    engine.add_request("under-new", {"prompt_token_ids": prompt_ids[0]}, GREEDY, lora_request=new)
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert list(finished["under-old"].outputs[0].token_ids) == references[2, 3]  # shared with the mixed batch test
    assert list(finished["under-new"].outputs[0].token_ids) == references[0, 0]
    assert 60 not in worker.lora.list() and 61 in worker.lora.list()  # unregistered once its request ended
    assert engine.remove_lora(61) and 61 not in worker.lora.list()
    check_no_blocks(engine)
