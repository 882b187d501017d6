"""The suite on two workers (pytest-xdist): CI has two cores, and about half the suite's time one of them
waits (a server or rank process starting, a Python importing torch, a client waiting for a reply).

``pytest`` with no test ids runs on ``WORKERS`` workers when pytest-xdist is installed (the ``test`` extra
installs it) and no CUDA device is present (the GPU suite runs in one process on one card). A file's tests
stay on one worker, so the module-scoped engines and servers are built once; the files that check their
kernels in one shared Triton-interpreter run (``run_in_triton_interpreter``) go to the same worker, so that
run happens once; the files that start local Ray clusters go to one worker too. ``-n 0`` (or ``KVFORGE_TEST_WORKERS=0``) runs in one process; ``-n N`` as pytest-xdist says.
Fixtures that write outside a test's own directory (installing the dummy plugin package, assembling the
Gemma 3 GGUF) hold ``interprocess_lock`` while they do.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from typing import Iterator

#: workers of a whole-suite run (CI's cores)
WORKERS = 2
#: text in a test file -> the work unit of every file holding it: the files that re-run in the shared
#: Triton-interpreter run, and the files that start local Ray clusters (a ``ray.init()`` joins whichever
#: cluster on the node wrote Ray's address file last, so two of them must not run side by side)
UNIT_MARKS = {"run_in_triton_interpreter": "triton-interpreter", 'importorskip("ray")': "ray"}


def configure(config) -> None:
    """Before pytest-xdist reads its options: ``WORKERS`` workers, one file to a worker, for a run of
    whole directories with no ``-n`` given, no debugger, no CUDA device."""
    import torch

    if (not config.pluginmanager.hasplugin("xdist") or config.option.numprocesses is not None
            or hasattr(config, "workerinput")):  # (a worker: pytest-xdist clears its numprocesses)
        return
    wanted = int(os.environ.get("KVFORGE_TEST_WORKERS", WORKERS))
    if (wanted < 2 or (os.cpu_count() or 1) < 2 or config.option.collectonly or config.getoption("usepdb", False)
            or torch.cuda.is_available() or not all(os.path.isdir(a) for a in config.args)):
        return
    config.option.numprocesses = wanted
    config.option.dist = "loadfile"


def scheduler(config, log):
    """With ``--dist loadfile``: pytest-xdist's file-by-file scheduling, with the files of each of
    ``UNIT_MARKS``'s units in one work unit; None (pytest-xdist's own) otherwise."""
    from xdist.scheduler import LoadFileScheduling

    if config.option.dist != "loadfile":
        return None

    class FileScheduling(LoadFileScheduling):
        _units: dict[str, str] = {}

        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            if path not in self._units:
                try:
                    with open(os.path.join(str(config.rootpath), path), encoding="utf-8") as f:
                        text = f.read()
                except OSError:
                    text = ""
                self._units[path] = next((unit for mark, unit in UNIT_MARKS.items() if mark in text), path)
            return self._units[path]

    return FileScheduling(config, log)


@contextlib.contextmanager
def interprocess_lock(name: str) -> Iterator[None]:
    """Held by one process of the machine at a time (the workers of one run, and of runs side by side)."""
    path = os.path.join(tempfile.gettempdir(), f"kvforge-tests-{name}.lock")
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
