"""The worker boundary: what the engine hands every worker each step, and what the driver gets back.

``StepInput`` is plain values and numpy arrays, pickled once per step for remote ranks (the
in-process driver worker gets the object itself). Workers keep a persistent batch: each request's
block table, updated from ``table_updates``, so a running request costs only what changed.
``StepPlan`` is the driver's half of the same step: the live requests it samples for, never sent.
``StepInputBuilder`` makes both from the scheduler's output (docs/distributed.md). ``ForwardOutput`` is
the driver worker's results of the step, read by the sampler.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from kvforge.attention import BatchLayout
from kvforge.kv_cache import KVCacheManager
from kvforge.kv_tier import TierTransfers
from kvforge.multimodal.encoder_cache import EncoderCachePlan
from kvforge.multimodal.mrope import rope_offsets, rope_positions, uses_rope_positions
from kvforge.multimodal.spans import chunk_limit, has_bidirectional, lookahead
from kvforge.rank.input_buffers import HostInputs
from kvforge.scheduler import SchedulerOutput


@dataclass
class StepInput:
    """One step, for every worker. Request i computes ``query_lens[i]`` tokens from position
    ``num_computed[i]``; their ids are the next ``query_lens[i]`` of ``input_ids`` (-1: a placeholder,
    filled on the device from the step in flight's sampled tokens: ``fill_dst`` rows take the
    ``fill_src`` entries of the driver's ``num_prev_tokens`` tokens, broadcast to every rank)."""

    req_ids: list[str] = field(default_factory=list)
    num_computed: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    query_lens: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    input_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    #: (request, start, block ids): the request's table becomes ``table[:start] + ids``
    table_updates: list[tuple[str, int, list[int]]] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)  # requests the workers forget (finished, preempted)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    graph_key: tuple[int, int] | None = None  # (padded size, q): replay that CUDA graph
    #: rows whose logits are sampled (hidden-state row indices); None: the first ``num_sample_rows``
    sample_rows: np.ndarray | None = None
    num_sample_rows: int = 0
    compute_logits: bool = False  # False: nothing is sampled, or the graph's head verifies the drafts
    prompt_rows: np.ndarray | None = None  # rows whose logits give prompt log-probabilities
    fill_dst: np.ndarray | None = None
    fill_src: np.ndarray | None = None
    num_prev_tokens: int = 0
    #: LoRA: each request's adapter id (0: the base model); None when no request runs an adapter
    lora_ids: np.ndarray | None = None
    #: multimodal: the items to encode first (new to the ranks' encoder caches), the cache entries to drop
    #: before, and where embedding rows go ([k, 4]: step row, content hash, first row, rows); None when the
    #: step has no placeholder (kvforge.multimodal.encoder_cache)
    mm_encode: list | None = None
    mm_free: list[int] | None = None
    mm_places: np.ndarray | None = None
    #: multimodal RoPE (kvforge.multimodal.mrope): what each token adds to its position in a step without
    #: image rows, or the [3, num_tokens] positions of a step with some; None without such a request
    rope_offsets: np.ndarray | None = None
    mrope_positions: np.ndarray | None = None
    #: items whose rows attend both ways (kvforge.multimodal.spans): each token's lookahead, [num_tokens]
    #: int64 (BatchLayout.lookahead); None when no token of the step has one
    lookahead: np.ndarray | None = None
    #: the KV tiers' copies of prefix-cached blocks (kvforge.kv_tier): saves of blocks the step reuses, loads
    #: of prefix blocks found there, moves down the chain, a disk tier's drops; None when there are none
    tier: TierTransfers | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def has_work(self) -> bool:
        """Whether workers have anything to do (a batch, or bookkeeping: swaps, forgotten requests)."""
        return bool(self.req_ids or self.dropped or self.blocks_to_swap_out or self.blocks_to_swap_in
                    or bool(self.tier))


@dataclass
class ForwardOutput:
    """The driver's results of a step: device tensors the sampler reads."""

    buf: HostInputs  # the staging set the step was laid out in (the sampled tokens come back into it)
    input_ids: torch.Tensor  # [rows] the step's input ids (placeholders filled)
    sample_rows: torch.Tensor | None  # the sampled rows, None when they are rows 0 .. n - 1
    logits: torch.Tensor | None  # float32 [num_sample_rows, vocab]
    head: torch.Tensor | None  # a verification graph's greedy verification
    #: the step's layout (graph-padded) and positions [rows], for a drafter that reads hidden states
    #: (``kvforge.spec_decode.target_states``)
    layout: BatchLayout | None = None
    positions: torch.Tensor | None = None


@dataclass
class StepPlan:
    """The driver's half of a step: who samples from which rows."""

    sample_reqs: list = field(default_factory=list)  # one per sampled row group (n > 1 forks repeat a row)
    row_counts: list[int] | None = None  # with drafts: rows per entry of sample_reqs (1 + its drafts)
    dense: bool = False  # the sampled rows are rows 0.. in order (no gather)
    use_head: bool = False  # the verification graph's greedy head gives the tokens
    prompt_spans: list = field(default_factory=list)  # (request, first position, count)
    prompt_targets: list[int] = field(default_factory=list)


