"""``Worker``: one rank's shard of the model, its KV cache and CUDA graphs; runs each step's forward.

A worker knows no request objects: it keeps a persistent batch (request id -> block table) and
builds each step's layout from a ``StepInput`` (``kvforge.rank.step_input``). Every rank runs the same
forward and computes the same logits rows (a vocabulary-parallel LM head needs every rank); only
the driver's results are used, by the sampler in the engine process (docs/distributed.md).
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from kvforge.attention import BatchLayout
from kvforge.config import EngineConfig
from kvforge.errors import is_device_error
from kvforge.model.config import ModelConfig
from kvforge.model.loader import ModelSource, load_model
from kvforge.rank import parallel_state
from kvforge.rank.input_buffers import HostInputs, StagingBuffers, h2d
from kvforge.rank.memory_budget import MemoryBaseline, kv_cache_budget
from kvforge.rank.step_handle import logprob_tensors
from kvforge.rank.step_input import StepInput
from kvforge.rank.swap import CPUSwapSpace

logger = logging.getLogger(__name__)

GiB = 1 << 30
#: device memory for one slice of prompt log-probabilities (logits, log-softmax and rank mask)
PROMPT_LOGPROBS_SLICE_BYTES = 256 << 20


@dataclass
class WorkerSpec:
    """Everything a rank needs to build its worker (picklable: sent to spawned processes and actors)."""

    config: EngineConfig
    source: ModelSource
    model_config: ModelConfig
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    init_method: str | None = None  # torch.distributed rendezvous (tcp://host:port) when the world is > 1
    init_timeout_s: float = 120.0  # collectives and the rendezvous give up after this long

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def driver_rank(self) -> int:
        """The first tensor-parallel rank of the last pipeline stage: it runs in the engine process."""
        return (self.pipeline_parallel_size - 1) * self.tensor_parallel_size

    def device_for(self, local_rank: int) -> torch.device:
        """CUDA: the engine's device index plus the rank's place on its node; CPU: the CPU."""
        base = self.config.torch_device
        if base.type != "cuda":
            return base
        return torch.device("cuda", (base.index or 0) + local_rank)


@dataclass
class ForwardOutput:
    """The driver's results of a step: device tensors the sampler reads."""

    buf: HostInputs  # the staging set the step was laid out in (the sampled tokens come back into it)
    input_ids: torch.Tensor  # [rows] the step's input ids (placeholders filled)
    sample_rows: torch.Tensor | None  # the sampled rows, None when they are rows 0 .. n - 1
    logits: torch.Tensor | None  # float32 [num_sample_rows, vocab]
    head: torch.Tensor | None  # a verification graph's greedy verification


