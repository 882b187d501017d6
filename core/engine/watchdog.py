"""``StepWatchdog``: notices an engine that has stopped making progress.

A step that never ends (a deadlocked collective, a stuck kernel, a process stopped by a signal) raises
nothing: without a watchdog the server answers ``/health`` 200 while its streams wait forever. Each
front end keeps one: its engine loop beats at every step and at least once a second while idle (an
engine core process sends a ``beat`` message), and a thread checks the time since the last beat. Past
``timeout_s`` it calls ``on_stall`` with an :class:`EngineStalledError`; the front end then fails its
open streams and sets ``dead``, exactly as for an engine that crashed (docs/reliability.md).

The bound is on one step, so it must sit well above the slowest real step: a 16k-token prefill of a
large model on a slow device takes seconds, never minutes. ``kvforge serve --engine-step-timeout``.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

logger = logging.getLogger(__name__)

#: default of ``--engine-step-timeout`` (vLLM's engine iteration timeout is 60 s)
DEFAULT_STEP_TIMEOUT_S = 120.0
#: seconds between beats of an idle engine loop (its wait for new work)
IDLE_BEAT_S = 1.0


class EngineStalledError(RuntimeError):
    """The engine showed no progress for longer than the step timeout."""


class StepWatchdog:
    def __init__(self, timeout_s: float, on_stall: Callable[[EngineStalledError], None], name: str = "engine"):
        if not timeout_s > 0:
            raise ValueError(f"engine step timeout must be > 0 seconds, got {timeout_s}")
        self.timeout_s, self.on_stall, self.name = timeout_s, on_stall, name
        self.last_beat = time.monotonic()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self) -> None:
        """The engine made progress (any thread; a float store, so no lock)."""
        self.last_beat = time.monotonic()

    def start(self) -> None:
        if self._thread is None:
            self.beat()  # the wait before the first step does not count
            self._thread = threading.Thread(target=self._watch, name=f"kvforge-watchdog-{self.name}", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stopped.set()

    def _watch(self) -> None:
        period = min(1.0, self.timeout_s / 4)
        while not self._stopped.wait(period):
            silent = time.monotonic() - self.last_beat
            if silent > self.timeout_s:
                error = EngineStalledError(
                    f"the {self.name} made no progress for {silent:.1f} s (a step or heartbeat over the "
                    f"{self.timeout_s:g} s limit of --engine-step-timeout): a hung kernel, collective or process")
                logger.error("%s", error)
                self.on_stall(error)
                return
