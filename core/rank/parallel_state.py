"""The tensor-parallel group a model is built for, how its dimensions split, the collectives, and how
a rank joins the others (:func:`init_world`).

A model's parallel layers (``kvforge.layers``) read :func:`current` once, when they are constructed,
and keep that group: the engine builds the target model inside ``building(group)`` and a draft model
outside it (unsharded), so two models of one process can live in different groups. Nothing is looked
up globally at run time. With a group of size 1 every collective is a no-op (docs/distributed.md).
"""
from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from kvforge.rank.peer_all_reduce import PeerAllReduce, peer_all_reduce

logger = logging.getLogger(__name__)

#: seconds a rank waits for its process groups to be aborted at shutdown (vLLM bounds its NCCL abort too)
LEAVE_TIMEOUT_S = 5.0

@dataclass(frozen=True)
class TPGroup:
    """This process's place in its tensor-parallel group: ``rank`` of ``size``; ``group`` is the
    ``torch.distributed`` process group object (None with size 1). Collectives call the group's own
    methods: an engine's groups are private to it (never the process-wide default group), so
    several engines, or a user's own ``torch.distributed``, can share a process."""

    rank: int = 0
    size: int = 1
    group: Any = None
    peer: PeerAllReduce | None = None  # small messages over peer GPU memory (``peer_all_reduce``), on CUDA

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the group; returns the sum (``x`` itself, in place, unless ``x`` is
        :meth:`staging`'s buffer). Small messages go over peer memory where the group has it, the rest
        to the collective library (NCCL, gloo)."""
        if self.size > 1:
            if self.peer is not None and self.peer.takes(x):
                return self.peer(x)
            self.group.allreduce([x]).wait()
        return x

    def staging(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """Where a producer may write a message for :meth:`all_reduce` to sum without copying it first
        (the peer all-reduce's buffer), or None (then reduce a tensor of its own)."""
        return self.peer.staging(shape, dtype) if self.size > 1 and self.peer is not None else None

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``x`` (same shape on all ranks) along the last dimension."""
        if self.size == 1:
            return x
        out = torch.empty((self.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        self.group._allgather_base(out, x.contiguous()).wait()  # rank-major rows
        return out.view(self.size, *x.shape).movedim(0, -2).reshape(*x.shape[:-1], self.size * x.shape[-1])

    def broadcast(self, x: torch.Tensor, src: int) -> torch.Tensor:
        """Every rank's ``x`` becomes the group rank ``src``'s, in place; returns it."""
        if self.size > 1:
            opts = torch.distributed.BroadcastOptions()
            opts.rootRank = src
            self.group.broadcast([x], opts).wait()
        return x


@dataclass(frozen=True)
class PPStage:
    """This process's pipeline stage: ``rank`` of ``size``; the model builds only its stage's layers."""

    rank: int = 0
    size: int = 1

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    def layers(self, num_layers: int) -> tuple[int, int]:
        """[start, end) of this stage's layers: contiguous, as even as possible."""
        if num_layers < self.size:
            raise ValueError(f"pipeline_parallel_size={self.size} is more than the model's {num_layers} layers")
        start, count = split(num_layers, self.size, self.rank)
        return start, start + count


SINGLE = TPGroup()
WHOLE = PPStage()
_current: TPGroup = SINGLE
_current_stage: PPStage = WHOLE


def current() -> TPGroup:
    """The group of the model being built (``SINGLE`` outside :func:`building`)."""
    return _current


def current_stage() -> PPStage:
    """The pipeline stage of the model being built (``WHOLE`` outside :func:`building`)."""
    return _current_stage


@contextlib.contextmanager
def building(group: TPGroup, stage: PPStage = WHOLE) -> Iterator[TPGroup]:
    """Layers constructed inside belong to ``group``; the model builds ``stage``'s layers only."""
    global _current, _current_stage
    old, _current = _current, group
    old_stage, _current_stage = _current_stage, stage
    try:
        yield group
    finally:
        _current, _current_stage = old, old_stage


@dataclass(frozen=True)
class RankGroups:
    """Where one rank stands among an engine's ranks (world rank = stage x tensor-parallel size +
    tensor-parallel rank): its tensor-parallel group, the world group (stage-to-stage sends, the
    driver's broadcasts) and its pipeline stage."""

    rank: int  # the world rank
    tp: TPGroup
    world: TPGroup
    stage: PPStage
    driver_rank: int  # the first tensor-parallel rank of the last stage (the engine process's)

    @property
    def is_driver(self) -> bool:
        return self.rank == self.driver_rank

    def leave(self, device: torch.device, timeout_s: float = LEAVE_TIMEOUT_S) -> bool:
        """Leave the process groups (their connections close; peers still in a collective get an error),
        waiting at most ``timeout_s``; False if that was not enough (the groups are left to the process's
        exit). The caller drops its CUDA graphs first: NCCL's abort waits until no graph that captured
        one of its collectives is left."""
        # NCCL's shutdown waits for its peers (a rank already stopped would hang it): abort instead
        how = "abort" if device.type == "cuda" else "shutdown"
        groups = [g.group for g in {id(g): g for g in (self.tp, self.world) if g.size > 1}.values()]
        if self.tp.peer is not None:
            self.tp.peer.close()

        def leave_all() -> None:
            for g in groups:
                if hasattr(g, how):
                    try:
                        getattr(g, how)()
                    except Exception:  # already broken: nothing left to release
                        pass
        if not groups:
            return True
        thread = threading.Thread(target=leave_all, name=f"kvforge-leave-rank{self.rank}", daemon=True)
        thread.start()
        thread.join(timeout_s)
        if thread.is_alive():
            logger.warning("rank %d: leaving the process groups took over %.0f s; left to the process's exit",
                           self.rank, timeout_s)
            return False
        return True


def init_world(rank: int, device: torch.device, *, tensor_parallel_size: int, pipeline_parallel_size: int,
               init_method: str | None, timeout_s: float, custom_all_reduce: bool = True) -> RankGroups:
    """Join the engine's ranks (NCCL on CUDA, gloo on the CPU; the driver serves the rendezvous at
    ``init_method``, ``tcp://host:port``, needed when there is more than one rank). On CUDA the
    tensor-parallel group also gets its peer-memory all-reduce (``peer_all_reduce``) unless
    ``custom_all_reduce`` is False."""
    tp, world = tensor_parallel_size, tensor_parallel_size * pipeline_parallel_size
    stage = PPStage(rank // tp, pipeline_parallel_size)
    driver = (pipeline_parallel_size - 1) * tp
    if world == 1:
        return RankGroups(rank, SINGLE, SINGLE, stage, driver)
    if init_method is None:
        raise ValueError(f"init_method: {world} ranks need a rendezvous address (tcp://host:port), got None")
    store = rendezvous(init_method, rank, world, timeout_s, host_rank=driver)
    world_pg = new_process_group(store, "world/", rank, world, device, timeout_s)
    tp_pg = world_pg if tp == world else new_process_group(store, f"tp{stage.rank}/", rank % tp, tp, device, timeout_s)
    peer = None
    if tp > 1 and device.type == "cuda" and custom_all_reduce:
        from torch.distributed.distributed_c10d import PrefixStore

        peer = peer_all_reduce(f"kvforge-tp{stage.rank}-{init_method}", tp_pg, PrefixStore(f"peer{stage.rank}/", store),
                               rank % tp, tp, device)
    tp_group = TPGroup(rank % tp, tp, tp_pg, peer)
    world_group = tp_group if tp == world else TPGroup(rank, world, world_pg)
    return RankGroups(rank, tp_group, world_group, stage, driver)


def rendezvous(init_method: str, rank: int, size: int, timeout_s: float, host_rank: int = 0) -> Any:
    """The store the ranks meet at (``tcp://host:port``, served by ``host_rank``)."""
    import datetime

    from torch.distributed import TCPStore  # pyright: ignore[reportPrivateImportUsage]  (re-exported from torch._C)

    host, port = init_method.removeprefix("tcp://").rsplit(":", 1)
    return TCPStore(host, int(port), size, rank == host_rank, datetime.timedelta(seconds=timeout_s))


def new_process_group(store: Any, prefix: str, rank: int, size: int, device: torch.device, timeout_s: float) -> Any:
    """A private process group of ``size`` ranks (``rank`` here) keyed ``prefix`` in ``store``: NCCL on
    CUDA, gloo on the CPU."""
    import datetime

    from torch.distributed.distributed_c10d import PrefixStore

    dist = torch.distributed
    timeout = datetime.timedelta(seconds=timeout_s)
    store = PrefixStore(prefix, store)
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def split(n: int, size: int, rank: int) -> tuple[int, int]:
    """(start, count) of rank's part when n items split as evenly as possible (the first n % size
    ranks get one more)."""
    base, extra = divmod(n, size)
    return rank * base + min(rank, extra), base + (rank < extra)


@dataclass(frozen=True)
class HeadShard:
    """The attention heads of one rank: query heads [q_start, q_start + num_heads) and KV heads
    [kv_start, kv_start + num_kv_heads) of the model's."""

    q_start: int
    num_heads: int
    kv_start: int
    num_kv_heads: int


def head_shard(num_heads: int, num_kv_heads: int, size: int, rank: int) -> HeadShard:
    """Split attention by KV-head groups (each query head stays with its KV head).

    With at least as many KV heads as ranks, the KV heads split as evenly as possible, and each
    rank takes the query heads of its KV heads: uneven when the count does not divide (the default
    model's 3 KV heads over 2 ranks: 2 and 1), never wrong. With fewer KV heads than ranks, each KV
    head is replicated on ``size / num_kv_heads`` ranks, which split its query heads evenly.
    """
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"attention: {num_heads} query heads do not form groups over {num_kv_heads} KV heads")
    group = num_heads // num_kv_heads
    if num_kv_heads >= size:
        kv_start, kv_count = split(num_kv_heads, size, rank)
        return HeadShard(kv_start * group, kv_count * group, kv_start, kv_count)
    if size % num_kv_heads or group % (size // num_kv_heads):
        raise ValueError(
            f"tensor_parallel_size={size} cannot split {num_heads} query heads over {num_kv_heads} KV heads: "
            f"with fewer KV heads than ranks, tensor_parallel_size must be a multiple of the KV heads and "
            f"each KV head's {group} query heads must split evenly over its {size // max(num_kv_heads, 1)} ranks")
    replicas = size // num_kv_heads
    kv = rank // replicas
    per_rank = group // replicas
    return HeadShard(kv * group + (rank % replicas) * per_rank, per_rank, kv, 1)
