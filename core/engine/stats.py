"""``EngineStats``: what ``get_stats()`` returns (``EngineClient.get_stats``, ``LLMEngine.get_stats``), the
counters and gauges ``/metrics`` exposes (``server/metrics.py``). A plain dict, so that it crosses process
boundaries (the engine core process, Ray replicas) as it is; these types say which keys it holds.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Literal, TypedDict, get_args

from typing_extensions import NotRequired  # typing's from Python 3.11

if TYPE_CHECKING:
    from kvforge.kv_cache import KVCacheStats
    from kvforge.scheduler import SchedulerStats


class SpecDecodeSnapshot(TypedDict):
    """Speculative decoding since start (``kvforge.spec_decode.policy.SpecDecodeStats.as_dict``)."""

    num_drafts: int  # request-steps that verified drafts
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_by_position: list[int]  # [k]: drafts accepted at position j
    num_steps: int  # steps that verified drafts
    num_steps_without: int  # decode steps left without drafts
    acceptance_rate: float
    mean_accepted_length: float


class EngineStats(TypedDict):
    """One engine's snapshot (values may be a step old); a data-parallel engine's adds up its replicas'."""

    num_running: int
    num_waiting: int
    num_preemptions: int
    num_preemptions_recompute: int
    num_preemptions_swap: int
    num_swapped: int
    waiting_by_priority: dict[int, int]  # request priority -> waiting requests
    kv_cache_usage: float  # 0-1 (a data-parallel engine's: the replicas' mean)
    num_blocks: int
    num_free_blocks: int
    num_cpu_blocks: int
    num_free_cpu_blocks: int
    num_swapped_out_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_tier_hits: int  # of those, tokens the tiers beyond the GPU gave (kvforge.kv_tier)
    kv_tier_stored_blocks: int  # blocks saved to the tiers since start
    prefix_cache_cpu_hits: int  # of prefix_cache_tier_hits, tokens the cpu tier gave
    prefix_cache_disk_hits: int  # of prefix_cache_tier_hits, tokens the disk tier gave
    kv_tier_cpu_blocks: int  # blocks the cpu tier holds now
    kv_tier_disk_blocks: int  # blocks the disk tier holds now
    num_prompt_tokens: int
    num_generation_tokens: int
    spec_decode: SpecDecodeSnapshot | None  # None without speculative decoding
    rank_batch_requests: list[int]  # per rank (every replica's ranks, in order, when data-parallel)
    data_parallel_routed: NotRequired[list[int]]  # requests sent to each replica (data-parallel only)


#: the keys holding an integer count of one engine: a data-parallel engine's is its replicas' sum
CountKey = Literal["num_running", "num_waiting", "num_preemptions", "num_preemptions_recompute",
                   "num_preemptions_swap", "num_swapped", "num_blocks", "num_free_blocks", "num_cpu_blocks",
                   "num_free_cpu_blocks", "num_swapped_out_blocks", "prefix_cache_queries", "prefix_cache_hits",
                   "prefix_cache_tier_hits", "kv_tier_stored_blocks", "prefix_cache_cpu_hits",
                   "prefix_cache_disk_hits", "kv_tier_cpu_blocks", "kv_tier_disk_blocks",
                   "num_prompt_tokens", "num_generation_tokens"]
COUNT_KEYS: tuple[CountKey, ...] = get_args(CountKey)


def engine_stats(kv: KVCacheStats, sch: SchedulerStats, *, num_prompt_tokens: int, num_generation_tokens: int,
                 spec_decode: SpecDecodeSnapshot | None, rank_batch_requests: list[int]) -> EngineStats:
    """One engine's snapshot from its KV manager's and scheduler's stats (``LLMEngine.get_stats``)."""
    return {"num_running": sch.num_running, "num_waiting": sch.num_waiting,
            "num_preemptions": sch.num_preemptions, "kv_cache_usage": kv.usage,
            "num_preemptions_recompute": sch.num_preemptions - sch.num_preemptions_swap,
            "num_preemptions_swap": sch.num_preemptions_swap, "num_swapped": sch.num_swapped,
            "num_swapped_out_blocks": kv.num_swapped_out_blocks, "num_cpu_blocks": kv.num_cpu_blocks,
            "num_free_cpu_blocks": kv.num_free_cpu_blocks, "waiting_by_priority": sch.waiting_by_priority,
            "num_blocks": kv.num_blocks, "num_free_blocks": kv.num_free_blocks,
            "prefix_cache_queries": kv.prefix_cache_queries, "prefix_cache_hits": kv.prefix_cache_hits,
            "prefix_cache_tier_hits": kv.tier_hits, "kv_tier_stored_blocks": kv.tier_stored_blocks,
            "prefix_cache_cpu_hits": kv.tier_hits_by_tier.get("cpu", 0),
            "prefix_cache_disk_hits": kv.tier_hits_by_tier.get("disk", 0),
            "kv_tier_cpu_blocks": kv.tier_held_by_tier.get("cpu", 0),
            "kv_tier_disk_blocks": kv.tier_held_by_tier.get("disk", 0),
            "num_prompt_tokens": num_prompt_tokens, "num_generation_tokens": num_generation_tokens,
            "spec_decode": spec_decode, "rank_batch_requests": rank_batch_requests}
