"""``ModelRunner``: lays out one step's batch, runs the model and the sampler, sizes the KV cache."""
from __future__ import annotations

import logging
import math

import numpy as np
import torch

from kvforge.attention import AttentionBackend, BatchLayout
from kvforge.kv_cache import KVCacheManager
from kvforge.sampler import Sampler
from kvforge.scheduler import ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from kvforge.swap import CPUSwapSpace

logger = logging.getLogger(__name__)

GiB = 1 << 30


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

    # -- KV cache sizing -------------------------------------------------------------------------
    def bytes_per_block(self) -> int:
        shape = self.attn.kv_cache_shape(1)
        return math.prod(shape) * self.attn.dtype.itemsize * self.num_layers

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
        rows = min(max_num_seqs, n)
        logits = self.model.compute_logits(hidden[:rows]).float()
        torch.softmax(logits, dim=-1).sort(dim=-1)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - cache_bytes
        del caches, hidden, logits, meta
        torch.cuda.empty_cache()
        return peak

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = self.attn.allocate_kv_cache(num_blocks, self.num_layers)

    def capture_cuda_graphs(self, max_num_seqs: int, max_model_len: int) -> float:
        """Capture decode graphs (CUDA and a backend that supports them); returns the seconds it took."""
        from kvforge.cuda_graphs import CUDAGraphRunner

        self.graphs = CUDAGraphRunner(self.model, self.attn, self.kv_caches, max_num_seqs=max_num_seqs,
                                      max_model_len=max_model_len, device=self.device)
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
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, kv: KVCacheManager) -> ModelRunnerOutput:
        self.sampler.release(out.finished_request_ids)
        self.swap_blocks(out.blocks_to_swap_out, out.blocks_to_swap_in)  # even in a step with no batch
        if out.is_empty:
            return ModelRunnerOutput()
        self.attn.copy_blocks(self.kv_caches, out.blocks_to_copy)
        layout, input_ids, positions, sample_rows, sample_reqs = self._layout(out, kv)
        dev = self.device
        if self.graphs is not None and self.graphs.can_run(layout) and not any(
                r.sampling_params.prompt_logprobs is not None for r in out.scheduled):
            hidden = self.graphs.run(layout, input_ids, positions)  # decode-only: replay a graph
        else:
            meta = self.attn.build_metadata(layout)
            ids_t = torch.from_numpy(input_ids).to(dev, non_blocking=True)
            pos_t = torch.from_numpy(positions).to(dev, non_blocking=True)
            hidden = self.model(ids_t, pos_t, self.kv_caches, meta)  # [num_tokens, hidden]
        result = ModelRunnerOutput()
        self._prompt_logprobs(out, layout, hidden, result)
        if not sample_rows:
            return result
        rows = torch.tensor(sample_rows, device=dev)
        logits = self.model.compute_logits(hidden[rows]).float()  # [num_sampled, vocab]
        tokens_t = self.sampler.sample(logits, self.sampler.prepare(sample_reqs))
        want = [i for i, r in enumerate(sample_reqs) if r.sampling_params.logprobs is not None]
        if want:
            k = max(sample_reqs[i].sampling_params.logprobs for i in want)
            idx = torch.tensor(want, device=dev)
            entries = _logprobs(logits[idx], tokens_t[idx], k)
            for i, entry in zip(want, entries):
                n = sample_reqs[i].sampling_params.logprobs
                entry.top_ids, entry.top_logprobs = entry.top_ids[:n], entry.top_logprobs[:n]
                result.logprobs[sample_reqs[i].request_id] = entry
        tokens = tokens_t.tolist()
        result.sampled_token_ids = {r.request_id: t for r, t in zip(sample_reqs, tokens)}
        return result

    def _prompt_logprobs(self, out: SchedulerOutput, layout: BatchLayout, hidden: torch.Tensor,
                         result: ModelRunnerOutput) -> None:
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
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=dev)]).float()
        k = max(r.sampling_params.prompt_logprobs for r, _, _ in spans)
        entries = _logprobs(logits, torch.tensor(targets, device=dev), k)
        pos = 0
        for r, start, n in spans:
            mine = entries[pos:pos + n]
            pos += n
            for e in mine:
                e.top_ids = e.top_ids[:r.sampling_params.prompt_logprobs]
                e.top_logprobs = e.top_logprobs[:r.sampling_params.prompt_logprobs]
            # entry j is for prompt position start + 1 + j
            result.prompt_logprobs[r.request_id] = (start + 1, mine)

    def _layout(self, out: SchedulerOutput, kv: KVCacheManager):
        reqs = out.scheduled
        bs = self.block_size
        q_lens = np.array([out.num_scheduled_tokens[r.request_id] for r in reqs], dtype=np.int32)
        query_start_loc = np.zeros(len(reqs) + 1, dtype=np.int32)
        np.cumsum(q_lens, out=query_start_loc[1:])
        total = int(query_start_loc[-1])
        input_ids = np.empty(total, dtype=np.int64)
        positions = np.empty(total, dtype=np.int64)
        slot_mapping = np.empty(total, dtype=np.int64)
        seq_lens = np.empty(len(reqs), dtype=np.int32)
        tables = [kv.block_table(r.request_id) for r in reqs]
        block_tables = np.zeros((len(reqs), max(len(t) for t in tables)), dtype=np.int32)
        sample_rows, sample_reqs = [], []
        for i, (r, table) in enumerate(zip(reqs, tables)):
            start, q = r.num_computed_tokens, int(q_lens[i])
            off = int(query_start_loc[i])
            end = start + q
            input_ids[off:off + q] = r.tokens(start, end)
            pos = np.arange(start, end, dtype=np.int64)
            positions[off:off + q] = pos
            block_tables[i, :len(table)] = table
            slot_mapping[off:off + q] = block_tables[i, pos // bs].astype(np.int64) * bs + pos % bs
            seq_lens[i] = end
            if end >= r.num_tokens:  # the step reaches the request's last known token: sample
                sample_rows.append(off + q - 1)
                sample_reqs.append(r)
                for child in r.forks:  # n > 1: the other samples draw from the same logits
                    sample_rows.append(off + q - 1)
                    sample_reqs.append(child)
        layout = BatchLayout(query_start_loc, seq_lens, block_tables, slot_mapping)
        return layout, input_ids, positions, sample_rows, sample_reqs


def _prefill_layout(lens: list[int], blocks_per_seq: int, bs: int) -> BatchLayout:
    """Layout of fresh prefills, sequence i owning blocks [i*blocks_per_seq, (i+1)*blocks_per_seq)."""
    qsl = np.zeros(len(lens) + 1, dtype=np.int32)
    np.cumsum(lens, out=qsl[1:])
    tables = np.arange(len(lens) * blocks_per_seq, dtype=np.int32).reshape(len(lens), blocks_per_seq)
    slots = np.concatenate([tables[i, np.arange(n) // bs].astype(np.int64) * bs + np.arange(n) % bs
                            for i, n in enumerate(lens)])
    return BatchLayout(qsl, np.array(lens, dtype=np.int32), tables, slots)


def _logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> list[TokenLogprobs]:
    """Log-softmax of raw logits [rows, vocab]: each row's chosen token's value and rank, and the top k."""
    lp = torch.log_softmax(logits, dim=-1)
    chosen = lp.gather(1, tokens[:, None]).squeeze(1)
    rank = (lp > chosen[:, None]).sum(dim=1) + 1
    if k > 0:
        top_v, top_i = lp.topk(k, dim=-1)
        top_v, top_i = top_v.tolist(), top_i.tolist()
    else:
        top_v = top_i = [[] for _ in range(lp.shape[0])]
    return [TokenLogprobs(t, c, rk, ti, tv) for t, c, rk, ti, tv in
            zip(tokens.tolist(), chosen.tolist(), rank.tolist(), top_i, top_v)]
