"""The worker's parts by job (``kvforge.rank``: kv_sizing, parallel_state.init_world, stage_forward,
profiler) and the ``draft_model`` drafter built from the same pieces (docs/model_runner.md#the-worker-by-job)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvforge import LLM, SamplingParams
from kvforge.rank import batch_layout, kv_sizing
from kvforge.rank.parallel_state import SINGLE, PPStage, RankGroups, TPGroup, init_world
from kvforge.rank.stage_forward import driver_tokens
from kvforge.rank.step_input import StepInput

CPU = torch.device("cpu")


def _want(**kw) -> kv_sizing.KVCacheRequest:
    base = dict(num_blocks_override=None, kv_cache_memory_gib=None, gpu_memory_utilization=0.9,
                max_num_batched_tokens=256, max_num_seqs=4, max_model_len=100)
    return kv_sizing.KVCacheRequest(**{**base, **kw})


def _no_profile() -> int:
    raise AssertionError("the CPU rules never profile")


def test_kv_sizing_takes_the_first_rule_that_applies_on_the_cpu():
    per_block = 1 << 20
    assert kv_sizing.num_kv_blocks(_want(num_blocks_override=7, kv_cache_memory_gib=1.0), per_block, 16, CPU,
                                   None, _no_profile, 0) == 7
    assert kv_sizing.num_kv_blocks(_want(kv_cache_memory_gib=0.5), per_block, 16, CPU, None, _no_profile, 0) == 512
    assert kv_sizing.num_kv_blocks(_want(kv_cache_memory_gib=1e-9), per_block, 16, CPU, None, _no_profile, 0) == 1
    # every sequence at full length: 4 x ceil(100 / 16) blocks, then capped at 4 GiB
    assert kv_sizing.num_kv_blocks(_want(), per_block, 16, CPU, None, _no_profile, 0) == 28
    assert kv_sizing.num_kv_blocks(_want(max_num_seqs=10**6), per_block, 16, CPU, None, _no_profile, 0) == 4096


def test_one_rank_joins_no_process_group():
    groups = init_world(0, CPU, tensor_parallel_size=1, pipeline_parallel_size=1, init_method=None, timeout_s=1.0)
    assert (groups.tp, groups.world, groups.stage, groups.driver_rank, groups.is_driver) == (
        SINGLE, SINGLE, PPStage(0, 1), 0, True)


def test_several_ranks_need_a_rendezvous_address():
    with pytest.raises(ValueError, match="init_method: 4 ranks need a rendezvous address"):
        init_world(3, CPU, tensor_parallel_size=2, pipeline_parallel_size=2, init_method=None, timeout_s=1.0)


def test_one_rank_fills_placeholders_with_its_own_tokens():
    groups = init_world(0, CPU, tensor_parallel_size=1, pipeline_parallel_size=1, init_method=None, timeout_s=1.0)
    tokens = torch.tensor([4, 5])
    assert driver_tokens(groups, 2, tokens, CPU) is tokens
    with pytest.raises(RuntimeError, match="no tokens of the step in flight"):
        driver_tokens(groups, 2, None, CPU)


@pytest.fixture(scope="module")
def drafting():
    return LLM("dummy:tiny", device="cpu", max_model_len=128, num_gpu_blocks_override=64,
               speculative_config={"method": "draft_model", "model": "dummy:tiny", "num_speculative_tokens": 3,
                                   "policy": "fixed"})


def test_the_draft_model_is_built_and_sized_as_the_worker_builds_its_model(drafting):
    worker = drafting.llm_engine.executor.driver
    drafter = drafting.llm_engine.spec.drafter
    assert type(drafter.attn) is worker.attn_cls  # the same backend selection for the same model
    own = kv_sizing.bytes_per_block(worker.attn, worker.num_layers)
    assert drafter.kv_bytes_per_block(16) == own  # the same model: the same bytes per block
    assert worker.bytes_per_block() == 2 * own  # the engine's blocks hold both caches


def test_the_draft_model_lays_out_its_forwards_with_the_workers_layout(drafting, monkeypatch):
    from kvforge.plugins.speculative import model_drafting  # draft_model's (and the EAGLE heads') forwards

    assert model_drafting.lay_out_batch is batch_layout.lay_out_batch
    seen: list[np.ndarray] = []

    def counting(buf, *args, **kwargs):
        layout = batch_layout.lay_out_batch(buf, *args, **kwargs)
        seen.append(layout.slot_mapping.copy())
        return layout
    monkeypatch.setattr(model_drafting, "lay_out_batch", counting)
    out = drafting.generate([[5, 6, 7, 8, 9]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                            use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 6
    assert len(seen) >= 3  # a proposal: the catch-up, then k - 1 = 2 decode steps
    assert (seen[0] >= 0).all() and len(seen[0]) == 6  # the whole context, caught up with the token sampled


def test_a_rank_reports_what_it_is_and_refuses_adapters_without_lora(drafting):
    worker = drafting.llm_engine.executor.driver
    assert set(worker.ready()) == {"rank", "device", "attention_backend", "num_heads", "num_kv_heads", "stage",
                                   "layers"}
    assert "enable_lora" in worker.add_lora(None)
    assert worker.remove_lora(1) is False


def test_a_rank_traces_itself():
    llm = LLM("dummy:tiny", device="cpu", max_model_len=64, num_gpu_blocks_override=16)
    worker = llm.llm_engine.executor.driver
    with pytest.raises(RuntimeError, match="stop_profile without start_profile"):
        worker.stop_profile()
    worker.start_profile()
    llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert worker.stop_profile(row_limit=3).startswith("rank 0\n")
    llm.shutdown()
    with pytest.raises(RuntimeError, match="rank 0: it was released"):
        worker.execute(StepInput(req_ids=["x"], num_computed=np.zeros(1, dtype=np.int64),
                                 query_lens=np.ones(1, dtype=np.int64), input_ids=np.ones(1, dtype=np.int64),
                                 table_updates=[("x", 0, [0])]))


def test_leaving_the_groups_is_bounded_when_an_abort_hangs():
    """A rank's shutdown never waits on a collective library that does not return (NCCL's abort blocked
    while CUDA graphs held its communicator): the leave gives up after its timeout."""
    import time

    class Stuck:
        def shutdown(self) -> None:
            time.sleep(30)
    group = TPGroup(0, 2, Stuck())
    start = time.monotonic()
    assert RankGroups(0, group, group, PPStage(), 0).leave(torch.device("cpu"), timeout_s=0.3) is False
    assert time.monotonic() - start < 2
    assert RankGroups(0, SINGLE, SINGLE, PPStage(), 0).leave(torch.device("cpu")) is True



def test_a_worker_leaves_its_groups_once_however_often_it_is_closed():
    """The executor's shutdown closes the driver, then the engine's release closes it again: an abort stuck
    on a dead peer (its bound, 5 s) must be waited for once, not twice (11.6 s on two H100s before)."""
    llm = LLM("dummy:tiny", device="cpu", max_model_len=64, num_gpu_blocks_override=16)
    worker = llm.llm_engine.executor.driver
    leaves: list[torch.device] = []

    class StuckGroups:
        world = TPGroup(0, 2, None)

        def leave(self, device: torch.device) -> bool:
            leaves.append(device)
            return False  # the abort did not return in time
    worker.groups = StuckGroups()
    worker.close()
    llm.shutdown()  # releases the driver, which closes it again
    worker.release()
    assert leaves == [torch.device("cpu")] and worker.left_groups is False
