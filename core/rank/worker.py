"""``Worker``: one rank's shard of the model, its KV cache and CUDA graphs; runs each step's forward.

A worker knows no request objects: it keeps a persistent batch (request id -> block table) and
builds each step's layout from a ``StepInput`` (``kvforge.rank.step_input``). Every rank runs the same
forward and computes the same logits rows (a vocabulary-parallel LM head needs every rank); only
the driver's results are used, by the sampler in the engine process (docs/distributed.md).

The worker composes what each of its jobs' modules does: joining the ranks
(``parallel_state.init_world``), building the model (``model_build``), sizing the KV cache
(``kv_sizing``), laying out a step (``batch_layout``), the stages' hand-over (``stage_forward``),
prompt logits (``prompt_logits``), CUDA graphs (``cuda_graphs``), swapping (``swap``), LoRA
(``kvforge.lora.slots``) and tracing (``profiler``). Its public methods are what executors call on
every rank (``Executor.collective_rpc``), by name.
"""
from __future__ import annotations

import gc
import logging
from typing import TYPE_CHECKING, Any, Callable, Sequence, TypeVar

import torch

from kvforge.attention import BatchLayout
from kvforge.builder import kv_connector
from kvforge.errors import is_device_error
from kvforge.model.interface import capabilities_of
from kvforge.multimodal.profile import encoder_cache_bytes, profile_features
from kvforge.plugin_manager import get_plugin_manager
from kvforge.rank import kv_sizing
from kvforge.rank.batch_layout import PersistentBatch, lay_out_step
from kvforge.rank.cuda_graphs import CUDAGraphRunner
from kvforge.rank.input_buffers import HostInputs, StepBuffers
from kvforge.rank.memory_budget import MemoryBaseline
from kvforge.rank.model_build import RankModel, build_model, hidden_states, quantization_method
from kvforge.rank.parallel_state import init_world
from kvforge.rank.piecewise_graphs import PiecewiseGraphs, PiecewiseUnsafe
from kvforge.rank.profiler import RankProfiler
from kvforge.rank.prompt_logits import prompt_logits, prompt_logprobs_rows
from kvforge.rank.stage_forward import driver_tokens, fill_placeholders, stage_forward, stage_replay
from kvforge.rank.step_input import ForwardOutput, StepInput
from kvforge.rank.swap import CPUSwapSpace, StoreCopies, tier_copies, transfer
from kvforge.rank.worker_spec import WorkerSpec

if TYPE_CHECKING:
    from kvforge.kv_connector import TierStore
    from kvforge.kv_tier import TierTransfers
    from kvforge.lora.request import LoRARequest
    from kvforge.lora.slots import LoRAManager

logger = logging.getLogger(__name__)
T = TypeVar("T")
RELEASED = "it was released: it holds no model"
NO_BUFFERS = "no step buffers (initialize_cache was not called, or the rank was released)"


