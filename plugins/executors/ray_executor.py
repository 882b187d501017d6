"""``ray``: the ranks other than the driver are Ray actors, one per bundle of a placement group.

The driver's bundle is pinned to the engine's node (the driver runs in the engine process); the
others go wherever the cluster has room, across nodes. Ray is imported only when this executor is
built (``pip install 'kvforge[ray]'``). Actors take the typed messages of ``kvforge.rank.messages``: a
step is packed (``kvforge.rank.step_codec``), put in Ray's object store once and handed to every
actor; actors answer only calls (``collective_rpc``), and each step's result reference is checked
later, so a rank that raised or died fails the next step with ``WorkerFailure`` naming it.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import os
import time
from typing import Any, Callable

import torch

from kvforge.rank.executor import Executor, WorkerFailure, check_calls, free_port, start_driver
from kvforge.rank.messages import CallDone, FailedCall, RankCall, answer, as_call
from kvforge.rank.step_codec import ExecuteStep, StepDecoder, StepEncoder
from kvforge.rank.step_input import ForwardOutput, StepInput
from kvforge.rank.worker import Worker
from kvforge.rank.worker_spec import WorkerSpec

logger = logging.getLogger(__name__)

#: step results kept per rank before they are checked (each is an empty reply; a failure shows in one)
MAX_PENDING = 64


class RankActor:
    """One rank inside a Ray actor (Ray gives a GPU actor its own ``CUDA_VISIBLE_DEVICES``: cuda:0)."""

    def __init__(self, spec: WorkerSpec, rank: int):
        self.spec, self.rank = spec, rank
        self.worker: Worker | None = None
        self.steps = StepDecoder()

    def start(self) -> dict[str, Any]:
        import ray

        if self.spec.config.torch_device.type == "cpu":
            torch.set_num_threads(max(1, int(ray.get_runtime_context().get_assigned_resources().get("CPU", 1))))
        self.worker = Worker(self.spec, self.rank, local_rank=0)
        return self.worker.ready() | {"node_id": ray.get_runtime_context().get_node_id(),
                                      "gpu_ids": [str(g) for g in ray.get_gpu_ids()]}

    def rpc(self, call: RankCall[Any]) -> CallDone[Any] | FailedCall:
        """A call on this rank's worker; a failure that is not the device's comes back as a value (the
        driver raises ``RankCallError``), so that the actor lives on."""
        return answer(call, self._started(), self.rank)

    def execute(self, msg: ExecuteStep) -> None:
        self._started().execute(self.steps.decode(msg))

    def _started(self) -> Worker:
        if self.worker is None:
            raise RuntimeError(f"rank {self.rank}: a message before start()")
        return self.worker

    def ping(self) -> bool:
        return True

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()


class RayExecutor(Executor):
    name = "ray"
    typed_calls = True

    def __init__(self, spec: WorkerSpec):
        try:
            import ray
            from ray.util.placement_group import placement_group
        except ImportError:
            raise WorkerFailure("the ranks cannot start: distributed_executor_backend='ray' needs Ray, which is "
                                "not installed (pip install 'kvforge[ray]')") from None
        self._ray = ray
        self._started_ray = not ray.is_initialized()
        if self._started_ray:
            ray.init()  # RAY_ADDRESS, a running local cluster, or a new one
        ip = ray.util.get_node_ip_address()
        if spec.init_method is None:
            spec = dataclasses.replace(spec, init_method=f"tcp://{ip}:{free_port('')}")
        super().__init__(spec)
        self._closing = False
        self.actors: dict[int, Any] = {}
        self.pending: dict[int, collections.deque] = {}
        self._steps = StepEncoder()  # NOTE: every actor gets every step it packs, in order
        self.node_ids: dict[int, str] = {}
        cuda = spec.config.torch_device.type == "cuda"
        unit = {"GPU": 1.0} if cuda else {"CPU": 1.0}
        bundles = [dict(unit) for _ in range(spec.world_size)]
        bundles[spec.driver_rank][f"node:{ip}"] = 0.001  # the driver's bundle is on the engine's node
        self.pg = placement_group(bundles, strategy="PACK")
        try:
            self._place(ray)
            self.driver = self._start(ray, cuda)
        except BaseException:
            self.shutdown()
            raise
        logger.info("ray executor: %d ranks on nodes %s", spec.world_size, self.node_ids)

    def _place(self, ray: Any) -> None:
        unit = "GPU" if self.spec.config.torch_device.type == "cuda" else "CPU"
        n = self.spec.world_size
        have = ray.cluster_resources().get(unit, 0)
        if have < n:  # never fits: say so now, not after the timeout
            ready = []
        else:
            ready, _ = ray.wait([self.pg.ready()], timeout=self.spec.init_timeout_s)
        if not ready:
            raise WorkerFailure(f"the ranks cannot be placed: the Ray cluster has no room for {n} bundles of one "
                                f"{unit} (it has {have:g} {unit} in all, {ray.available_resources().get(unit, 0):g} free)")

    def _start(self, ray: Any, cuda: bool) -> Worker:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        actor_cls = ray.remote(RankActor)
        starts = {}
        for rank in range(self.spec.world_size):
            if rank == self.spec.driver_rank:
                continue
            strategy = PlacementGroupSchedulingStrategy(placement_group=self.pg, placement_group_bundle_index=rank)
            actor = actor_cls.options(num_cpus=0 if cuda else 1, num_gpus=1 if cuda else 0,
                                      scheduling_strategy=strategy, name=None).remote(self.spec, rank)
            self.actors[rank], self.pending[rank] = actor, collections.deque()
            starts[rank] = actor.start.remote()
        waiting = dict(starts)

        def watch() -> bool:
            """Collect the actors that finished starting; True once all have."""
            done, _ = ray.wait(list(waiting.values()), timeout=0, num_returns=len(waiting)) if waiting else ([], [])
            for rank in [r for r, ref in waiting.items() if ref in done]:
                try:
                    info = ray.get(waiting.pop(rank))
                except Exception as exc:
                    raise WorkerFailure(f"rank {rank} (Ray actor) failed to start: {_cause(exc)}") from None
                self.node_ids[rank] = info["node_id"]
                self._check_gpu(rank, info, ray)
            return not waiting
        driver = start_driver(self.spec, watch)
        self.node_ids[self.spec.driver_rank] = ray.get_runtime_context().get_node_id()
        return driver

    def _check_gpu(self, rank: int, info: dict, ray: Any) -> None:
        """The driver uses the engine's CUDA device outside Ray's accounting: an actor on the same node
        must not have been given that GPU."""
        dev = self.spec.config.torch_device
        if dev.type != "cuda" or info["node_id"] != ray.get_runtime_context().get_node_id():
            return
        mine = str(dev.index or 0)
        visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
        physical = visible[int(mine)] if int(mine) < len(visible) else mine
        if physical in info["gpu_ids"]:
            raise WorkerFailure(f"rank {rank} (Ray actor) cannot start: Ray gave it GPU {physical}, which the driver "
                                f"rank uses on this node; set device to a GPU Ray does not schedule (e.g. start "
                                "Ray with one GPU fewer on this node)")

    # -- calls -----------------------------------------------------------------------------------
    def collective_rpc(self, call: RankCall[Any] | str, *args: Any, **kwargs: Any) -> list[Any]:
        ray = self._ray
        rank_call = as_call(call, args, kwargs)
        refs = {rank: actor.rpc.remote(rank_call) for rank, actor in self.actors.items()}
        try:
            mine = rank_call.apply(self.driver)
        except Exception as exc:
            raise self._failure(exc) from exc
        results: dict[int, Any] = {}
        for rank, ref in refs.items():
            try:
                reply = ray.get(ref)
            except Exception as exc:
                raise WorkerFailure(f"rank {rank} (Ray actor) failed in {rank_call.name}: {_cause(exc)}") from None
            results[rank] = reply.value if isinstance(reply, CallDone) else reply
        results[self.spec.driver_rank] = mine
        return check_calls(rank_call.name, results)

    def execute_model(self, step: StepInput, prev_tokens: torch.Tensor | None = None,
                      prompt_sink: Callable[[int, torch.Tensor], None] | None = None) -> ForwardOutput | None:
        self._check_pending()
        msg = self._steps.encode(step)
        arg = self._ray.put(msg) if len(self.actors) > 1 else msg
        for rank, actor in self.actors.items():
            self.pending[rank].append(actor.execute.remote(arg))
        try:
            return self.driver.execute(step, prev_tokens, prompt_sink)
        except Exception as exc:
            raise self._failure(exc) from exc

    # -- failures --------------------------------------------------------------------------------
    def _check_pending(self, wait_s: float = 0.0) -> None:
        """Raise ``WorkerFailure`` for the first step result that failed; drop the ones that are done."""
        ray = self._ray
        for rank, refs in self.pending.items():
            if not refs:
                continue
            done, _ = ray.wait(list(refs), timeout=wait_s, num_returns=len(refs))
            for ref in done:
                try:
                    ray.get(ref)
                except Exception as exc:
                    raise WorkerFailure(f"rank {rank} (Ray actor) died or failed: {_cause(exc)}") from None
            finished = set(done)
            self.pending[rank] = collections.deque(r for r in refs if r not in finished)
            while len(self.pending[rank]) > MAX_PENDING:  # a rank far behind: wait for its oldest step
                ray.get(self.pending[rank].popleft())

    def _failure(self, exc: BaseException) -> BaseException:
        try:
            self._check_pending(wait_s=2.0)
            self.check_health()
        except WorkerFailure as failure:
            return failure
        return exc

    def check_health(self) -> None:
        ray = self._ray
        for rank, actor in self.actors.items():
            try:
                ray.get(actor.ping.remote(), timeout=10)
            except Exception as exc:
                raise WorkerFailure(f"rank {rank} (Ray actor) died: {_cause(exc)}") from None

    def shutdown(self) -> None:
        if self._closing:
            return
        self._closing = True
        ray = self._ray
        for actor in self.actors.values():
            try:
                ray.get(actor.close.remote(), timeout=5)
            except Exception:  # already gone
                pass
            ray.kill(actor)
        if getattr(self, "driver", None) is not None:
            self.driver.close()
        from ray.util.placement_group import remove_placement_group

        try:
            remove_placement_group(self.pg)
        except Exception:  # the cluster is gone
            pass
        if self._started_ray:
            deadline = time.monotonic() + 5
            while ray.is_initialized() and time.monotonic() < deadline:
                ray.shutdown()


def _cause(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[-1] if text else ''}"
