"""The served models: which engine answers a request's ``model``.

``kvforge serve`` runs one engine per model, each behind one ``OpenAIServing``, and serves each under
one or more names. Every name is a ``ServedModel`` in the app's ``ServedModels``; the endpoints resolve
the request's ``model`` here and nowhere else. A name need not stand for a whole engine: a LoRA
adapter will be an entry that shares its base model's ``serving``, with ``parent`` = the base model's
name and a ``lora_request`` its requests carry to the engine.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable

from kvforge.server.errors import APIError

if TYPE_CHECKING:
    from kvforge.engine.client import EngineClient
    from kvforge.server.openai_api import OpenAIServing


@dataclass
class ServedModel:
    """One name clients may put in a request's ``model``.

    name: the served name, unique in its registry.
    serving: the ``OpenAIServing`` of the engine that answers it (one per engine, shared by its names).
    root: the weights it serves: a path, or a preset or hub name (``/v1/models``' ``root``).
    parent: the served name of the model this one derives from (a LoRA adapter's base model); None for
        a base model.
    lora_request: passed with every request to the engine (a LoRA adapter); None for the base weights.
    """

    name: str
    serving: OpenAIServing
    root: str
    parent: str | None = None
    lora_request: Any = None

    @property
    def engine(self) -> EngineClient:
        return self.serving.engine

    def card(self) -> dict[str, Any]:
        """This model's entry in ``GET /v1/models`` (vLLM's fields)."""
        return {"id": self.name, "object": "model", "created": 0, "owned_by": "kvforge", "root": self.root,
                "parent": self.parent, "max_model_len": self.engine.max_model_len}


class ServedModels:
    """Served names in the order they were added; the first answers requests that name no model."""

    def __init__(self, entries: Iterable[ServedModel] = ()):
        self._by_name: dict[str, ServedModel] = {}
        for entry in entries:
            self.add(entry)

    def check_new(self, name: str) -> None:
        """A ``ValueError`` naming ``name`` if it is served already."""
        if name in self._by_name:
            raise ValueError(f"served_model_name: {name!r} is given twice; each served name must name one "
                             f"model (served: {', '.join(self._by_name)})")

    def add(self, entry: ServedModel) -> None:
        """Serve ``entry``; a name already served is a ``ValueError`` naming it."""
        self.check_new(entry.name)
        self._by_name[entry.name] = entry

    def remove(self, name: str) -> ServedModel:
        """Stop serving ``name`` (its engine keeps running); returns its entry. Unknown: the 404 of ``resolve``."""
        entry = self.resolve(name)
        del self._by_name[name]
        return entry

    def resolve(self, name: str | None) -> ServedModel:
        """The entry for a request's ``model``: the first one for None, else 404 ``model_not_found``."""
        if name is None and self._by_name:
            return next(iter(self._by_name.values()))
        entry = self._by_name.get(name) if name is not None else None
        if entry is None:
            raise APIError(404, f"The model `{name}` does not exist. Served models: {', '.join(self._by_name)}.",
                           "model", code="model_not_found")
        return entry

    def list(self) -> list[ServedModel]:
        return [*self._by_name.values()]

    @property
    def engines(self) -> list[EngineClient]:
        """Every engine once, in the order of its first served name."""
        distinct: dict[int, EngineClient] = {}
        for entry in self._by_name.values():
            distinct.setdefault(id(entry.engine), entry.engine)
        return [*distinct.values()]