class Worker:
    """One rank: builds its model shard inside its tensor-parallel group and runs forwards."""

    def __init__(self, spec: WorkerSpec, rank: int, local_rank: int | None = None):
        self.spec, self.rank = spec, rank
        config, mc = spec.config, spec.model_config
        self.device = spec.device_for(rank if local_rank is None else local_rank)
        self.memory_baseline: MemoryBaseline | None = None  # on CUDA: before anything of ours
        #: False once :meth:`close` could not leave the process groups in time (a collective stuck on a
        #: rank that is gone: the device's queued work never ends)
        self.left_groups = True
        self.closed = False  # close() ran
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            self.memory_baseline = MemoryBaseline.take(self.device)
        self.groups = init_world(rank, self.device, tensor_parallel_size=spec.tensor_parallel_size,
                                 pipeline_parallel_size=spec.pipeline_parallel_size, init_method=spec.init_method,
                                 timeout_s=spec.init_timeout_s,
                                 custom_all_reduce=not config.disable_custom_all_reduce)
        self.group, self.world, self.stage = self.groups.tp, self.groups.world, self.groups.stage
        torch.manual_seed(config.seed)
        pm = get_plugin_manager()
        built = build_model(pm, spec.source, mc, attention_backend=config.attention_backend, device=self.device,
                            dtype=config.torch_dtype, block_size=config.block_size,
                            kv_cache_dtype=config.torch_kv_cache_dtype, group=self.group, stage=self.stage,
                            quant=quantization_method(pm, config.quantization, mc, config), seed=config.seed,
                            plugin_options=config.plugins)
        self.attn, self.attn_name, self.attn_cls, self.quant = built.attn, built.attn_name, built.attn_cls, built.quant
        self.model: RankModel | None = built.model  # None once released
        self.lora: LoRAManager | None = self._lora_manager(built.module) if config.enable_lora else None
        start, end = self.stage.layers(mc.num_hidden_layers)
        self.first_layer, self.num_layers = start, end - start  # this stage's layers: its KV cache holds only theirs
        self.hidden_size, self.dtype, self.vocab_size = mc.hidden_size, config.torch_dtype, mc.vocab_size
        self.block_size = self.attn.block_size
        self.kv_caches: list[torch.Tensor] = []
        self.graphs: CUDAGraphRunner | None = None  # once captured
        self.piecewise: PiecewiseGraphs | None = None  # mixed steps' graphs, once captured
        self.swap_space: CPUSwapSpace | None = None
        #: the KV tiers' stores of prefix-cached blocks, in chain order (initialize_kv_tier; None: a tier without slots)
        self.kv_tier: list[TierStore | None] | None = None
        self.buffers: StepBuffers | None = None  # once the cache is initialized
        self.extra_bytes_per_block = 0  # the driver's drafter KV cache shares the block ids
        self.batch = PersistentBatch()
        #: multimodal: encoded items' embedding rows by content hash (the engine's EncoderCachePlan decides)
        self.encoder_cache: dict[int, torch.Tensor] = {}
        # the KV manager may give back blocks behind the window (kvforge.kv_cache.NULL_BLOCK entries)
        self.sliding_window_kv = mc.kv_sliding_window is not None
        self.profiler = RankProfiler(rank, self.device)

    def _lora_manager(self, module: torch.nn.Module) -> LoRAManager:
        from kvforge.lora.slots import LoRAManager

        config = self.spec.config
        return LoRAManager(module, max_loras=config.max_loras, max_lora_rank=config.max_lora_rank,
                           max_tokens=config.max_num_batched_tokens,
                           num_layers=self.spec.model_config.num_hidden_layers, device=self.device)

    def ready(self) -> dict[str, object]:
        """What the engine needs to know of a rank once it is built: ``rank``, ``device``,
        ``attention_backend``, ``num_heads`` / ``num_kv_heads`` (its share), ``stage``, ``layers`` ([start, end))."""
        return {"rank": self.rank, "device": str(self.device), "attention_backend": self.attn_name,
                "num_heads": self.attn.num_heads, "num_kv_heads": self.attn.num_kv_heads,
                "stage": self.stage.rank, "layers": list(self.stage.layers(self.spec.model_config.num_hidden_layers))}

    def close(self) -> None:
        """Leave the process groups (their connections close; peers still in a collective get an error),
        within ``parallel_state.LEAVE_TIMEOUT_S``. The CUDA graphs go first (the worker cannot replay them
        afterwards anyway): NCCL's abort blocks while a graph that captured one of its collectives lives,
        which hung a tensor-parallel engine's shutdown on the GPUs. Idempotent: :meth:`release` calls it
        again after the executor's shutdown, and an abort stuck on a dead peer must cost its bound once."""
        if self.closed:
            return
        self.closed = True
        if (self.graphs is not None or self.piecewise is not None) and self.groups.world.size > 1:
            self.graphs = self.piecewise = None
            if self.device.type == "cuda":
                gc.collect()  # a graph held in a reference cycle is destroyed only by a collection
        for store in self.kv_tier or ():
            if store is not None:
                store.close()  # a disk tier's writes finish: a restarted engine finds them
        self.left_groups = self.groups.leave(self.device)

    def release(self) -> None:
        """Drop everything this rank holds on its device: CUDA graphs and their memory pool, the KV cache,
        the weights, the swap space and input buffers (the caller then empties the allocator's cache,
        ``memory_budget.release_device_memory``), after leaving the process groups (:meth:`close`).
        Idempotent; the worker cannot run afterwards."""
        self.close()
        # NOTE: the graphs first: they hold the model and the KV cache, and their pool holds activations
        self.graphs = self.piecewise = None
        self.kv_caches = []
        self.encoder_cache = {}
        self.model = self.lora = self.swap_space = self.kv_tier = self.buffers = None

    def start_profile(self) -> None:
        """Start a ``torch.profiler`` trace of this rank (host and, on CUDA, device activity)."""
        self.profiler.start()

    def stop_profile(self, trace_dir: str | None = None, row_limit: int = 12) -> str:
        """Stop the trace; write ``rank<r>.json`` (Chrome trace) into ``trace_dir`` if given. Returns the
        rank's busiest operations, by device time then by host time, as text."""
        return self.profiler.stop(trace_dir, row_limit)

    def batch_state(self) -> dict[str, int]:
        """The persistent batch: requests this rank holds block tables for, and their blocks."""
        return self.batch.state()

    # -- LoRA adapters (the engine's kvforge.lora.registry) ----------------------------------------
    def add_lora(self, request: LoRARequest) -> str | None:
        """Load an adapter into this rank's host memory; the problem as text (nothing kept) if it is bad.

        NOTE: a rank reports what a request brings instead of raising, which would end the rank (and the
        engine with it): only a device-level error (``is_device_error``) is raised."""
        if self.lora is None:
            return "lora_request: this engine serves no LoRA adapters (enable_lora is off)"
        try:
            self.lora.add(request)
        except Exception as exc:
            if is_device_error(exc):
                raise
            return str(exc) if isinstance(exc, ValueError) else f"lora_request.lora_path: {type(exc).__name__}: {exc}"
        return None

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.lora.remove(lora_int_id) if self.lora is not None else False

    # -- KV cache sizing (kvforge.rank.kv_sizing) --------------------------------------------------
    def bytes_per_block(self) -> int:
        return kv_sizing.bytes_per_block(self.attn, self.num_layers) + self.extra_bytes_per_block

    def determine_num_blocks(self, *, num_blocks_override: int | None, kv_cache_memory_gib: float | None,
                             gpu_memory_utilization: float, max_num_batched_tokens: int,
                             max_num_seqs: int, max_model_len: int) -> int:
        """KV blocks this rank can hold: an override; a memory budget; or, on CUDA, what a profiled peak
        forward leaves of ``gpu_memory_utilization`` times the device memory. The engine takes the
        minimum over the ranks."""
        want = kv_sizing.KVCacheRequest(num_blocks_override, kv_cache_memory_gib, gpu_memory_utilization,
                                        max_num_batched_tokens, max_num_seqs, max_model_len)
        return kv_sizing.num_kv_blocks(
            want, self.bytes_per_block(), self.block_size, self.device, self.memory_baseline,
            lambda: self.profile_peak_memory(max_num_batched_tokens, max_num_seqs, max_model_len), self.rank)

    def profile_peak_memory(self, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int) -> int:
        """Peak bytes of one forward of a full token budget plus sampling of a full batch (or one
        prompt-logprobs slice), the profile's KV cache excluded (``kv_sizing.profile_peak_memory``)."""
        model = _held(self.model, self.rank, RELEASED)
        rank = kv_sizing.ProfiledRank(model, self.attn, self.stage, self.first_layer, self.num_layers,
                                      self.hidden_size, self.dtype, self.device)
        encode, extra = None, 0
        features = self.profile_features(max_num_batched_tokens, max_num_seqs)
        if features:  # a multimodal model: one step's costliest encoder work, and its encoder cache
            mm: Any = model
            encode = lambda: mm.embed_multimodal(features)  # noqa: E731
            extra = encoder_cache_bytes(features, self.hidden_size, self.dtype.itemsize)
        return kv_sizing.profile_peak_memory(rank, max_num_batched_tokens, max_model_len,
                                             max(max_num_seqs, self.prompt_logprobs_rows()), encode, extra)

    def profile_features(self, max_num_batched_tokens: int, max_num_seqs: int) -> list:
        """The items the memory profile encodes (``kvforge.multimodal.profile``); none for a text model."""
        spec, model = self.spec, _held(self.model, self.rank, RELEASED)
        if not capabilities_of(type(model)).modalities:
            return []
        source = spec.source
        processor = type(model).processor(spec.model_config, source.path if source.kind == "hf_dir" else None)  # type: ignore[attr-defined]
        return profile_features(processor, max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                                limits=spec.config.limit_mm_per_prompt)

    def initialize_cache(self, num_blocks: int, max_num_batched_tokens: int, max_num_seqs: int,
                         max_model_len: int) -> None:
        """Allocate the KV cache and the step's buffers (``kvforge.rank.input_buffers``)."""
        self.kv_caches = self.attn.allocate_kv_cache(num_blocks, self.num_layers, self.first_layer)
        max_blocks = -(-max_model_len // self.block_size)
        self.buffers = StepBuffers(max_num_batched_tokens, max_num_seqs, max_blocks, self.device)

    def capture_cuda_graphs(self, max_num_seqs: int, max_model_len: int, query_lens: tuple[int, ...] = (1,),
                            decode: bool = True, piecewise_tokens: int = 0) -> float:
        """Capture graphs of uniform steps (``decode``: decode, and verification of ``query_lens`` tokens
        per sequence), then piecewise graphs of mixed steps up to ``piecewise_tokens`` tokens (0: none;
        ``kvforge.rank.piecewise_graphs``); returns the seconds. Every rank captures the same graphs in
        the same order."""
        model = _held(self.model, self.rank, RELEASED)
        elapsed = 0.0
        if decode:
            self.graphs = CUDAGraphRunner(model, self.attn, self.kv_caches, max_num_seqs=max_num_seqs,
                                          max_model_len=max_model_len, device=self.device, query_lens=query_lens,
                                          verify_head=True,
                                          before_capture=self.lora.capture_batch if self.lora is not None else None,
                                          stage=self.stage, hidden_size=self.hidden_size, dtype=self.dtype)
            elapsed += self.graphs.capture()
        if piecewise_tokens > 0 and self.stage.size == 1 and self.lora is None:
            stream = self.graphs.stream if self.graphs is not None else torch.cuda.Stream(device=self.device)
            pool = self.graphs.pool if self.graphs is not None else None
            piecewise = PiecewiseGraphs(model, self.attn, self.kv_caches, max_tokens=piecewise_tokens,
                                        device=self.device, stream=stream, pool=pool)
            try:
                elapsed += piecewise.capture()
                self.piecewise = piecewise
            except PiecewiseUnsafe as exc:  # the model reads attention metadata itself: mixed steps stay eager
                logger.info("mixed steps run eagerly: %s", exc)
        return elapsed

    def initialize_swap_space(self, swap_space_gib: float) -> int:
        """Size the CPU swap pool (allocated on its first use); returns its number of blocks."""
        num_cpu_blocks = int(swap_space_gib * kv_sizing.GiB) // self.bytes_per_block()
        self.swap_space = CPUSwapSpace(self.attn, self.num_layers, num_cpu_blocks)
        return num_cpu_blocks

    def initialize_kv_tier(self, connectors: Sequence[str]) -> list[int]:
        """This rank's stores of the KV connectors ``connectors``, a chain fastest first
        (``kvforge.kv_connector``: host memory is allocated on first use); each one's number of slots."""
        pm, bytes_per_block = get_plugin_manager(), self.bytes_per_block()
        stores: list[TierStore | None] = []
        slots = []
        for name in connectors:
            tier = kv_connector(pm, name, self.spec.config)
            n = tier.slots(bytes_per_block)
            stores.append(tier.store(self.attn, self.num_layers, n, self.rank) if n else None)
            slots.append(n)
        self.kv_tier = stores
        return slots

    def swap_blocks(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]],
                    tier: TierTransfers | None = None) -> None:
        """Copy ``(device, cpu)`` blocks to the CPU swap pool and ``(cpu, device)`` blocks back, and the
        KV tiers' copies, every layer, every source read before any block is written.

        NOTE: called before any other cache write of the step (see ``kvforge.rank.swap``).
        """
        copies = []
        if swap_out or swap_in:
            if self.swap_space is None:
                raise ValueError("swap: no CPU swap pool (initialize_swap_space was not called)")
            copies.append(StoreCopies(self.swap_space, outs=swap_out, ins=swap_in))
        if tier:
            if not self.kv_tier:
                raise ValueError("kv tier: none sized (initialize_kv_tier was not called)")
            copies += tier_copies(self.kv_tier, tier)
        transfer(self.kv_caches, copies)

    def prompt_logprobs_rows(self) -> int:
        """Prompt positions whose log-probabilities are computed at once (``kvforge.rank.prompt_logits``)."""
        return prompt_logprobs_rows(self.vocab_size)

    # -- one step --------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, step: StepInput, prev_tokens: torch.Tensor | None = None,
                prompt_sink: Callable[[int, torch.Tensor], None] | None = None) -> ForwardOutput | None:
        """Apply the step's bookkeeping, then queue its forward and logits; returns at once.

        ``prev_tokens`` (the driver): the step in flight's sampled tokens, which fill this step's
        placeholders; other ranks receive them by broadcast. ``prompt_sink(start, logits)`` (the
        driver) takes each slice of prompt-position logits.
        """
        self.batch.apply(step)
        # even in a step with no batch
        self.swap_blocks(step.blocks_to_swap_out, step.blocks_to_swap_in, step.tier)
        if not step.req_ids:
            return None
        model = _held(self.model, self.rank, RELEASED)
        graphs = _held(self.graphs, self.rank, "a graph step, but no graphs") if step.graph_key is not None else None
        piecewise = self._piecewise_for(step)
        self.attn.copy_blocks(self.kv_caches, step.blocks_to_copy)
        buf, layout = self._lay_out_step(step, graphs)
        if step.rope_offsets is not None:  # M-RoPE: text after images rotates behind its 1-D position
            buf.np["positions"][:step.num_tokens] += step.rope_offsets
        if step.lookahead is not None:  # image rows that see each other both ways (an eager step)
            layout.lookahead = step.lookahead
        num_rows = layout.num_tokens  # with graph padding
        if self.lora is not None:
            self.lora.prepare(step.lora_ids, step.query_lens, num_rows, graph=graphs is not None)
        static = ((graphs.input_ids, graphs.positions) if graphs is not None else
                  (piecewise.input_ids, piecewise.positions) if piecewise is not None else None)
        ids_dev, pos_dev = self._device_inputs(step, buf, num_rows, static, prev_tokens)
        if step.mrope_positions is not None:  # a step with image rows (eager): [3, T] M-RoPE positions
            pos_dev = torch.from_numpy(step.mrope_positions).to(self.device)
        embeds = self._merged_embeddings(model, step, ids_dev) if step.mm_places is not None else None
        if piecewise is not None:  # a mixed step: its pieces replayed, attention eager between them
            hidden, head = piecewise.replay(step.num_tokens, self.attn.build_metadata(layout)), None
        else:
            hidden, head = self._forward(model, step, layout, graphs, ids_dev, pos_dev, embeds)
        if hidden is None:  # not the last stage: its part is done
            return None
        if step.prompt_rows is not None:
            prompt_logits(model, hidden, step.prompt_rows, self.vocab_size, prompt_sink)
        rows = logits = None
        n = step.num_sample_rows
        if n and step.sample_rows is not None:
            rows = buf.tensors["sample_rows"][:n].to(self.device, non_blocking=True)
        if n and step.compute_logits:
            logits = model.compute_logits(hidden[:n] if rows is None else hidden[rows]).float()
        return ForwardOutput(buf, ids_dev, rows, logits, head, layout, pos_dev)

    def _lay_out_step(self, step: StepInput, graphs: CUDAGraphRunner | None) -> tuple[HostInputs, BatchLayout]:
        """The step's layout in the next staging set (``kvforge.rank.batch_layout.lay_out_step``)."""
        return lay_out_step(step, self.batch.tables_of(step.req_ids), _held(self.buffers, self.rank, NO_BUFFERS).staging,
                            block_size=self.block_size, graph_width=graphs.max_blocks if graphs is not None else None,
                            null_blocks=self.sliding_window_kv)

    def _piecewise_for(self, step: StepInput) -> PiecewiseGraphs | None:
        """The piecewise graphs that run this step, or None: a uniform step (full graphs), a step with
        image rows (embeddings, M-RoPE or two-way spans: eager), or one larger than the largest bucket."""
        pw = self.piecewise
        if (pw is None or step.graph_key is not None or step.mm_places is not None
                or step.mrope_positions is not None or step.lookahead is not None):
            return None
        return pw if pw.bucket(step.num_tokens) is not None else None

    def _device_inputs(self, step: StepInput, buf: HostInputs, num_rows: int,
                       static: tuple[torch.Tensor, torch.Tensor] | None,
                       prev_tokens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's token ids and positions on the device (in ``static``, a graph's input buffers, for a
        graph step), copied from the pinned staging set; placeholders take the step in flight's sampled tokens."""
        if static is not None:
            static = (static[0][:num_rows], static[1][:num_rows])
        ids, pos = _held(self.buffers, self.rank, NO_BUFFERS).to_device(buf, num_rows, static)
        if step.fill_dst is not None:  # placeholders: the previous step's sampled tokens, on the device
            fill_placeholders(ids, buf, len(step.fill_dst), driver_tokens(self.groups, step.num_prev_tokens,
                                                                        prev_tokens, self.device))
        return ids, pos

    def _merged_embeddings(self, model: RankModel, step: StepInput, ids: torch.Tensor) -> torch.Tensor:
        """A multimodal step's input embeddings: the tokens', with each placeholder row replaced by its
        item's embedding row from the encoder cache, after dropping ``mm_free`` and encoding ``mm_encode``
        (every rank encodes: the tower is replicated)."""
        mm: Any = model
        for h in step.mm_free or ():
            self.encoder_cache.pop(h, None)
        if step.mm_encode:
            for feature, rows in zip(step.mm_encode, mm.embed_multimodal(step.mm_encode)):
                self.encoder_cache[feature.content_hash] = rows
        embeds = mm.embed(ids)
        places = step.mm_places.tolist() if step.mm_places is not None else []
        for row, h, first, count in places:
            embeds[row:row + count] = self.encoder_cache[h][first:first + count].to(embeds.dtype)
        return embeds

    def _forward(self, model: RankModel, step: StepInput, layout: BatchLayout, graphs: CUDAGraphRunner | None,
                 ids: torch.Tensor, pos: torch.Tensor, embeds: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The step's hidden states [num_tokens, hidden] (None on a stage before the last), and a
        verification graph's greedy head (``CUDAGraphRunner.head``). ``embeds``: a multimodal step's
        input embeddings (images merged in), which the model takes instead of embedding ``ids``."""
        if graphs is not None and step.graph_key is not None:  # a uniform step (decode, or k drafts each)
            if embeds is not None:  # (the runner never asks: a graph embeds its input ids itself)
                raise RuntimeError("a step with image placeholders cannot replay a CUDA graph")
            if self.stage.size > 1:
                return stage_replay(graphs, self.groups, layout, step.num_tokens), None
            return hidden_states(graphs.replay(layout))[:step.num_tokens], graphs.head(step.graph_key)
        meta = self.attn.build_metadata(layout)
        if embeds is not None:
            if self.stage.size != 1:
                raise RuntimeError("multimodal models run one pipeline stage")
            mm: Any = model  # a multimodal model's forward takes inputs_embeds (ModelCapabilities.modalities)
            return hidden_states(mm(ids, pos, self.kv_caches, meta, inputs_embeds=embeds)), None
        if self.stage.size == 1:
            return hidden_states(model(ids, pos, self.kv_caches, meta)), None
        return stage_forward(model, self.groups, ids, pos, self.kv_caches, meta, hidden_size=self.hidden_size,
                             dtype=self.dtype), None


def _held(value: T | None, rank: int, missing: str) -> T:
    """``value``, which a rank holds from its set-up until :meth:`Worker.release`."""
    if value is None:
        raise RuntimeError(f"rank {rank}: {missing}")
    return value


__all__ = ["ForwardOutput", "Worker", "WorkerSpec"]  # the first and last are at home in step_input, worker_spec