class Worker:
    """One rank: builds its model shard inside its tensor-parallel group and runs forwards."""

    def __init__(self, spec: WorkerSpec, rank: int, local_rank: int | None = None):
        from kvforge.builder import component, select_attention_backend
        from kvforge.plugin_manager import get_plugin_manager

        self.spec, self.rank = spec, rank
        config, mc = spec.config, spec.model_config
        self.device = spec.device_for(rank if local_rank is None else local_rank)
        self.memory_baseline = None  # kvforge.rank.memory_budget.MemoryBaseline on CUDA: before anything of ours
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            self.memory_baseline = MemoryBaseline.take(self.device)
        self.group, self.world, self.stage = init_world(spec, rank, self.device)
        torch.manual_seed(config.seed)
        dtype = config.torch_dtype
        pm = get_plugin_manager()
        kv_cache_dtype = config.torch_kv_cache_dtype
        from kvforge.model.interface import attention_features

        self.attn_name, self.attn_cls = select_attention_backend(
            pm, config.attention_backend, device=self.device, dtype=dtype, head_size=mc.head_dim,
            block_size=config.block_size, kv_cache_dtype=kv_cache_dtype,
            features=attention_features(pm.get("model", mc.architecture), mc))
        shard = parallel_state.head_shard(mc.num_attention_heads, mc.num_key_value_heads, self.group.size, self.group.rank)
        self.attn = component(pm, "attention_backend", self.attn_name, config, num_heads=shard.num_heads,
                              num_kv_heads=shard.num_kv_heads, head_size=mc.head_dim, scale=mc.attention_scale,
                              block_size=config.block_size, dtype=dtype, device=self.device,
                              kv_cache_dtype=kv_cache_dtype)
        self.quant = None  # kvforge.model.quantization.QuantizationMethod
        if config.quantization is not None:
            self.quant = component(pm, "quantization_method", config.quantization, config,
                                   engine_config=config, model_config=mc)
        with parallel_state.building(self.group, self.stage):
            self.model = load_model(spec.source, mc, self.attn, dtype, self.device, seed=config.seed,
                                    quant=self.quant)
        self.lora = None  # kvforge.lora.slots.LoRAManager with enable_lora
        if config.enable_lora:
            from kvforge.lora.slots import LoRAManager

            self.lora = LoRAManager(self.model, max_loras=config.max_loras, max_lora_rank=config.max_lora_rank,
                                    max_tokens=config.max_num_batched_tokens, num_layers=mc.num_hidden_layers,
                                    device=self.device)
        start, end = self.stage.layers(mc.num_hidden_layers)
        self.first_layer = start
        self.num_layers = end - start  # this stage's layers: its KV cache holds only theirs
        self.hidden_size, self.dtype = mc.hidden_size, dtype
        self.vocab_size = mc.vocab_size
        self.block_size = self.attn.block_size
        self.kv_caches: list[torch.Tensor] = []
        self.graphs = None  # a CUDAGraphRunner once captured
        self.swap_space: CPUSwapSpace | None = None
        self.extra_bytes_per_block = 0  # the driver's drafter KV cache shares the block ids
        self.tables: dict[str, list[int]] = {}  # the persistent batch: request -> block table
        # the KV manager may give back blocks behind the window (kvforge.kv_cache.NULL_BLOCK entries)
        self.sliding_window_kv = mc.kv_sliding_window is not None
        self._profiler: Any = None  # a torch.profiler trace between start_profile and stop_profile

    def ready(self) -> dict[str, Any]:
        """What the engine needs to know of a rank once it is built."""
        return {"rank": self.rank, "device": str(self.device), "attention_backend": self.attn_name,
                "num_heads": self.attn.num_heads, "num_kv_heads": self.attn.num_kv_heads,
                "stage": self.stage.rank, "layers": list(self.stage.layers(self.spec.model_config.num_hidden_layers))}

    def close(self) -> None:
        """Leave the process groups (their connections close; peers still in a collective get an error)."""
        # NCCL's shutdown waits for its peers (a rank already stopped would hang it): abort instead
        how = "abort" if self.device.type == "cuda" else "shutdown"
        for g in {id(g): g for g in (self.group, self.world) if g.size > 1}.values():
            if hasattr(g.group, how):
                try:
                    getattr(g.group, how)()
                except Exception:  # already broken: nothing left to release
                    pass

    def release(self) -> None:
        """Drop everything this rank holds on its device: CUDA graphs and their memory pool, the KV cache,
        the weights, the swap space and input buffers (the caller then empties the allocator's cache,
        ``memory_budget.release_device_memory``), after leaving the process groups (:meth:`close`).
        Idempotent; the worker cannot run afterwards."""
        self.close()
        # NOTE: the graphs first: they hold the model and the KV cache, and their pool holds activations
        self.graphs = None
        self.kv_caches = []
        self.model = self.lora = self.swap_space = self.staging = None
        self.input_ids = self.positions = None

    def start_profile(self) -> None:
        """Start a ``torch.profiler`` trace of this rank (host and, on CUDA, device activity)."""
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        self._profiler = profile(activities=acts)
        self._profiler.start()

    def stop_profile(self, trace_dir: str | None = None, row_limit: int = 12) -> str:
        """Stop the trace; write ``rank<r>.json`` (Chrome trace) into ``trace_dir`` if given. Returns the
        rank's busiest operations, by device time then by host time, as text."""
        prof, self._profiler = self._profiler, None
        prof.stop()
        if trace_dir is not None:
            os.makedirs(trace_dir, exist_ok=True)
            prof.export_chrome_trace(os.path.join(trace_dir, f"rank{self.rank}.json"))
        avg = prof.key_averages()
        keys = (["self_cuda_time_total"] if self.device.type == "cuda" else []) + ["self_cpu_time_total"]
        return f"rank {self.rank}\n" + "\n".join(avg.table(sort_by=k, row_limit=row_limit) for k in keys)

    def batch_state(self) -> dict[str, int]:
        """The persistent batch: requests this rank holds block tables for, and their blocks."""
        return {"requests": len(self.tables), "blocks": sum(len(t) for t in self.tables.values())}

    # -- LoRA adapters (the engine's kvforge.lora.registry) ----------------------------------------
    def add_lora(self, request: Any) -> str | None:
        """Load an adapter into this rank's host memory; the problem as text (nothing kept) if it is bad.

        NOTE: a rank reports what a request brings instead of raising, which would end the rank (and the
        engine with it): only a device-level error (``is_device_error``) is raised."""
        try:
            self.lora.add(request)
        except Exception as exc:
            if is_device_error(exc):
                raise
            return str(exc) if isinstance(exc, ValueError) else f"lora_request.lora_path: {type(exc).__name__}: {exc}"
        return None

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.lora.remove(lora_int_id)

    # -- KV cache sizing -------------------------------------------------------------------------
    def bytes_per_block(self) -> int:
        shape = self.attn.kv_cache_shape(1)
        return math.prod(shape) * self.attn.kv_cache_dtype.itemsize * self.num_layers + self.extra_bytes_per_block

    def determine_num_blocks(self, *, num_blocks_override: int | None, kv_cache_memory_gib: float | None,
                             gpu_memory_utilization: float, max_num_batched_tokens: int,
                             max_num_seqs: int, max_model_len: int) -> int:
        """KV blocks this rank can hold: an override; a memory budget; or, on CUDA, what a profiled peak
        forward leaves of ``gpu_memory_utilization`` times the device memory. The engine takes the
        minimum over the ranks."""
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
        budget = kv_cache_budget(self.device, self.memory_baseline, peak, gpu_memory_utilization, self.rank)
        num_blocks = int(budget // per_block)
        if num_blocks < 1:
            own = (peak - self.memory_baseline.allocated) / GiB
            raise ValueError(
                f"gpu_memory_utilization={gpu_memory_utilization} leaves no memory for the KV cache on rank "
                f"{self.rank} (this engine's model and peak activations take {own:.2f} GiB; "
                f"{torch.cuda.mem_get_info(self.device)[0] / GiB:.2f} GiB of the device is free)")
        return num_blocks

    @torch.inference_mode()
    def profile_peak_memory(self, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int) -> int:
        """Peak bytes the process allocated during one forward of a full token budget plus sampling of a
        full batch, the profile's KV cache excluded (other engines' tensors in this process included:
        ``kvforge.rank.memory_budget`` subtracts them)."""
        bs = self.block_size
        seq_len = min(max_num_batched_tokens, max_model_len)
        num_seqs = -(-max_num_batched_tokens // seq_len)
        blocks_per_seq = -(-seq_len // bs)
        caches = self.attn.allocate_kv_cache(num_seqs * blocks_per_seq, self.num_layers, self.first_layer)
        cache_bytes = sum(c.numel() * c.element_size() for c in caches)
        lens = [seq_len] * (num_seqs - 1) + [max_num_batched_tokens - seq_len * (num_seqs - 1)]
        layout = prefill_layout(lens, blocks_per_seq, bs)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        meta = self.attn.build_metadata(layout)
        n = layout.num_tokens
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        pos = torch.from_numpy(np.concatenate([np.arange(x) for x in lens])).to(self.device)
        inter = None
        if not self.stage.is_first:  # a stage's input is the stage before's (hidden, residual)
            inter = tuple(torch.zeros((n, self.hidden_size), dtype=self.dtype, device=self.device) for _ in range(2))
        hidden = self.model(ids, pos, caches, meta, **({"intermediate": inter} if inter else {}))
        if self.stage.is_last:
            rows = min(max(max_num_seqs, self.prompt_logprobs_rows()), n)  # sampling, or a prompt-logprobs slice
            logits = self.model.compute_logits(hidden[:rows]).float()
            torch.softmax(logits, dim=-1).sort(dim=-1)
            logprob_tensors(logits, torch.zeros(rows, dtype=torch.long, device=self.device), 20)
            del logits
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - cache_bytes
        del caches, hidden, meta
        torch.cuda.empty_cache()
        return peak

    def initialize_cache(self, num_blocks: int, max_num_batched_tokens: int, max_num_seqs: int,
                         max_model_len: int) -> None:
        """Allocate the KV cache and the step's staging buffers (``kvforge.rank.input_buffers``)."""
        self.kv_caches = self.attn.allocate_kv_cache(num_blocks, self.num_layers, self.first_layer)
        max_blocks = -(-max_model_len // self.block_size)
        self.staging = StagingBuffers(max_num_batched_tokens, max_num_seqs, max_blocks, self.device)
        self.input_ids = torch.zeros(max_num_batched_tokens, dtype=torch.long, device=self.device)
        self.positions = torch.zeros(max_num_batched_tokens, dtype=torch.long, device=self.device)

    def capture_cuda_graphs(self, max_num_seqs: int, max_model_len: int, query_lens: tuple[int, ...] = (1,)) -> float:
        """Capture graphs of uniform steps (decode, and verification of ``query_lens`` tokens per
        sequence); returns the seconds. Every rank captures the same graphs in the same order."""
        from kvforge.rank.cuda_graphs import CUDAGraphRunner

        self.graphs = CUDAGraphRunner(self.model, self.attn, self.kv_caches, max_num_seqs=max_num_seqs,
                                      max_model_len=max_model_len, device=self.device, query_lens=query_lens,
                                      verify_head=True,
                                      before_capture=self.lora.capture_batch if self.lora is not None else None)
        return self.graphs.capture()

    def initialize_swap_space(self, swap_space_gib: float) -> int:
        """Size the CPU swap pool (allocated on its first use); returns its number of blocks."""
        num_cpu_blocks = int(swap_space_gib * GiB) // self.bytes_per_block()
        self.swap_space = CPUSwapSpace(self.attn, self.num_layers, num_cpu_blocks)
        return num_cpu_blocks

    def swap_blocks(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """Copy ``(device, cpu)`` blocks to the CPU pool and ``(cpu, device)`` blocks back, every layer.

        NOTE: called before any other cache write of the step (see ``kvforge.rank.swap``).
        """
        if swap_out or swap_in:
            if self.swap_space is None:
                raise ValueError("swap: no CPU swap pool (initialize_swap_space was not called)")
            self.swap_space.swap(self.kv_caches, swap_out, swap_in)

    def prompt_logprobs_rows(self) -> int:
        """Prompt positions whose log-probabilities are computed at once: about
        ``PROMPT_LOGPROBS_SLICE_BYTES`` of float32 logits and their temporaries."""
        return max(1, PROMPT_LOGPROBS_SLICE_BYTES // (self.vocab_size * 12))

    # -- one step --------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, step: StepInput, prev_tokens: torch.Tensor | None = None,
                prompt_sink: Callable[[int, torch.Tensor], None] | None = None) -> ForwardOutput | None:
        """Apply the step's bookkeeping, then queue its forward and logits; returns at once.

        ``prev_tokens`` (the driver): the step in flight's sampled tokens, which fill this step's
        placeholders; other ranks receive them by broadcast. ``prompt_sink(start, logits)`` (the
        driver) takes each slice of prompt-position logits.
        """
        tables = self.tables
        for rid in step.dropped:
            tables.pop(rid, None)
        for rid, start, ids in step.table_updates:
            if start == 0:
                tables[rid] = list(ids)
            else:
                table = tables[rid]
                del table[start:]
                table.extend(ids)
        self.swap_blocks(step.blocks_to_swap_out, step.blocks_to_swap_in)  # even in a step with no batch
        if not step.req_ids:
            return None
        self.attn.copy_blocks(self.kv_caches, step.blocks_to_copy)
        buf, layout = self._layout(step)
        dev = self.device
        num_rows = layout.num_tokens  # with graph padding
        if self.lora is not None:
            self.lora.prepare(step.lora_ids, step.query_lens, num_rows, graph=step.graph_key is not None)
        pinned = buf.tensors
        if step.graph_key is not None:
            ids_dev, pos_dev = self.graphs.input_ids[:num_rows], self.graphs.positions[:num_rows]
        else:
            ids_dev, pos_dev = self._input_tensors(num_rows)
        ids_dev.copy_(pinned["input_ids"][:num_rows], non_blocking=True)
        pos_dev.copy_(pinned["positions"][:num_rows], non_blocking=True)
        if step.fill_dst is not None:  # placeholders: the previous step's sampled tokens, on the device
            fills = len(step.fill_dst)
            tokens = self._prev_tokens(step.num_prev_tokens, prev_tokens)
            dst = pinned["fill_dst"][:fills].to(dev, non_blocking=True)
            src = pinned["fill_src"][:fills].to(dev, non_blocking=True)
            ids_dev[dst] = tokens[src]
        head = None
        if step.graph_key is not None:  # a uniform step (decode, or verification of k drafts each)
            hidden = self.graphs.replay(layout)[:step.num_tokens]
            head = self.graphs.head(step.graph_key)
        elif self.stage.size == 1:
            meta = self.attn.build_metadata(layout)
            hidden = self.model(ids_dev, pos_dev, self.kv_caches, meta)  # [num_tokens, hidden]
        else:
            hidden = self._stage_forward(ids_dev, pos_dev, self.attn.build_metadata(layout))
            if hidden is None:  # not the last stage: its part is done
                return None
        if step.prompt_rows is not None:
            self._prompt_logits(hidden, step.prompt_rows, prompt_sink)
        rows = logits = None
        n = step.num_sample_rows
        if n and step.sample_rows is not None:
            rows = pinned["sample_rows"][:n].to(dev, non_blocking=True)
        if n and step.compute_logits:
            logits = self.model.compute_logits(hidden[:n] if rows is None else hidden[rows]).float()
        return ForwardOutput(buf, ids_dev, rows, logits, head)

    def _stage_forward(self, ids: torch.Tensor, pos: torch.Tensor, meta: Any) -> torch.Tensor | None:
        """One pipeline stage: the first embeds, the others receive (hidden, residual) from the same
        tensor-parallel rank of the stage before; all but the last send theirs on. Returns the last
        stage's hidden states, None elsewhere."""
        tp, world = self.spec.tensor_parallel_size, self.world.group
        inter = None
        if not self.stage.is_first:
            inter = tuple(torch.empty((len(ids), self.hidden_size), dtype=self.dtype, device=self.device)
                          for _ in range(2))
            for t in inter:
                world.recv([t], self.rank - tp, 0).wait()
        out = self.model(ids, pos, self.kv_caches, meta, intermediate=inter)
        if self.stage.is_last:
            return out
        for t in out:
            world.send([t.contiguous()], self.rank + tp, 0).wait()
        return None

    def _prev_tokens(self, n: int, tokens: torch.Tensor | None) -> torch.Tensor:
        """The step in flight's ``n`` sampled tokens on this rank: the driver's own, broadcast to the others."""
        if self.world.size == 1:
            return tokens
        driver = self.spec.driver_rank
        buf = tokens.contiguous() if self.rank == driver else torch.empty(n, dtype=torch.long, device=self.device)
        self.world.broadcast(buf, driver)
        return buf

    def _prompt_logits(self, hidden: torch.Tensor, rows: np.ndarray, sink: Callable | None) -> None:
        # NOTE: [rows, vocab] float32 logits for a whole prompt chunk could take gigabytes: compute
        # them a bounded slice at a time (the memory profile runs one slice of this size)
        rows_dev = h2d(rows, torch.long, self.device)
        step = self.prompt_logprobs_rows()
        for i in range(0, len(rows), step):
            logits = self.model.compute_logits(hidden[rows_dev[i:i + step]]).float()
            if sink is not None:
                sink(i, logits)

    def _input_tensors(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        if n > self.input_ids.shape[0]:
            self.input_ids = torch.zeros(n, dtype=torch.long, device=self.device)
            self.positions = torch.zeros(n, dtype=torch.long, device=self.device)
        return self.input_ids[:n], self.positions[:n]

    def _layout(self, step: StepInput) -> tuple[HostInputs, BatchLayout]:
        """Lay the step out in the next set of staging buffers: vectorised, no per-step allocation.

        With ``graph_key`` = (size, q) (a uniform batch replayed as a CUDA graph), the sequences past
        the batch are padding of q tokens each: context q, block 0, slot -1 (nothing written), and the
        block tables are as wide as the captured graph's.
        """
        n = len(step.req_ids)
        bs = self.block_size
        q_lens, starts = step.query_lens, step.num_computed
        tables = [self.tables[rid] for rid in step.req_ids]
        total = step.num_tokens
        graph_key = step.graph_key
        rows, q = graph_key if graph_key is not None else (n, 0)
        num_rows = total if graph_key is None else rows * q
        width = self.graphs.max_blocks if graph_key is not None else max(len(t) for t in tables)
        fills = 0 if step.fill_dst is None else len(step.fill_dst)
        buf = self.staging.next(num_rows, max(rows, step.num_sample_rows, fills), width)
        b = buf.np
        qsl = b["query_start_loc"][:rows + 1]
        qsl[0] = 0
        np.cumsum(q_lens, out=qsl[1:n + 1])
        ids = b["input_ids"][:num_rows]
        ids[:total] = step.input_ids
        positions = b["positions"][:num_rows]
        np.subtract(np.arange(total), np.repeat(qsl[:n] - starts, q_lens), out=positions[:total])
        seq_lens = b["seq_lens"][:rows]
        seq_lens[:n] = starts + q_lens
        block_tables = buf.block_tables(rows, width)
        for i, t in enumerate(tables):
            block_tables[i, :len(t)] = t
        if self.sliding_window_kv:  # blocks given back behind the window (NULL_BLOCK) read as block 0
            np.maximum(block_tables, 0, out=block_tables)
        slots = b["slot_mapping"][:num_rows]
        seq_of_token = np.repeat(np.arange(n), q_lens)
        slots[:total] = block_tables[seq_of_token, positions[:total] // bs].astype(np.int64) * bs + positions[:total] % bs
        if num_rows > total:  # graph padding sequences: q tokens each
            qsl[n + 1:] = total + np.arange(1, rows - n + 1) * q
            ids[total:] = 0
            positions[total:] = 0
            seq_lens[n:] = q
            slots[total:] = -1
        if fills:
            b["fill_dst"][:fills] = step.fill_dst
            b["fill_src"][:fills] = step.fill_src
        if step.sample_rows is not None:
            b["sample_rows"][:step.num_sample_rows] = step.sample_rows
        return buf, BatchLayout(qsl, seq_lens, block_tables, slots)


def init_world(spec: WorkerSpec, rank: int, device: torch.device
               ) -> tuple[parallel_state.TPGroup, parallel_state.TPGroup, parallel_state.PPStage]:
    """Join the engine's ranks (NCCL on CUDA, gloo on the CPU; the driver serves the rendezvous).
    Returns this rank's tensor-parallel group, the world group (stage-to-stage sends, the driver's
    broadcasts) and its pipeline stage. World rank = stage * tensor_parallel_size + tensor-parallel rank."""
    tp, world = spec.tensor_parallel_size, spec.world_size
    stage = parallel_state.PPStage(rank // tp, spec.pipeline_parallel_size)
    if world == 1:
        return parallel_state.SINGLE, parallel_state.SINGLE, stage
    store = parallel_state.rendezvous(spec.init_method, rank, world, spec.init_timeout_s, host_rank=spec.driver_rank)
    world_pg = parallel_state.new_process_group(store, "world/", rank, world, device, spec.init_timeout_s)
    world_group = parallel_state.TPGroup(rank, world, world_pg)
    if tp == world:
        return world_group, world_group, stage
    tp_pg = parallel_state.new_process_group(store, f"tp{stage.rank}/", rank % tp, tp, device, spec.init_timeout_s)
    return parallel_state.TPGroup(rank % tp, tp, tp_pg), world_group, stage


def prefill_layout(lens: list[int], blocks_per_seq: int, bs: int) -> BatchLayout:
    """Layout of fresh prefills, sequence i owning blocks [i*blocks_per_seq, (i+1)*blocks_per_seq)."""
    qsl = np.zeros(len(lens) + 1, dtype=np.int32)
    np.cumsum(lens, out=qsl[1:])
    tables = np.arange(len(lens) * blocks_per_seq, dtype=np.int32).reshape(len(lens), blocks_per_seq)
    slots = np.concatenate([tables[i, np.arange(n) // bs].astype(np.int64) * bs + np.arange(n) % bs
                            for i, n in enumerate(lens)])
    return BatchLayout(qsl, np.array(lens, dtype=np.int32), tables, slots)
