"""Piecewise CUDA graphs for mixed steps: everything but attention captured per token count, attention
run eagerly between the pieces.

A step that carries a prompt chunk is not uniform (sequences compute different numbers of tokens), so
the full graphs of ``kvforge.rank.cuda_graphs`` cannot replay it, and an eager forward of a 32-layer
model launches some 500 kernels from Python: at serving rates most steps carry a chunk, and the host
became the bottleneck (docs/model_runner.md, "Mixed steps on piecewise graphs"). Everything outside
attention depends only on the number of tokens, not on how they split into sequences: norms, the
projections, RoPE (from the positions), the MLP or MoE. So for each bucket of B tokens the forward is
captured as ``num_layers + 1`` graphs cut at every ``AttentionBackend.forward`` call, and a step of
T <= B tokens replays piece 0, runs layer 0's attention eagerly on the first T rows with the step's own
metadata (any backend, any mix of prefill and decode), replays piece 1, and so on.

How the cut is made: while capturing, the backend's ``forward`` is replaced on the instance (every
layer calls ``self.attn.forward`` of the one backend it shares) by a function that ends the current
graph, records the call (its q / k / v, cache and layer), returns a static output buffer and begins
the next graph. The recorded q / k / v are non-owning aliases of the capture's tensors (vLLM keeps
weak references for the same reason): the pool may hand their memory to later pieces, which is right
because a replay reads them (the eager attention) before the next piece runs, exactly the order of
the capture. A model whose forward reads the attention metadata anywhere but in ``attn.forward``
(LongRoPE picks its table from the sequence lengths) cannot be cut this way: the capture sees a
metadata object that refuses every read (:class:`SealedMetadata`), and such a model keeps its mixed
steps eager. :func:`cut_forward` is that cut without graphs, which the CPU tests run on every family.

Rows T..B of a replay compute throw-away values from stale inputs; every op outside attention is
row-wise, so they never reach the first T rows, and attention sees only the first T.
"""
from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, cast

import torch

from kvforge.attention import PLAIN_LAYER, AttentionBackend, AttentionLayer, AttentionMetadata
from kvforge.rank.model_build import RankModel, hidden_states

logger = logging.getLogger(__name__)

#: NOTE: the default largest bucket (``EngineConfig.max_piecewise_graph_tokens``) is 2,048: past it a
#: step is compute-bound (an 8B model's 2,048-token step is ~40 ms on an H200), so the few ms of eager
#: launches hide behind it, and larger buckets cost pool memory and capture time


def piecewise_sizes(max_tokens: int) -> list[int]:
    """The token buckets: steps of 32 up to 256, of 128 up to 1,024, of 256 beyond (padding stays
    under an eighth of a step past 256 tokens, where padded rows start to cost compute)."""
    sizes = list(range(32, 257, 32)) + list(range(384, 1025, 128)) + list(range(1280, max_tokens + 1, 256))
    sizes = [s for s in sizes if s <= max_tokens]
    if not sizes or sizes[-1] != max_tokens:
        sizes.append(max_tokens)
    return sizes


def bucket_of(sizes: list[int], num_tokens: int) -> int | None:
    """The smallest of ``sizes`` (ascending) that holds ``num_tokens``, or None."""
    if num_tokens <= 0 or num_tokens > sizes[-1]:
        return None
    return next(s for s in sizes if s >= num_tokens)


class PiecewiseUnsafe(RuntimeError):
    """The model reads attention metadata outside ``AttentionBackend.forward``: it cannot be cut."""


class SealedMetadata:
    """What a cut forward sees as its metadata: any read outside the backend is refused."""

    def __getattr__(self, name: str) -> Any:
        raise PiecewiseUnsafe(f"the model reads attention metadata field {name!r} outside attention")


#: ``on_call(q, k, v, kv_cache, layer) -> out``: what a cut forward does at each attention call
OnAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionLayer], torch.Tensor]


@contextmanager
def attention_cut(attn: AttentionBackend, on_call: OnAttention) -> Iterator[None]:
    """Inside, every ``attn.forward`` call (the backend every layer shares) goes to ``on_call``."""
    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: object,
                layer: AttentionLayer = PLAIN_LAYER) -> torch.Tensor:
        return on_call(q, k, v, kv_cache, layer)

    attn.forward = forward  # type: ignore[method-assign]  # an instance attribute shadows the class's method
    try:
        yield
    finally:
        delattr(attn, "forward")


def cut_forward(model: RankModel, attn: AttentionBackend, kv_caches: list[torch.Tensor], ids: torch.Tensor,
                pos: torch.Tensor, on_call: OnAttention) -> torch.Tensor:
    """The model's forward over ``ids`` / ``pos`` with every attention call handed to ``on_call`` and the
    metadata sealed: raises :class:`PiecewiseUnsafe` if the model reads the metadata itself."""
    with attention_cut(attn, on_call):
        sealed = cast(AttentionMetadata, SealedMetadata())  # (it stands in for one, refusing every read)
        return hidden_states(model(ids, pos, kv_caches, sealed))


@dataclass
class AttentionCall:
    """One cut: the attention call between two pieces, with the capture's tensors (aliases)."""

    q: torch.Tensor  # [B, heads, head_dim]
    k: torch.Tensor  # [B, kv_heads, head_dim]
    v: torch.Tensor  # [B, kv_heads, head_dim]
    kv_cache: torch.Tensor
    layer: AttentionLayer
    out: torch.Tensor  # [B, heads, head_dim] the static buffer the next piece reads


