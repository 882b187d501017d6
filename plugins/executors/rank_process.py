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

import torch

from kvforge.errors import is_device_error
from kvforge.log_format import configure_logging, inherited_format
from kvforge.rank.executor import FailedCall
from kvforge.rank.worker import Worker, WorkerSpec

logger = logging.getLogger("kvforge.rank")


def main(argv: list[str]) -> int:
    host, port, rank = argv[0], int(argv[1]), int(argv[2])
    configure_logging(logging.WARNING, inherited_format(), prefix=f"[rank {rank}] ", fields={"rank": rank})
    conn = multiprocessing.connection.Client((host, port), authkey=bytes.fromhex(os.environ["KVFORGE_RANK_AUTHKEY"]))
    conn.send(rank)
    spec = conn.recv()
    run_rank(spec, rank, conn)
    return 0


def run_rank(spec: WorkerSpec, rank: int, conn: multiprocessing.connection.Connection) -> None:
    """Build the worker, then serve the engine's messages: ("exec", step), ("rpc", method, args,
    kwargs) (answered ("ok", value), or ("failed", message) when the call raised for a reason that is
    not the device's), ("stop",). Any other failure is reported on the connection and ends the process."""
    try:
        if spec.config.torch_device.type == "cpu":  # the ranks share the node's cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.world_size))
        worker = Worker(spec, rank)
        conn.send(("ready", worker.ready()))
    except BaseException as exc:
        _fail(conn, exc)
    while True:
        try:
            msg = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):  # the engine is gone
            break
        kind = msg[0]
        try:
            if kind == "exec":
                worker.execute(msg[1])
            elif kind == "rpc":
                conn.send(("ok", _call(worker, msg[1], msg[2], msg[3])))
            elif kind == "stop":
                break
        except _CallFailed as failed:  # the call's failure, not the rank's: answered, and the rank goes on
            conn.send(("failed", failed.message))
        except BaseException as exc:
            _fail(conn, exc)
    worker.close()


class _CallFailed(Exception):
    def __init__(self, failed: FailedCall):
        self.message = failed.message


def _call(worker: Worker, method: str, args: tuple, kwargs: dict) -> object:
    """An RPC on the worker. NOTE: only a device-level error (``is_device_error``) or a step's failure
    ends a rank; anything else a call raises is its caller's to report (``RankCallError``)."""
    try:
        return getattr(worker, method)(*args, **kwargs)
    except Exception as exc:
        if is_device_error(exc):
            raise
        logger.warning("%s failed: %s: %s", method, type(exc).__name__, exc)
        raise _CallFailed(FailedCall.of(exc)) from None


def _fail(conn: multiprocessing.connection.Connection, exc: BaseException) -> None:
    logger.error("failed:\n%s", "".join(traceback.format_exception(exc)))
    try:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    except (BrokenPipeError, ConnectionError, OSError):
        pass
    os._exit(1)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
