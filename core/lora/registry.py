"""``LoRARegistry``: the engine's view of its adapters (which are registered on the ranks).

Adapters are registered on first use (or ahead of it: ``LLMEngine.add_lora``); every rank then
holds the adapter ready in host memory. At most ``max_cpu_loras`` stay registered: registering one
more unregisters the least recently used adapter that no unfinished request runs under (a later
request for it registers it again, from its path). Removing an adapter that unfinished requests run
under retires it: its name is free at once, and it is unregistered when the last of them ends. A bad
adapter is refused with a ``ValueError`` and costs nothing else: the ranks report problems instead of
raising.
"""
from __future__ import annotations

import collections
import os
from typing import TYPE_CHECKING, Callable, Iterable

from kvforge.config import EngineConfig
from kvforge.lora.adapter import read_adapter_config
from kvforge.lora.request import LoRARequest
from kvforge.rank.messages import AddLora, RemoveLora

if TYPE_CHECKING:
    from kvforge.rank.executor import Executor


def check_lora_request(config: EngineConfig, lora_request: object) -> LoRARequest | None:
    """The request's adapter, checked without reading its weights (safe from any thread)."""
    if lora_request is None:
        return None
    if not isinstance(lora_request, LoRARequest):
        raise ValueError(f"lora_request: expected kvforge.LoRARequest, got {type(lora_request).__name__}")
    if not config.enable_lora:
        raise ValueError("lora_request: LoRA is not enabled; start the engine with enable_lora=True (--enable-lora)")
    key = (lora_request.lora_path, config.max_lora_rank)
    try:  # re-read only when the file changed (every request of an adapter names it)
        stamp = os.stat(os.path.join(lora_request.lora_path, "adapter_config.json")).st_mtime_ns
    except OSError:
        stamp = None
    if stamp is None or _CHECKED.get(key) != stamp:
        read_adapter_config(lora_request.lora_path, config.max_lora_rank)
        _CHECKED[key] = stamp
    return lora_request


#: (adapter path, max rank) -> the config file's mtime when it last passed the check
_CHECKED: dict[tuple[str, int], int | None] = {}


class LoRARegistry:
    def __init__(self, config: EngineConfig, executor: Executor, in_use: Callable[[], Iterable[int]]):
        """``in_use()``: the adapter ids unfinished requests run under (never unregistered)."""
        self.config, self.executor, self.in_use = config, executor, in_use
        self.capacity = config.max_cpu_loras or config.max_loras
        self.loras: collections.OrderedDict[int, LoRARequest] = collections.OrderedDict()  # LRU first
        # NOTE: a retired adapter was removed while requests ran under it: they finish with it, its name
        # is free at once for another id, and it is unregistered once the last of them ends
        self.retired: set[int] = set()

    def ensure(self, request: LoRARequest, *, revive: bool = False) -> bool:
        """Register ``request`` on every rank unless it is; True if it was new. A retired adapter still
        serves the requests that name it (sent before it was removed) until they end; ``revive``
        (``LLMEngine.add_lora``) registers it again for good, if its name is still free."""
        self.release_retired()
        known = self.loras.get(request.lora_int_id)
        if known is not None:
            if (known.lora_name, known.lora_path) != (request.lora_name, request.lora_path):
                raise ValueError(f"lora_request.lora_int_id: {request.lora_int_id} is already adapter "
                                 f"{known.lora_name!r} ({known.lora_path}); each adapter needs its own id")
            if revive and request.lora_int_id in self.retired:
                self._check_name_free(request)
                self.retired.discard(request.lora_int_id)
            self.loras.move_to_end(request.lora_int_id)
            return False
        self._check_name_free(request)
        self._make_room()
        errors = [e for e in self.executor.call(AddLora(request)) if e]
        if errors:
            self.executor.call(RemoveLora(request.lora_int_id))
            raise ValueError(errors[0])
        self.loras[request.lora_int_id] = request
        return True

    def _check_name_free(self, request: LoRARequest) -> None:
        for other in self.list():
            if other.lora_name == request.lora_name and other.lora_int_id != request.lora_int_id:
                raise ValueError(f"lora_request.lora_name: {request.lora_name!r} is already adapter id "
                                 f"{other.lora_int_id}")

    def _make_room(self) -> None:
        if len(self.loras) < self.capacity:
            return
        busy = set(self.in_use())
        victim = next((lid for lid in self.loras if lid not in busy), None)
        if victim is None:
            raise ValueError(f"lora_request: all max_cpu_loras={self.capacity} registered adapters are in use by "
                             f"unfinished requests (--max-cpu-loras)")
        self._unregister(victim)

    def remove(self, lora_int_id: int) -> bool:
        """Unregister an adapter; False if unknown (or already removed). One that unfinished requests run
        under is retired instead: they finish with it and it is unregistered when the last one ends."""
        self.release_retired()
        if lora_int_id not in self.loras or lora_int_id in self.retired:
            return False
        if lora_int_id in set(self.in_use()):
            self.retired.add(lora_int_id)
        else:
            self._unregister(lora_int_id)
        return True

    def release_retired(self) -> None:
        """Unregister the retired adapters no unfinished request runs under any more (the engine calls
        this when its requests have ended)."""
        if self.retired:
            for lid in self.retired - set(self.in_use()):
                self._unregister(lid)

    def _unregister(self, lora_int_id: int) -> None:
        self.retired.discard(lora_int_id)
        del self.loras[lora_int_id]
        self.executor.call(RemoveLora(lora_int_id))

    def list(self) -> list[LoRARequest]:
        """The registered adapters (retired ones left out), least recently used first."""
        return [r for lid, r in self.loras.items() if lid not in self.retired]
