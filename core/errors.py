"""Failures that belong to one request, and how the engine tells them from device-wide ones.

The rule (docs/reliability.md): an error raised while the engine works on one request's behalf
(sampling set-up, a logits processor, a grammar, stop strings, detokenization) ends that request with
a :class:`RequestFailure` and frees its blocks; every other request carries on. Only a device-wide
failure (:func:`is_device_error`, or an exception outside per-request code) stops the engine.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RequestFailure:
    """Why one request ended with ``finish_reason == "error"``.

    ``status`` is the HTTP status the server answers with: 400 when the request caused it (a grammar
    that cannot compile, a plugin refusing the request's arguments with ``ValueError``), 500 otherwise.
    ``param`` names the request field at fault, where one is.
    """

    message: str
    status: int = 500
    param: str | None = None

    @classmethod
    def from_exception(cls, exc: BaseException, where: str) -> "RequestFailure":
        """A ``ValueError`` is the request's fault (plugins refuse bad arguments with it); the rest is ours."""
        if isinstance(exc, RequestError):
            return exc.failure
        status = 400 if isinstance(exc, ValueError) else 500
        return cls(f"{where}: {type(exc).__name__}: {exc}", status)


class RequestError(Exception):
    """Raised by a component that knows which request is at fault: only it fails."""

    def __init__(self, failure: RequestFailure):
        super().__init__(failure.message)
        self.failure = failure

    def __reduce__(self):  # pickled with its failure (it crosses from the engine core process)
        return type(self), (self.failure,)


class EngineDeadError(RuntimeError):
    """The engine stopped on an error (its loop failed, or its core process died); no request can be
    served any more."""


class RequestFailedError(RuntimeError):
    """What an :class:`~kvforge.engine.async_engine.AsyncLLMEngine` stream raises when its request failed."""

    def __init__(self, failure: RequestFailure):
        super().__init__(failure.message)
        self.failure = failure


_DEVICE_MARKERS = ("CUDA error", "CUBLAS_STATUS", "CUDNN_STATUS", "NCCL", "illegal memory access",
                   "device-side assert", "unspecified launch failure", "ECC error")


def is_device_error(exc: BaseException) -> bool:
    """Whether ``exc`` means the device (or the process) is unusable, whoever's request was running.

    NOTE: after a CUDA error the context is corrupt and every later kernel fails too, so such an
    error is never pinned on the request that happened to be running; out-of-memory means the
    engine's memory plan was wrong, which is not one request's fault either.
    """
    if isinstance(exc, (MemoryError, SystemExit, KeyboardInterrupt)):
        return True
    try:
        import torch
        if isinstance(exc, torch.OutOfMemoryError) or isinstance(exc, getattr(torch, "AcceleratorError", ())):
            return True
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _DEVICE_MARKERS)
