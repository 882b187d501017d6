"""A remote rank of the ``mp`` executor: ``python -m kvforge.plugins.executors.rank_process HOST PORT RANK``.

It connects back to the engine (key in ``KVFORGE_RANK_AUTHKEY``), receives its ``WorkerSpec``,
builds its worker, then runs what the engine sends until told to stop or the engine is gone.
"""
from __future__ import annotations

import logging
import multiprocessing.connection
import os
import pickle
import sys
import traceback
from typing import NoReturn

import torch

from kvforge.log_format import configure_logging, inherited_format
from kvforge.plugins.executors.shm_broadcast import OVERFLOW, RingAddress, ShmBroadcast
from kvforge.rank.messages import FailedCall, RankCall, RankFailed, RankMessage, RankReady, StopRank, answer
from kvforge.rank.step_codec import ExecuteStep, StepDecoder
from kvforge.rank.worker import Worker
from kvforge.rank.worker_spec import WorkerSpec

logger = logging.getLogger("kvforge.rank")


def main(argv: list[str]) -> int:
    host, port, rank = argv[0], int(argv[1]), int(argv[2])
    configure_logging(logging.WARNING, inherited_format(), prefix=f"[rank {rank}] ", fields={"rank": rank})
    conn = multiprocessing.connection.Client((host, port), authkey=bytes.fromhex(os.environ["KVFORGE_RANK_AUTHKEY"]))
    conn.send(rank)
    spec = conn.recv()
    address: RingAddress = conn.recv()
    run_rank(spec, rank, conn, address.attach())
    return 0


def run_rank(spec: WorkerSpec, rank: int, conn: multiprocessing.connection.Connection, ring: ShmBroadcast) -> None:
    """Build the worker (answering ``RankReady``), then serve the engine's messages
    (``kvforge.rank.messages``, read from the ``ring``; one too large for it comes on ``conn``),
    dispatched on their type: ``ExecuteStep`` (not answered), a ``RankCall``
    (answered ``CallDone``, or ``FailedCall`` when it raised for a reason that is not the device's),
    ``StopRank``. Any other failure is reported (``RankFailed``) and ends the process."""
    try:
        if spec.config.torch_device.type == "cpu":  # the ranks share the node's cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.world_size))
        worker = Worker(spec, rank)
        conn.send(RankReady(worker.ready()))
    except BaseException as exc:
        _fail(conn, exc)
    steps = StepDecoder()

    def engine_gone() -> None:
        # the engine sends on the connection only after a message's marker is in the ring: readable
        # with nothing in the ring means closed
        if conn.poll() and not ring.ready():
            raise EOFError("the engine closed its connection")
    while True:
        try:
            data = ring.read(engine_gone)
            msg: RankMessage = pickle.loads(conn.recv_bytes() if data is OVERFLOW else data)  # pyright: ignore[reportArgumentType]
        except (EOFError, OSError):  # the engine is gone
            break
        try:
            if isinstance(msg, ExecuteStep):
                worker.execute(steps.decode(msg))
            elif isinstance(msg, RankCall):
                reply = answer(msg, worker, rank)
                if isinstance(reply, FailedCall):  # the call's failure, not the rank's: it goes on
                    logger.warning("%s failed: %s", msg.name, reply.message)
                conn.send(reply)
            elif isinstance(msg, StopRank):
                break
            else:
                raise TypeError(f"rank {rank} got a message it does not know: {type(msg).__name__}")
        except BaseException as exc:
            _fail(conn, exc)
    worker.close()
    ring.close()


def _fail(conn: multiprocessing.connection.Connection, exc: BaseException) -> NoReturn:
    logger.error("failed:\n%s", "".join(traceback.format_exception(exc)))
    try:
        conn.send(RankFailed(f"{type(exc).__name__}: {exc}"))
    except (BrokenPipeError, ConnectionError, OSError):
        pass
    os._exit(1)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