@dataclass
class PiecewiseGraph:
    """The graphs of one bucket: ``pieces[i]`` runs before ``calls[i]``; the last one after them all."""

    pieces: list[torch.cuda.CUDAGraph]
    calls: list[AttentionCall]
    hidden: torch.Tensor  # [B, hidden] the last piece's output


def alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor over ``t``'s memory that does not keep it allocated (the pool may reuse it)."""
    storage = t.untyped_storage()
    weak = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), t.device, storage.nbytes())
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(weak, t.storage_offset(), t.shape, t.stride())


class PiecewiseGraphs:
    """Captures and replays the piecewise graphs of every bucket (one rank, one pipeline stage)."""

    def __init__(self, model: RankModel, attn: AttentionBackend, kv_caches: list[torch.Tensor], *,
                 max_tokens: int, device: torch.device, stream: torch.cuda.Stream,
                 pool: Any = None):
        """``pool``: the memory pool to share (the decode graphs'), or None for a new one."""
        self.model, self.attn, self.kv_caches = model, attn, kv_caches
        self.device, self.stream, self.pool = device, stream, pool
        self.sizes = piecewise_sizes(max_tokens)
        top = self.sizes[-1]
        self.input_ids = torch.zeros(top, dtype=torch.long, device=device)
        self.positions = torch.zeros(top, dtype=torch.long, device=device)
        self.graphs: dict[int, PiecewiseGraph] = {}
        self.replays: dict[int, int] = {}  # bucket -> replays so far
        self._outs: dict[tuple[tuple[int, ...], torch.dtype], torch.Tensor] = {}  # attention outputs, by shape

    def bucket(self, num_tokens: int) -> int | None:
        """The captured bucket a step of ``num_tokens`` replays, or None (too large, or not captured)."""
        return bucket_of(self.sizes, num_tokens) if self.graphs else None

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every bucket, largest first; returns the seconds. Raises :class:`PiecewiseUnsafe` (and
        captures nothing) for a model that cannot be cut."""
        start = time.perf_counter()
        for size in sorted(self.sizes, reverse=True):
            self.graphs[size] = self._capture_one(size)
        torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - start
        logger.info("captured piecewise CUDA graphs of %d token buckets (%d..%d, %d pieces each) in %.1f s",
                    len(self.graphs), self.sizes[0], self.sizes[-1], len(self.graphs[self.sizes[-1]].pieces), elapsed)
        return elapsed

    def _capture_one(self, size: int) -> PiecewiseGraph:
        ids, pos = self.input_ids[:size], self.positions[:size]

        def skip(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 layer: AttentionLayer) -> torch.Tensor:
            return self._out_buffer(q.shape[1:-1] + v.shape[-1:], q.dtype)[:size]

        # warm up what the pieces run (Triton compiles for this size, lazy allocations happen outside the
        # capture), attention left out: it runs eagerly at replay, and no cache is written. A model that
        # reads the metadata is refused here, before any capture began.
        for _ in range(2):
            cut_forward(self.model, self.attn, self.kv_caches, ids, pos, skip)
        torch.cuda.synchronize(self.device)
        pieces: list[torch.cuda.CUDAGraph] = [torch.cuda.CUDAGraph()]
        calls: list[AttentionCall] = []

        def cut(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                layer: AttentionLayer) -> torch.Tensor:
            pieces[-1].capture_end()
            self.pool = self.pool if self.pool is not None else pieces[0].pool()
            out = self._out_buffer(q.shape[1:-1] + v.shape[-1:], q.dtype)[:size]
            calls.append(AttentionCall(alias(q), alias(k), alias(v), kv_cache, layer, out))
            pieces.append(torch.cuda.CUDAGraph())
            pieces[-1].capture_begin(pool=self.pool)
            return out

        with torch.cuda.stream(self.stream):
            pieces[0].capture_begin(pool=self.pool)
            try:
                hidden = cut_forward(self.model, self.attn, self.kv_caches, ids, pos, cut)
            finally:
                pieces[-1].capture_end()
        if self.pool is None:
            self.pool = pieces[0].pool()
        if not calls:
            raise PiecewiseUnsafe("the model's forward never called the attention backend")
        return PiecewiseGraph(pieces, calls, hidden)

    def _out_buffer(self, tail: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The one attention output buffer of this shape (layers take turns: each piece reads it before
        the next attention writes it). Made between two captures, so outside the pool."""
        key = (tuple(tail), dtype)
        if key not in self._outs:
            self._outs[key] = torch.zeros((self.sizes[-1], *tail), dtype=dtype, device=self.device)
        return self._outs[key]

    def replay(self, num_tokens: int, meta: AttentionMetadata) -> torch.Tensor:
        """Run a step of ``num_tokens`` (its ids and positions already in :attr:`input_ids` /
        :attr:`positions`) with the step's eager ``meta``; returns hidden states [num_tokens, hidden]
        (a view of the bucket's static output)."""
        size = self.bucket(num_tokens)
        if size is None:
            raise RuntimeError(f"no piecewise graph holds a step of {num_tokens} tokens")
        graph = self.graphs[size]
        forward: Callable[..., torch.Tensor] = self.attn.forward
        T = num_tokens
        graph.pieces[0].replay()
        for call, piece in zip(graph.calls, graph.pieces[1:]):
            call.out[:T].copy_(forward(call.q[:T], call.k[:T], call.v[:T], call.kv_cache, meta, call.layer))
            piece.replay()
        self.replays[size] = self.replays.get(size, 0) + 1
        return graph.hidden[:T]
