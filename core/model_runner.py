"""``ModelRunner``: lays out one step's batch, runs the model and the sampler, sizes the KV cache."""
from __future__ import annotations

import itertools
import logging
import math

import numpy as np
import torch

from kvforge.attention import AttentionBackend, BatchLayout
from kvforge.errors import RequestFailure, is_device_error
from kvforge.input_buffers import StagingBuffers, h2d
from kvforge.kv_cache import KVCacheManager
from kvforge.rejection_sampler import VerifiedTokens, rejection_sample
from kvforge.sampler import DraftRow, Sampler
from kvforge.scheduler import ModelRunnerOutput, SchedulerOutput
from kvforge.step_handle import StepHandle, logprob_tensors
from kvforge.swap import CPUSwapSpace

logger = logging.getLogger(__name__)

GiB = 1 << 30
#: device memory for one slice of prompt log-probabilities (logits, log-softmax and rank mask)
PROMPT_LOGPROBS_SLICE_BYTES = 256 << 20


class ModelRunner:
    """Owns the model, the attention backend, the sampler and the per-layer KV-cache tensors."""

    def __init__(self, model: torch.nn.Module, attn: AttentionBackend, sampler: Sampler, *,
                 num_layers: int, vocab_size: int, device: torch.device):
        self.model = model
        self.attn = attn
        self.sampler = sampler
        self.num_layers = num_layers
        self.vocab_size = vocab_size
        self.device = device
        self.kv_caches: list[torch.Tensor] = []
        self.block_size = attn.block_size
        self.graphs = None  # a CUDAGraphRunner once captured
        self.timing: dict[str, float] | None = None  # per-phase seconds, when profiling
        self.swap_space: CPUSwapSpace | None = None
        self.extra_bytes_per_block = 0  # a drafter's own KV cache shares the block ids (Drafter.kv_bytes_per_block)
        self.num_graph_verifications = 0  # steps whose drafts a CUDA graph verified (greedy, CUDAGraphRunner.head)

    # -- KV cache sizing -------------------------------------------------------------------------
    def bytes_per_block(self) -> int:
        shape = self.attn.kv_cache_shape(1)
        return math.prod(shape) * self.attn.dtype.itemsize * self.num_layers + self.extra_bytes_per_block

    def determine_num_blocks(self, *, num_blocks_override: int | None, kv_cache_memory_gib: float | None,
                             gpu_memory_utilization: float, max_num_batched_tokens: int,
                             max_num_seqs: int, max_model_len: int) -> int:
        """KV blocks to allocate: an override; a memory budget; or, on CUDA, what a profiled peak
        forward leaves of ``gpu_memory_utilization`` times the device memory."""
        per_block = self.bytes_per_block()
        if num_blocks_override is not None:
            return num_blocks_override
        if kv_cache_memory_gib is not None:
            return max(1, int(kv_cache_memory_gib * GiB) // per_block)
        if self.device.type != "cuda":
            # CPU default: enough for every sequence at full length, capped at 4 GiB.
            want = max_num_seqs * -(-max_model_len // self.block_size)
            return max(1, min(want, (4 * GiB) // per_block))
        peak = self.profile_peak_memory(max_num_batched_tokens, max_num_seqs, max_model_len)
        free, total = torch.cuda.mem_get_info(self.device)
        non_torch = (total - free) - torch.cuda.memory_reserved(self.device)
        budget = total * gpu_memory_utilization - peak - max(non_torch, 0)
        num_blocks = int(budget // per_block)
        logger.info("KV cache: peak forward %.2f GiB, non-torch %.2f GiB, %.2f GiB of %.2f GiB for %d blocks",
                    peak / GiB, non_torch / GiB, max(budget, 0) / GiB, total / GiB, num_blocks)
        if num_blocks < 1:
            raise ValueError(
                f"gpu_memory_utilization={gpu_memory_utilization} leaves no memory for the KV cache "
                f"(model and peak activations take {peak / GiB:.2f} GiB of {total / GiB:.2f} GiB)")
        return num_blocks

    @torch.inference_mode()
    def profile_peak_memory(self, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int) -> int:
        """Peak bytes allocated by one forward of a full token budget plus sampling of a full batch."""
        bs = self.block_size
        seq_len = min(max_num_batched_tokens, max_model_len)
        num_seqs = -(-max_num_batched_tokens // seq_len)
        blocks_per_seq = -(-seq_len // bs)
        caches = self.attn.allocate_kv_cache(num_seqs * blocks_per_seq, self.num_layers)
        cache_bytes = sum(c.numel() * c.element_size() for c in caches)
        lens = [seq_len] * (num_seqs - 1) + [max_num_batched_tokens - seq_len * (num_seqs - 1)]
        layout = _prefill_layout(lens, blocks_per_seq, bs)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        meta = self.attn.build_metadata(layout)
        n = layout.num_tokens
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        pos = torch.from_numpy(np.concatenate([np.arange(x) for x in lens])).to(self.device)
        hidden = self.model(ids, pos, caches, meta)
        rows = min(max(max_num_seqs, self.prompt_logprobs_rows()), n)  # sampling, or a prompt-logprobs slice
        logits = self.model.compute_logits(hidden[:rows]).float()
        torch.softmax(logits, dim=-1).sort(dim=-1)
        logprob_tensors(logits, torch.zeros(rows, dtype=torch.long, device=self.device), 20)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - cache_bytes
        del caches, hidden, logits, meta
        torch.cuda.empty_cache()
        return peak

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = self.attn.allocate_kv_cache(num_blocks, self.num_layers)

    def capture_cuda_graphs(self, max_num_seqs: int, max_model_len: int, query_lens: tuple[int, ...] = (1,)) -> float:
        """Capture graphs of uniform steps (CUDA and a backend that supports them): decode, and with
        speculative decoding verification with ``query_lens`` tokens per sequence; returns the seconds."""
        from kvforge.cuda_graphs import CUDAGraphRunner

        self.graphs = CUDAGraphRunner(self.model, self.attn, self.kv_caches, max_num_seqs=max_num_seqs,
                                      max_model_len=max_model_len, device=self.device, query_lens=query_lens,
                                      verify_head=True)
        return self.graphs.capture()

    def initialize_swap_space(self, swap_space_gib: float) -> int:
        """Size the CPU swap pool (allocated on its first use); returns its number of blocks."""
        num_cpu_blocks = int(swap_space_gib * GiB) // self.bytes_per_block()
        self.swap_space = CPUSwapSpace(self.attn, self.num_layers, num_cpu_blocks)
        return num_cpu_blocks

    def swap_blocks(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """Copy ``(device, cpu)`` blocks to the CPU pool and ``(cpu, device)`` blocks back, every layer.

        NOTE: called before any other cache write of the step (see ``kvforge.swap``).
        """
        if swap_out or swap_in:
            if self.swap_space is None:
                raise ValueError("swap: no CPU swap pool (initialize_swap_space was not called)")
            self.swap_space.swap(self.kv_caches, swap_out, swap_in)

    # -- one step --------------------------------------------------------------------------------
    def initialize_input_buffers(self, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int) -> None:
        """Pre-allocate the host staging buffers and the device input tensors (see ``kvforge.input_buffers``)."""
        max_blocks = -(-max_model_len // self.block_size)
        self.staging = StagingBuffers(max_num_batched_tokens, max_num_seqs, max_blocks, self.device)
        self.input_ids = torch.zeros(max_num_batched_tokens, dtype=torch.long, device=self.device)
        self.positions = torch.zeros(max_num_batched_tokens, dtype=torch.long, device=self.device)

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, kv: KVCacheManager, prev: "StepHandle | None" = None) -> "StepHandle":
        """Queue one step's GPU work and return at once; ``StepHandle.result()`` waits for it.

        ``prev``: the step still in flight, whose sampled tokens fill this step's placeholders
        (async scheduling) on the device, without a round trip through the host.
        """
        self.sampler.release(out.finished_request_ids)
        self.swap_blocks(out.blocks_to_swap_out, out.blocks_to_swap_in)  # even in a step with no batch
        if out.is_empty:
            return StepHandle.done(ModelRunnerOutput())
        self.attn.copy_blocks(self.kv_caches, out.blocks_to_copy)
        graph_key = None  # (padded batch size, query tokens per sequence) of a uniform step
        if self.graphs is not None and not any(r.sampling_params.prompt_logprobs is not None for r in out.scheduled):
            graph_key = self.graphs.padded_size(out)
        buf, layout, sample_reqs, fills, row_counts, dense = self._layout(out, kv, graph_key, prev)
        dev = self.device
        num_rows = layout.num_tokens  # with graph padding
        pinned = buf.tensors
        if graph_key is not None:
            ids_dev, pos_dev = self.graphs.input_ids[:num_rows], self.graphs.positions[:num_rows]
        else:
            ids_dev, pos_dev = self.input_ids_for(num_rows)
        ids_dev.copy_(pinned["input_ids"][:num_rows], non_blocking=True)
        pos_dev.copy_(pinned["positions"][:num_rows], non_blocking=True)
        if fills:  # placeholders: the previous step's sampled tokens, gathered on the device
            dst = pinned["fill_dst"][:fills].to(dev, non_blocking=True)
            src = pinned["fill_src"][:fills].to(dev, non_blocking=True)
            ids_dev[dst] = prev.tokens[src]
        head = None  # a verification graph's greedy verification of its drafts
        if graph_key is not None:  # a uniform step (decode, or verification of k drafts each): replay a graph
            hidden = self.graphs.replay(layout)[:out.total_num_scheduled_tokens]
            head = self.graphs.head(graph_key)
        else:
            meta = self.attn.build_metadata(layout)
            hidden = self.model(ids_dev, pos_dev, self.kv_caches, meta)  # [num_tokens, hidden]
        handle = StepHandle(buf, dev)
        self._prompt_logprobs(out, layout, hidden, handle)
        if (sample_reqs and row_counts is not None and head is not None and dense
                and all(self.sampler.plain_greedy(r) for r in sample_reqs)):
            handle.set_verified(head[:len(sample_reqs)], sample_reqs)  # verified inside the graph
            self.num_graph_verifications += 1
        elif sample_reqs and row_counts is not None:  # the step verifies drafts
            n = sum(row_counts)
            if dense:  # every row is sampled, in order (a uniform step): no gather
                h, row_ids = hidden[:n], ids_dev[:n]
            else:
                rows = pinned["sample_rows"][:n].to(dev, non_blocking=True)
                h, row_ids = hidden[rows], ids_dev[rows]
            logits = self.model.compute_logits(h).float()  # [sum(1 + k), vocab]
            # the rows' input ids: each request's own last token, then its drafts
            self._verify(logits, row_ids, sample_reqs, row_counts, out.draft_token_ids, handle)
        elif sample_reqs:
            if dense:  # every row is sampled, in order (a decode step): no gather
                h = hidden[:len(sample_reqs)]
            else:
                h = hidden[pinned["sample_rows"][:len(sample_reqs)].to(dev, non_blocking=True)]
            logits = self.model.compute_logits(h).float()  # [num_sampled, vocab]
            sampled = self._sample(logits, sample_reqs, handle)  # NO_TOKEN (-1) where nothing could be sampled
            tokens = sampled.clamp_min(0)  # what the device reads (placeholders, logprobs); the host sees -1
            handle.set_tokens(tokens, sample_reqs, sampled)
            want = [i for i, r in enumerate(sample_reqs) if r.sampling_params.logprobs is not None]
            if want:
                k = max(sample_reqs[i].sampling_params.logprobs for i in want)
                idx = h2d(want, torch.long, dev)
                handle.logprobs = ([sample_reqs[i] for i in want], logprob_tensors(logits[idx], tokens[idx], k))
        handle.finish()
        return handle

    def _sample(self, logits: torch.Tensor, reqs: list, handle: "StepHandle") -> torch.Tensor:
        """Sample every row. If the batch raises, each row is sampled alone: a request whose row still
        raises fails on its own (``handle.errors``; its row gets token 0, never used) and the others
        keep the tokens they would have had. Device errors propagate (see ``kvforge.errors``)."""
        try:
            return self.sampler.sample(logits, self.sampler.prepare(reqs))
        except Exception as exc:
            if is_device_error(exc):
                raise
            logger.warning("sampling a batch of %d failed (%r); sampling its rows one by one", len(reqs), exc)
        tokens = torch.zeros(len(reqs), dtype=torch.long, device=self.device)
        for i, req in enumerate(reqs):
            try:
                tokens[i:i + 1] = self.sampler.sample(logits[i:i + 1], self.sampler.prepare([req]))
            except Exception as exc:
                if is_device_error(exc):
                    raise
                handle.errors[req.request_id] = RequestFailure.from_exception(exc, "sampling")
        return tokens

    def _verify(self, logits: torch.Tensor, row_ids: torch.Tensor, reqs: list, counts: list[int],
                drafts: dict[str, list[int]], handle: "StepHandle") -> None:
        """Verify the step's drafts with the rejection sampler: request b owns ``counts[b]`` rows
        (1 + its drafts). Isolated like :meth:`_sample`: if the batch raises, each request is verified
        alone, and one that still raises fails on its own."""
        K = max(counts) - 1
        try:
            verified = self._verify_rows(logits, row_ids, reqs, counts, drafts, K)
        except Exception as exc:
            if is_device_error(exc):
                raise
            logger.warning("verifying a batch of %d failed (%r); verifying its requests one by one", len(reqs), exc)
            tokens = torch.full((len(reqs), K + 1), 0, dtype=torch.long, device=self.device)
            emitted = torch.ones(len(reqs), dtype=torch.long, device=self.device)
            start = 0
            for b, (req, c) in enumerate(zip(reqs, counts)):
                try:
                    one = self._verify_rows(logits[start:start + c], row_ids[start:start + c], [req], [c], drafts, K)
                    tokens[b], emitted[b] = one.tokens[0], one.num_emitted[0]
                except Exception as exc:
                    if is_device_error(exc):
                        raise
                    handle.errors[req.request_id] = RequestFailure.from_exception(exc, "sampling")
                start += c
            verified = VerifiedTokens(tokens, emitted, emitted - 1)
        handle.set_verified(verified.packed(), reqs)
        want = [b for b, r in enumerate(reqs) if r.sampling_params.logprobs is not None]
        if want:
            first = np.concatenate([[0], np.cumsum(counts)[:-1]])
            row_b = np.concatenate([np.full(counts[b], b) for b in want])
            row_j = np.concatenate([np.arange(counts[b]) for b in want])
            rows = np.concatenate([first[b] + np.arange(counts[b]) for b in want])
            row_tokens = verified.tokens[h2d(row_b, torch.long, self.device), h2d(row_j, torch.long, self.device)]
            k = max(reqs[b].sampling_params.logprobs for b in want)
            handle.logprobs = ([reqs[b] for b in want], logprob_tensors(
                logits[h2d(rows, torch.long, self.device)], row_tokens.clamp_min(0), k))
            handle.logprob_rows = [counts[b] for b in want]

    def _verify_rows(self, logits: torch.Tensor, row_ids: torch.Tensor, reqs: list, counts: list[int],
                     drafts: dict[str, list[int]], K: int) -> VerifiedTokens:
        """Request b's rows are the next ``counts[b]`` of ``logits``; ``row_ids`` are their input ids
        (its own last token, then its drafts)."""
        views: list = []
        for req, c in zip(reqs, counts):
            if c > 1 and self.sampler.reads_history(req):  # row j sees drafts 1..j as generated
                d = drafts.get(req.request_id, [])[:c - 1]
                views.append(req)
                views.extend(DraftRow(req, d[:j]) for j in range(1, c))
            else:
                views.extend([req] * c)
        target = self.sampler.target(logits, self.sampler.prepare(views))
        B = len(reqs)
        if all(c == K + 1 for c in counts):  # uniform (always, with CUDA graphs): no index to build
            tokens = row_ids.view(B, K + 1)[:, 1:]
            return rejection_sample(target, tokens, draft_probs=self._draft_probs(reqs, counts, tokens, K))
        first = np.zeros(B, dtype=np.int64)
        np.cumsum(counts[:-1], out=first[1:])
        num_drafts = np.asarray(counts, dtype=np.int64) - 1
        j = np.arange(K)
        index = np.where(j[None, :] < num_drafts[:, None], first[:, None] + 1 + j[None, :], first[:, None])
        packed = h2d(np.concatenate([index.ravel(), num_drafts, first]), torch.long, self.device)  # one copy
        tokens = row_ids[packed[:B * K]].view(B, K)
        return rejection_sample(target, tokens, packed[B * K:B * K + B], packed[B * K + B:],
                                self._draft_probs(reqs, counts, tokens, K), host_first_row=first.tolist())

    def _draft_probs(self, reqs: list, counts: list[int], tokens: torch.Tensor, K: int) -> torch.Tensor | None:
        """[B, K, vocab] q of every draft: the drafter's where it gave one, else one-hot at the draft."""
        if K == 0 or all(r.draft_probs is None for r in reqs):
            return None
        q = torch.nn.functional.one_hot(tokens, self.vocab_size).float()
        for b, (r, c) in enumerate(zip(reqs, counts)):
            if r.draft_probs is not None and c > 1:  # (filler drafts past the drafter's own stay one-hot)
                n = min(c - 1, len(r.draft_probs))
                q[b, :n] = r.draft_probs[:n]
        return q

    def input_ids_for(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        if n > self.input_ids.shape[0]:
            self.input_ids = torch.zeros(n, dtype=torch.long, device=self.device)
            self.positions = torch.zeros(n, dtype=torch.long, device=self.device)
        return self.input_ids[:n], self.positions[:n]

    def _prompt_logprobs(self, out: SchedulerOutput, layout: BatchLayout, hidden: torch.Tensor,
                         handle: "StepHandle") -> None:
        """Log-probabilities of the prompt tokens this step's chunks predict (position p predicts p+1)."""
        rows, targets, spans = [], [], []
        for i, r in enumerate(out.scheduled):
            if r.sampling_params.prompt_logprobs is None:
                continue
            start = r.num_computed_tokens
            end = min(start + out.num_scheduled_tokens[r.request_id], r.num_prompt_tokens - 1)
            if end <= start:
                continue
            off = int(layout.query_start_loc[i])
            rows.extend(range(off, off + end - start))
            targets.extend(r.prompt_token_ids[start + 1:end + 1])
            spans.append((r, start, end - start))
        if not rows:
            return
        dev = self.device
        k = max(r.sampling_params.prompt_logprobs for r, _, _ in spans)
        rows_dev, targets_dev = h2d(rows, torch.long, dev), h2d(targets, torch.long, dev)
        # NOTE: [rows, vocab] float32 logits for a whole prompt chunk could take gigabytes: compute
        # them a bounded slice at a time (the memory profile runs one slice of this size)
        step = self.prompt_logprobs_rows()
        parts = [logprob_tensors(self.model.compute_logits(hidden[rows_dev[i:i + step]]).float(),
                                  targets_dev[i:i + step], k) for i in range(0, len(rows), step)]
        handle.prompt_logprobs = (spans, {key: torch.cat([p[key] for p in parts]) for key in parts[0]})

    def prompt_logprobs_rows(self) -> int:
        """Prompt positions whose log-probabilities are computed at once: about
        ``PROMPT_LOGPROBS_SLICE_BYTES`` of float32 logits and their temporaries."""
        return max(1, PROMPT_LOGPROBS_SLICE_BYTES // (self.vocab_size * 12))

    def _layout(self, out: SchedulerOutput, kv: KVCacheManager, graph_key: tuple[int, int] | None,
                prev: "StepHandle | None"):
        """Lay the step out in the next set of staging buffers: vectorised, no per-step allocation.

        With ``graph_key`` = (size, q) (a uniform batch replayed as a CUDA graph), the sequences past
        the batch are padding of q tokens each: context q, block 0, slot -1 (nothing written), and the
        block tables are as wide as the captured graph's.
        """
        reqs = out.scheduled
        n = len(reqs)
        bs = self.block_size
        nst = out.num_scheduled_tokens
        q_lens = np.fromiter((nst[r.request_id] for r in reqs), dtype=np.int64, count=n)
        starts = np.fromiter((r.num_computed_tokens for r in reqs), dtype=np.int64, count=n)
        tables = [kv.block_table(r.request_id) for r in reqs]
        total = int(q_lens.sum())
        rows, q = graph_key if graph_key is not None else (n, 0)
        num_rows = total if graph_key is None else rows * q
        width = self.graphs.max_blocks if graph_key is not None else max(len(t) for t in tables)
        num_forks = sum(len(r.forks) for r in reqs)
        drafts = out.draft_token_ids
        num_drafts = sum(len(d) for d in drafts.values())
        buf = self.staging.next(num_rows, rows + num_forks + num_drafts, width)
        b = buf.np
        qsl = b["query_start_loc"][:rows + 1]
        qsl[0] = 0
        np.cumsum(q_lens, out=qsl[1:n + 1])
        ids = b["input_ids"][:num_rows]
        if drafts:  # a request's drafts follow its own tokens
            ids[:total] = np.fromiter(itertools.chain.from_iterable(
                r.tokens(int(s), r.num_tokens) + drafts[r.request_id] if r.request_id in drafts
                else r.tokens(int(s), int(s + q)) for r, s, q in zip(reqs, starts, q_lens)), dtype=np.int64, count=total)
        else:
            ids[:total] = np.fromiter(itertools.chain.from_iterable(
                r.tokens(int(s), int(s + q)) for r, s, q in zip(reqs, starts, q_lens)), dtype=np.int64, count=total)
        positions = b["positions"][:num_rows]
        np.subtract(np.arange(total), np.repeat(qsl[:n] - starts, q_lens), out=positions[:total])
        seq_lens = b["seq_lens"][:rows]
        seq_lens[:n] = starts + q_lens
        block_tables = buf.block_tables(rows, width)
        for i, t in enumerate(tables):
            block_tables[i, :len(t)] = t
        slots = b["slot_mapping"][:num_rows]
        seq_of_token = np.repeat(np.arange(n), q_lens)
        slots[:total] = block_tables[seq_of_token, positions[:total] // bs].astype(np.int64) * bs + positions[:total] % bs
        if num_rows > total:  # graph padding sequences: q tokens each
            qsl[n + 1:] = total + np.arange(1, rows - n + 1) * q
            ids[total:] = 0
            positions[total:] = 0
            seq_lens[n:] = q
            slots[total:] = -1
        holes = np.flatnonzero(ids[:total] < 0)  # placeholders: tokens the step in flight samples
        fills = len(holes)
        if fills:
            prev_rows = {r.request_id: i for i, r in enumerate(prev.sample_reqs)} if prev is not None else {}
            owners = np.searchsorted(qsl[1:n + 1], holes, side="right")
            b["fill_dst"][:fills] = holes
            for j, owner in enumerate(owners.tolist()):
                row = prev_rows.get(reqs[owner].request_id)
                if row is None:
                    raise RuntimeError(f"request {reqs[owner].request_id!r} has a placeholder token but the "
                                       "step in flight does not sample it")
                b["fill_src"][j] = row
            ids[holes] = 0
        sample_rows, sample_reqs = b["sample_rows"], []
        ends = starts + q_lens
        if drafts:  # request i samples its last 1 + k rows: one per draft to verify, and one more
            row_counts = []
            n_rows = 0
            for i, r in enumerate(reqs):
                if ends[i] >= r.num_tokens:
                    c = 1 + len(drafts.get(r.request_id, ()))
                    sample_rows[n_rows:n_rows + c] = np.arange(qsl[i + 1] - c, qsl[i + 1])
                    sample_reqs.append(r)
                    row_counts.append(c)
                    n_rows += c
                    for fork in r.forks:  # n > 1 finishing its prompt (never with drafts): one row each
                        sample_rows[n_rows] = qsl[i + 1] - 1
                        sample_reqs.append(fork)
                        row_counts.append(1)
                        n_rows += 1
            layout = BatchLayout(qsl, seq_lens, block_tables, slots)
            return buf, layout, sample_reqs, fills, row_counts, not num_forks and n_rows == total
        for i, r in enumerate(reqs):
            if ends[i] >= r.num_tokens:  # the step reaches the request's last known token: sample
                row = qsl[i + 1] - 1
                for req in (r, *r.forks):  # n > 1: the other samples draw from the same logits
                    sample_rows[len(sample_reqs)] = row
                    sample_reqs.append(req)
        layout = BatchLayout(qsl, seq_lens, block_tables, slots)
        # dense: the sampled rows are all rows, in order (no fork repeats a row)
        return buf, layout, sample_reqs, fills, None, not num_forks and len(sample_reqs) == total


def _prefill_layout(lens: list[int], blocks_per_seq: int, bs: int) -> BatchLayout:
    """Layout of fresh prefills, sequence i owning blocks [i*blocks_per_seq, (i+1)*blocks_per_seq)."""
    qsl = np.zeros(len(lens) + 1, dtype=np.int32)
    np.cumsum(lens, out=qsl[1:])
    tables = np.arange(len(lens) * blocks_per_seq, dtype=np.int32).reshape(len(lens), blocks_per_seq)
    slots = np.concatenate([tables[i, np.arange(n) // bs].astype(np.int64) * bs + np.arange(n) % bs
                            for i, n in enumerate(lens)])
    return BatchLayout(qsl, np.array(lens, dtype=np.int32), tables, slots)
