"""Fields outside the API: the base of every request body, and what the server does with a field no
request type defines.

The request types accept every field of the OpenAI (and Anthropic) types: each is honoured, accepted
without effect, or refused with a 400 naming it (``server/protocol.py``). A field outside them is what
this module is about. vLLM accepts such a field and logs a warning; kvforge does the same by default,
and counts it in ``kvforge:ignored_request_fields_total{field}``, so that a client sending a misspelt
field (``max_token``) is visible; ``--strict-request-fields`` makes it a 400 naming the field instead.
"""
from __future__ import annotations

import logging
import re
from typing import Any, Iterator

from pydantic import BaseModel, ConfigDict

from kvforge.server.errors import APIError

logger = logging.getLogger("kvforge.server")

#: distinct ``field`` label values the counter keeps; further names count under ``OTHER_FIELDS``
MAX_FIELD_LABELS = 100
OTHER_FIELDS = "(other)"
UNKNOWN_FIELD = "unknown field (docs/server.md lists the fields kvforge accepts)"


class RequestBody(BaseModel):
    """The base of every request body: fields outside the model are kept (``model_extra``) for
    ``FieldPolicy`` to judge; NaN and Infinity are refused wherever a number is expected."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


def unknown_fields(body: Any, path: str = "") -> Iterator[str]:
    """The dotted paths (``messages.1.foo``) of the fields no model of ``body`` defines, in order."""
    if isinstance(body, BaseModel):
        for name in body.model_extra or {}:
            yield f"{path}{name}"
        for name, field in type(body).model_fields.items():
            yield from unknown_fields(getattr(body, name), f"{path}{field.alias or name}.")
    elif isinstance(body, (list, tuple)) and body and isinstance(body[0], (BaseModel, list, tuple, dict)):
        for i, item in enumerate(body):  # (a list of numbers or strings holds no fields)
            yield from unknown_fields(item, f"{path}{i}.")
    elif isinstance(body, dict):
        for key, item in body.items():
            if isinstance(item, (BaseModel, list, dict)):
                yield from unknown_fields(item, f"{path}{key}.")


def field_label(path: str) -> str:
    """A path without its list indices (``messages.1.foo`` -> ``messages.foo``): one series a field."""
    return re.sub(r"\.\d+(?=\.|$)", "", path)


class FieldPolicy:
    """What a request with fields outside the API gets: a 400 naming the first (``strict``), or its
    answer, with a warning log line and a count per field."""

    def __init__(self, strict: bool = False) -> None:
        self.strict = strict
        self.ignored: dict[str, int] = {}  # field label -> requests that carried it

    def screen(self, body: BaseModel) -> None:
        paths = list(unknown_fields(body))
        if not paths:
            return
        if self.strict:
            raise APIError(400, f"{paths[0]}: {UNKNOWN_FIELD}", paths[0])
        logger.warning("fields outside the API ignored (--strict-request-fields refuses them): %s",
                       ", ".join(paths))
        for label in dict.fromkeys(field_label(p) for p in paths):
            if label not in self.ignored and len(self.ignored) >= MAX_FIELD_LABELS:
                label = OTHER_FIELDS
            self.ignored[label] = self.ignored.get(label, 0) + 1
