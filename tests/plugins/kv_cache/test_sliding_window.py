"""Sliding windows in the KV manager: blocks wholly behind every layer's window are given back while the
request runs (NULL_BLOCK in its table), so a long sequence holds a bounded number of blocks, and the
output stays exactly transformers' (the freed blocks were never read again)."""
import pytest
import torch

from kvforge import LLM, SamplingParams
from kvforge.attention import AttentionCapabilities
from kvforge.builder import select_attention_backend
from kvforge.kv_cache import NULL_BLOCK
from kvforge.plugin_manager import get_plugin_manager
from kvforge.plugins.attention.torch_backend import TorchAttentionBackend
from kvforge.plugins.kv_cache.paged import PagedKVCacheManager
from kvforge.request import Request
from kvforge.sampling_params import SamplingParams as SP
from model_architectures import WINDOW, build


def req(rid, tokens):
    return Request(rid, list(tokens), SP())


def grow(kv, r, n_steps):
    """Decode n_steps tokens one at a time (what the scheduler + update do)."""
    for t in range(n_steps):
        r.output_token_ids.append(t % 50)
        assert kv.allocate_slots(r, 1)
        r.num_computed_tokens += 1


def test_blocks_behind_the_window_are_given_back():
    kv = PagedKVCacheManager(num_blocks=16, block_size=4, sliding_window=6)
    r = req("a", range(10))
    assert kv.allocate_slots(r, 10)
    r.num_computed_tokens = 10
    grow(kv, r, 1)  # the 11th token (position 10) sees positions 5..10: block 0 (0..3) is behind
    table = kv.block_table("a")
    assert table[0] == NULL_BLOCK and NULL_BLOCK not in table[1:]
    grow(kv, r, 40)
    table = kv.block_table("a")
    live = [b for b in table if b != NULL_BLOCK]
    # positions num_computed - 6 + 1 .. num_computed - 1 plus the new token: at most 3 blocks of 4
    assert len(live) <= 3 and kv.stats().num_used_blocks == len(live)
    kv.free("a")
    assert kv.stats().num_used_blocks == 0 and kv.stats().num_free_blocks == 16


def test_freed_blocks_stay_in_the_prefix_cache_and_fork_and_swap_skip_them():
    kv = PagedKVCacheManager(num_blocks=16, block_size=4, sliding_window=5, num_cpu_blocks=8)
    r = req("a", range(12))
    assert kv.allocate_slots(r, 12)
    r.num_computed_tokens = 12
    first = kv.block_table("a")[0]
    grow(kv, r, 6)
    assert kv.block_table("a")[0] == NULL_BLOCK
    assert kv.ref_count(first) == 0 and first in kv.cached.values()  # given back, still a cached prefix
    kv.fork("a", "b")
    assert kv.block_table("b")[0] == NULL_BLOCK
    kv.free("b")
    copies = kv.swap_out("a")
    assert all(d != NULL_BLOCK for d, _ in copies)
    assert len(copies) == len([b for b in kv.tables.get("a", kv.cpu_tables["a"]) if b != NULL_BLOCK])
    back = kv.swap_in("a")
    assert len(back) == len(copies) and kv.block_table("a")[0] == NULL_BLOCK
    kv.free("a")
    s = kv.stats()
    assert s.num_used_blocks == 0 and s.num_free_cpu_blocks == 8


def test_without_a_window_nothing_is_given_back():
    kv = PagedKVCacheManager(num_blocks=32, block_size=4)
    r = req("a", range(10))
    assert kv.allocate_slots(r, 10)
    r.num_computed_tokens = 10
    grow(kv, r, 30)
    assert NULL_BLOCK not in kv.block_table("a") and len(kv.block_table("a")) == 10


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("mistral"))
    return path, build("mistral-window", path)


def test_a_sliding_window_model_decoding_far_past_its_window_holds_bounded_blocks(mistral_dir, check_no_blocks):
    path, hf = mistral_dir
    llm = LLM(model=path, device="cpu", dtype="float32", block_size=16, num_gpu_blocks_override=64)
    engine = llm.llm_engine
    assert engine.kv_cache.sliding_window == WINDOW
    prompt, n = list(range(3, 13)), 200  # 210 tokens: 14 blocks without freeing
    engine.add_request("long", prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    peak, out = 0, None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
        peak = max(peak, engine.kv_cache.stats().num_used_blocks)
    assert peak <= -(-WINDOW // 16) + 2, peak  # the window's blocks, the one being filled, one spare
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    assert out.outputs[0].token_ids == ids[len(prompt):]
    check_no_blocks(engine)


def test_a_backend_without_sliding_windows_is_refused_for_a_windowed_model():
    class NoWindow(TorchAttentionBackend):
        name = "no_window"
        capabilities = AttentionCapabilities(devices=("cpu",), dtypes=(torch.float32,))

    pm = get_plugin_manager()
    pm.registries["attention_backend"].add("no_window", NoWindow, "test")
    try:
        with pytest.raises(ValueError, match="no_window.*no sliding window support"):
            select_attention_backend(pm, "no_window", device=torch.device("cpu"), dtype=torch.float32,
                                     head_size=16, block_size=16, features=frozenset({"sliding_window"}))
        assert select_attention_backend(pm, "auto", device=torch.device("cpu"), dtype=torch.float32, head_size=16,
                                        block_size=16, features=frozenset({"sliding_window"}))[0] == "torch"
    finally:
        pm.registries["attention_backend"]._entries.pop("no_window")


def test_a_draft_model_sharing_the_block_ids_keeps_every_block(mistral_dir):
    """The draft model's catch-up reads positions of its own, which may lie behind the window."""
    path, _ = mistral_dir
    llm = LLM(model=path, device="cpu", dtype="float32", block_size=16, num_gpu_blocks_override=64,
              speculative_config={"method": "draft_model", "model": path, "num_speculative_tokens": 2})
    assert llm.llm_engine.kv_cache.sliding_window is None