class StepInputBuilder:
    """Turns ``SchedulerOutput`` into (``StepInput``, ``StepPlan``), remembering the block tables the
    workers hold so that each step sends only their changes."""

    def __init__(self, lora: bool = False, multimodal: bool = False) -> None:
        """``lora``: the engine serves LoRA adapters (each step says which one each request runs under);
        ``multimodal``: its model takes images (each step says what the ranks encode)."""
        self.sent: dict[str, list[int]] = {}  # request -> the block table the workers hold
        self.lora = lora
        self.encoder = EncoderCachePlan() if multimodal else None

    def build(self, out: SchedulerOutput, kv: KVCacheManager, graph_key: tuple[int, int] | None,
              prev_sample_reqs: list | None) -> tuple[StepInput, StepPlan]:
        step = StepInput(blocks_to_copy=out.blocks_to_copy, blocks_to_swap_out=out.blocks_to_swap_out,
                         blocks_to_swap_in=out.blocks_to_swap_in, graph_key=graph_key)
        plan = StepPlan()
        step.tier = kv.take_tier_transfers() or None
        dropped = [*out.finished_request_ids, *(r.request_id for r in out.preempted)]
        for rid in dropped:
            self.sent.pop(rid, None)
        step.dropped = dropped
        reqs = out.scheduled
        n = len(reqs)
        if not n:
            return step, plan
        step.req_ids = [r.request_id for r in reqs]
        step.table_updates = self._table_updates(step.req_ids, kv)
        nst = out.num_scheduled_tokens
        q_lens = step.query_lens = np.fromiter((nst[rid] for rid in step.req_ids), dtype=np.int64, count=n)
        starts = step.num_computed = np.fromiter((r.num_computed_tokens for r in reqs), dtype=np.int64, count=n)
        total = int(q_lens.sum())
        drafts = out.draft_token_ids
        if drafts:  # a request's drafts follow its own tokens
            chunks = (r.tokens(int(s), r.num_tokens) + drafts[r.request_id] if r.request_id in drafts
                      else r.tokens(int(s), int(s + q)) for r, s, q in zip(reqs, starts, q_lens))
        else:
            chunks = (r.tokens(int(s), int(s + q)) for r, s, q in zip(reqs, starts, q_lens))
        if self.encoder is not None:
            work = self.encoder.step(reqs, starts, q_lens)
            if work is not None:
                step.mm_encode, step.mm_free, step.mm_places = work.encode, work.free, work.places
            if any(r.mm_features and uses_rope_positions(r.mm_features) for r in reqs):
                self._rope_positions(step, reqs, starts, q_lens, total)
            if step.mm_places is not None and any(r.mm_features and has_bidirectional(r.mm_features) for r in reqs):
                self._lookahead(step, reqs, starts, q_lens, total)
        if self.lora and any(r.lora_request is not None for r in reqs):
            step.lora_ids = np.fromiter((r.lora_int_id for r in reqs), dtype=np.int64, count=n)
        ids = step.input_ids = np.fromiter(itertools.chain.from_iterable(chunks), dtype=np.int64, count=total)
        ends = np.cumsum(q_lens)  # each request's end row
        holes = np.flatnonzero(ids < 0)  # placeholders: tokens the step in flight samples
        if len(holes):
            self._fills(step, holes, ends, reqs, prev_sample_reqs)
        self._sample_rows(step, plan, reqs, starts + q_lens, ends, drafts, total)
        self._prompt_rows(step, plan, reqs, ends - q_lens, nst)
        return step, plan

    @staticmethod
    def _rope_positions(step: StepInput, reqs: list, starts: np.ndarray, q_lens: np.ndarray, total: int) -> None:
        """M-RoPE: the [3, T] positions of a step that reaches image rows (it runs eagerly), else the
        offsets the text of requests after their images adds to its positions (decode graphs stay 1-D)."""
        rows = np.concatenate([[0], np.cumsum(q_lens)])
        if step.mm_places is not None:
            pos = np.empty((3, total), dtype=np.int64)
            for i, (r, s, q) in enumerate(zip(reqs, starts, q_lens)):
                s, q = int(s), int(q)
                pos[:, rows[i]:rows[i + 1]] = (rope_positions(r.mm_features, s, q) if r.mm_features
                                               else np.arange(s, s + q, dtype=np.int64))
            step.mrope_positions = pos
            return
        offsets = np.zeros(total, dtype=np.int64)
        for i, (r, s, q) in enumerate(zip(reqs, starts, q_lens)):
            if r.mm_features:
                offsets[rows[i]:rows[i + 1]] = rope_offsets(r.mm_features, int(s), int(q))
        if offsets.any():
            step.rope_offsets = offsets

    @staticmethod
    def _lookahead(step: StepInput, reqs: list, starts: np.ndarray, q_lens: np.ndarray, total: int) -> None:
        """Each token's lookahead into its bidirectional item; a chunk that ends inside one is a scheduling
        policy's bug (it must apply ``Scheduler.fit_chunk``): its later rows would be missing."""
        out = np.zeros(total, dtype=np.int64)
        row = 0
        for r, s, q in zip(reqs, starts, q_lens):
            s, q = int(s), int(q)
            if r.mm_features:
                if chunk_limit(r.mm_features, s, q) != q:
                    raise RuntimeError(f"request {r.request_id}: its chunk {s}..{s + q} ends inside an item whose "
                                       "rows attend both ways (the scheduling policy must apply Scheduler.fit_chunk)")
                out[row:row + q] = lookahead(r.mm_features, s, q)
            row += q
        if out.any():
            step.lookahead = out

    def forget(self, request_ids: set[str]) -> StepInput:
        """A step with no batch that makes every worker forget ``request_ids`` (ended requests)."""
        for rid in request_ids:
            self.sent.pop(rid, None)
        return StepInput(dropped=list(request_ids))

    def _table_updates(self, req_ids: list[str], kv: KVCacheManager) -> list[tuple[str, int, list[int]]]:
        """Each scheduled request's table change since the workers last saw it: all of it when new
        (or changed other than by appending: copy-on-write, a tail freed and regrown), else the
        appended blocks."""
        updates = []
        sent = self.sent
        for rid in req_ids:
            table = kv.block_table(rid)
            old = sent.get(rid)
            if old is not None and table == old:
                continue
            if old is not None and len(table) > len(old) and table[:len(old)] == old:
                new = table[len(old):]
                updates.append((rid, len(old), new))
                old.extend(new)
            else:
                sent[rid] = list(table)
                updates.append((rid, 0, sent[rid]))
        return updates

    @staticmethod
    def _fills(step: StepInput, holes: np.ndarray, ends: np.ndarray, reqs: list, prev_sample_reqs: list | None) -> None:
        prev_rows = {r.request_id: i for i, r in enumerate(prev_sample_reqs or ())}
        owners = np.searchsorted(ends, holes, side="right")
        src = np.empty(len(holes), dtype=np.int64)
        for j, owner in enumerate(owners.tolist()):
            row = prev_rows.get(reqs[owner].request_id)
            if row is None:
                raise RuntimeError(f"request {reqs[owner].request_id!r} has a placeholder token but the "
                                   "step in flight does not sample it")
            src[j] = row
        step.input_ids[holes] = 0
        step.fill_dst, step.fill_src, step.num_prev_tokens = holes, src, len(prev_rows)

    @staticmethod
    def _sample_rows(step: StepInput, plan: StepPlan, reqs: list, ends_pos: np.ndarray, ends: np.ndarray,
                     drafts: dict[str, list[int]], total: int) -> None:
        """Request i samples when the step reaches its last known token: its last row, or with drafts
        its last 1 + k rows (one per draft to verify, and one more); each n > 1 fork finishing its
        prompt samples the same row again."""
        rows: list[int] = []
        sample_reqs = plan.sample_reqs
        counts: list[int] | None = [] if drafts else None
        forked = False
        for i, r in enumerate(reqs):
            if ends_pos[i] < r.num_tokens:
                continue
            end = int(ends[i])
            c = 1 + len(drafts.get(r.request_id, ())) if drafts else 1
            rows.extend(range(end - c, end))
            sample_reqs.append(r)
            if counts is not None:
                counts.append(c)
            for fork in r.forks:  # (never with drafts)
                forked = True
                rows.append(end - 1)
                sample_reqs.append(fork)
                if counts is not None:
                    counts.append(1)
        plan.row_counts = counts
        plan.dense = len(rows) == total and not forked  # then rows == 0 .. total - 1
        step.num_sample_rows = len(rows)
        if not plan.dense and rows:
            step.sample_rows = np.asarray(rows, dtype=np.int64)

    @staticmethod
    def _prompt_rows(step: StepInput, plan: StepPlan, reqs: list, firsts: np.ndarray, nst: dict[str, int]) -> None:
        """Rows of the prompt positions this step's chunks predict (position p predicts p + 1)."""
        rows: list[int] = []
        for i, r in enumerate(reqs):
            if r.sampling_params.prompt_logprobs is None:
                continue
            start = r.num_computed_tokens
            end = min(start + nst[r.request_id], r.num_prompt_tokens - 1)
            if end <= start:
                continue
            off = int(firsts[i])
            rows.extend(range(off, off + end - start))
            plan.prompt_targets.extend(r.prompt_token_ids[start + 1:end + 1])
            plan.prompt_spans.append((r, start, end - start))
        if rows:
            step.prompt_rows = np.asarray(rows, dtype=np.int64)
