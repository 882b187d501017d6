"""Tensor-parallel layers over real torch.distributed (gloo, two processes on the CPU): a model split
over two ranks computes the logits of the unsplit model, on the default model (9 query heads over 3
KV heads: an uneven split of 2 and 1 KV heads) and on a tiny random model whose vocabulary does
not divide (padded vocabulary slices) and whose KV heads are fewer than the ranks (replicated)."""
from __future__ import annotations

import dataclasses
import queue as queue_module
import socket
import time

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from kvforge.attention import BatchLayout
from kvforge.model import quantization
from kvforge.model.config import ModelConfig
from kvforge.model.loader import load_model, load_model_config, resolve_model_source
from kvforge.plugin_manager import get_plugin_manager
from kvforge.plugins.attention.torch_backend import TorchAttentionBackend
from kvforge.rank import parallel_state
from kvforge.rank.parallel_state import HeadShard, head_shard, split

PROMPTS = [[1, 504, 3213, 314, 253, 1167, 30], [1, 9, 88, 1000, 4, 47, 12, 19, 2000, 31]]
BLOCK = 16


def test_split_is_as_even_as_possible_and_covers_everything():
    parts = [split(10, 4, r) for r in range(4)]
    assert parts == [(0, 3), (3, 3), (6, 2), (8, 2)]


def test_heads_split_by_kv_group_unevenly_or_replicated():
    # 9 query heads over 3 KV heads (the default model), 2 ranks: KV heads 2 and 1, with their queries
    assert [head_shard(9, 3, 2, r) for r in range(2)] == [HeadShard(0, 6, 0, 2), HeadShard(6, 3, 2, 1)]
    # 8 query heads over 2 KV heads, 4 ranks: each KV head on 2 ranks, which split its 4 queries
    assert [head_shard(8, 2, 4, r) for r in range(4)] == [
        HeadShard(0, 2, 0, 1), HeadShard(2, 2, 0, 1), HeadShard(4, 2, 1, 1), HeadShard(6, 2, 1, 1)]
    with pytest.raises(ValueError, match="tensor_parallel_size=4 cannot split 6 query heads over 2 KV heads"):
        head_shard(6, 2, 4, 0)


def _layout(lens: list[int]) -> BatchLayout:
    qsl = np.zeros(len(lens) + 1, dtype=np.int32)
    np.cumsum(lens, out=qsl[1:])
    per = -(-max(lens) // BLOCK)
    tables = np.arange(len(lens) * per, dtype=np.int32).reshape(len(lens), per)
    slots = np.concatenate([tables[i, np.arange(n) // BLOCK].astype(np.int64) * BLOCK + np.arange(n) % BLOCK
                            for i, n in enumerate(lens)])
    return BatchLayout(qsl, np.array(lens, dtype=np.int32), tables, slots)


def _logits(model_arg: str | None, overrides: dict, rank: int, size: int, group=None) -> torch.Tensor:
    """Logits of every prompt position, for the model built as rank ``rank`` of ``size``."""
    src = resolve_model_source(model_arg, "auto")
    mc: ModelConfig = dataclasses.replace(load_model_config(src), **overrides)
    shard = head_shard(mc.num_attention_heads, mc.num_key_value_heads, size, rank)
    attn = TorchAttentionBackend(num_heads=shard.num_heads, num_kv_heads=shard.num_kv_heads, head_size=mc.head_dim,
                                 scale=mc.head_dim ** -0.5, block_size=BLOCK, dtype=torch.float32, device="cpu")
    pm = get_plugin_manager()
    quant = quantization.resolve(quantization.registered(pm), None, mc)  # a pre-quantized checkpoint's
    method = pm.get("quantization_method", quant)(model_config=mc) if quant else None
    with parallel_state.building(parallel_state.TPGroup(rank, size, group)):
        model = load_model(src, mc, attn, torch.float32, "cpu", seed=0, quant=method)
    layout = _layout([len(p) for p in PROMPTS])
    caches = attn.allocate_kv_cache(int(layout.block_tables.size), mc.num_hidden_layers)
    ids = torch.tensor([t for p in PROMPTS for t in p]) % mc.vocab_size
    pos = torch.tensor([i for p in PROMPTS for i in range(len(p))])
    with torch.inference_mode():
        hidden = model(ids, pos, caches, attn.build_metadata(layout))
        return model.compute_logits(hidden)


def _rank_main(rank: int, size: int, port: int, model_arg, overrides, queue) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    try:
        logits = _logits(model_arg, overrides, rank, size, torch.distributed.group.WORLD)
        queue.put((rank, logits.numpy()))
    finally:
        torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _split_logits(model_arg, overrides, size: int) -> list[np.ndarray]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, size, port, model_arg, overrides, queue)) for r in range(size)]
    for p in procs:
        p.start()
    got: dict[int, np.ndarray] = {}
    try:
        deadline = time.monotonic() + 240
        while len(got) < size:  # fail fast when a rank dies
            try:
                rank, logits = queue.get(timeout=1)
                got[rank] = logits
            except queue_module.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                assert not dead and time.monotonic() < deadline, f"ranks {dead} failed (or timed out)"
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs)
    return [got[r] for r in range(size)]


@pytest.mark.parametrize("model_arg, overrides", [
    (None, {}),  # the default model: 9 query heads over 3 KV heads, 2 ranks keep 2 and 1 KV heads
    ("dummy:tiny", {"vocab_size": 1001, "num_attention_heads": 4, "num_key_value_heads": 1}),
], ids=["default-model-uneven-heads", "tiny-padded-vocab-replicated-kv"])
def test_two_ranks_compute_the_unsplit_models_logits(model_arg, overrides):
    whole = _logits(model_arg, overrides, 0, 1).numpy()
    for logits in _split_logits(model_arg, overrides, 2):  # every rank gets the whole vocabulary
        assert logits.shape == whole.shape
        np.testing.assert_allclose(logits, whole, rtol=1e-4, atol=1e-4)
        assert (logits.argmax(-1) == whole.argmax(-1)).all()


@pytest.mark.parametrize("fmt", ["gptq", "awq"])
def test_two_ranks_split_a_pre_quantized_checkpoint_as_the_unsplit_model(fmt, tmp_path):
    """INT4 tensors packed along the inputs (GPTQ's qweight) or the outputs (AWQ's), with per-group
    scales and zero points, split over two ranks: 9 query heads give rank 0 inputs 0:384 of o_proj,
    six groups of 64 (the checkpoint's group size), so every rank's slice holds whole groups."""
    from quantized_checkpoints import write_checkpoint

    path = write_checkpoint(str(tmp_path / fmt), fmt, group=64)
    whole = _logits(path, {}, 0, 1).numpy()
    for logits in _split_logits(path, {}, 2):
        np.testing.assert_allclose(logits, whole, rtol=1e-4, atol=1e-4)
