"""LoRA adapters over HTTP: ``--lora-modules``, ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``.

An adapter is served under its own name, as a ``ServedModel`` sharing its base model's engine, with
``parent`` = the base model's served name and a ``lora_request`` that every request naming it carries
to the engine. The load and unload endpoints (vLLM's, same bodies) answer only when the server runs
with ``--allow-runtime-lora-updating``: loading code paths at run time is an operator's choice.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import logging
from dataclasses import dataclass

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from kvforge.lora.request import LoRARequest
from kvforge.server.errors import APIError
from kvforge.server.models import ServedModel, ServedModels
from kvforge.server.request_fields import FieldPolicy, RequestBody

logger = logging.getLogger("kvforge.server")


@dataclass(frozen=True)
class LoRAModule:
    """One ``--lora-modules`` entry: ``name=path`` or JSON ``{"name", "path", "base_model_name"}``."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoRAModule:
    """``name=path`` or a JSON object; ``ValueError`` naming the flag otherwise."""
    if text.lstrip().startswith("{"):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--lora-modules: {text!r} is not valid JSON ({exc.msg})") from None
        if not isinstance(obj, dict) or not obj.get("name") or not obj.get("path"):
            raise ValueError(f"--lora-modules: a JSON entry needs \"name\" and \"path\", got {text!r}")
        unknown = sorted(set(obj) - {"name", "path", "base_model_name"})
        if unknown:
            raise ValueError(f"--lora-modules: unknown key(s) {unknown} in {text!r}")
        return LoRAModule(obj["name"], obj["path"], obj.get("base_model_name"))
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules: expected name=path or a JSON object, got {text!r}")
    return LoRAModule(name, path)


class LoadLoRAAdapterRequest(RequestBody):
    lora_name: str
    lora_path: str
    base_model_name: str | None = None


class UnloadLoRAAdapterRequest(RequestBody):
    lora_name: str
    lora_int_id: int | None = None


class LoRAAdapters:
    """The app's adapters: adds and removes their ``ServedModel`` entries (ids are the app's to give)."""

    def __init__(self, models: ServedModels):
        self.models = models
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()

    async def load(self, name: str, path: str, base_model_name: str | None = None) -> ServedModel:
        """Register the adapter in its base model's engine (``ValueError`` / 400 if it is bad) and serve it."""
        async with self._lock:
            if name in {m.name for m in self.models.list()}:
                raise APIError(400, f"lora_name: {name!r} is already served; unload it first", "lora_name")
            base = self.models.resolve(base_model_name)
            if base.parent is not None:
                raise APIError(400, f"base_model_name: {base.name!r} is itself an adapter", "base_model_name")
            if not base.engine.config.enable_lora:
                raise APIError(400, f"lora_path: the engine of {base.name!r} runs without LoRA; start it with "
                                    f"--enable-lora", "lora_path")
            request = LoRARequest(name, next(self._ids), path, base.name)
            try:
                await asyncio.to_thread(base.engine.add_lora, request)
            except ValueError as exc:
                raise APIError(400, str(exc), "lora_path") from None
            entry = ServedModel(name, base.serving, path, parent=base.name, lora_request=request)
            self.models.add(entry)
            logger.info("serving LoRA adapter %r (id %d) of %s from %s", name, request.lora_int_id, base.name, path)
            return entry

    async def unload(self, name: str, lora_int_id: int | None = None) -> None:
        """Stop serving the adapter: its name is free for a new load at once; requests still running under
        it finish with it, and its engine forgets it when the last one ends."""
        async with self._lock:
            entry = next((m for m in self.models.list() if m.name == name and m.lora_request is not None), None)
            if entry is None or (lora_int_id is not None and entry.lora_request.lora_int_id != lora_int_id):
                raise APIError(404, f"The LoRA adapter `{name}` is not loaded.", "lora_name", code="model_not_found")
            self.models.remove(name)
            await asyncio.to_thread(entry.engine.remove_lora, entry.lora_request.lora_int_id)
            logger.info("LoRA adapter %r (id %d) unloaded", name, entry.lora_request.lora_int_id)


def add_lora_routes(app: FastAPI, adapters: LoRAAdapters, allow_runtime_updating: bool, fields: FieldPolicy) -> None:
    def check_allowed() -> None:
        if not allow_runtime_updating:
            raise APIError(404, "runtime LoRA updating is off: start the server with --allow-runtime-lora-updating",
                           None, code="not_found")

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(req: LoadLoRAAdapterRequest):
        check_allowed()
        fields.screen(req)
        await adapters.load(req.lora_name, req.lora_path, req.base_model_name)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest):
        check_allowed()
        fields.screen(req)
        await adapters.unload(req.lora_name, req.lora_int_id)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
