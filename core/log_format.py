"""How kvforge's processes write log lines: ``text`` (the default) or ``json`` (one object per line).

``kvforge serve --log-format json`` is for log collectors (Loki, CloudWatch, Elasticsearch): every
line is a JSON object with ``time`` (ISO 8601, UTC), ``level``, ``logger``, ``message``, and, when the
line belongs to an HTTP request, ``request_id``; a traceback goes under ``exc_info``. A record may add
fields of its own with ``extra={"fields": {...}}`` (the server's request line does: method, path,
status, ...). The text format is ``<time> <LEVEL> <logger>: <message>``, with ``[<request id>]``
after the logger name when the line belongs to a request.

The format travels to child processes (the engine core process, its rank processes) in the
``KVFORGE_LOG_FORMAT`` environment variable, which :func:`configure_logging` sets. It lives in core,
not in the server, because those processes log too and core never imports the server.
"""
from __future__ import annotations

import datetime
import json
import logging
import os
from typing import Any

LOG_FORMATS = ("text", "json")
#: the environment variable that hands the format to child processes
LOG_FORMAT_ENV = "KVFORGE_LOG_FORMAT"
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_TEXT_FORMAT_WITH_ID = "%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s"


class TextFormatter(logging.Formatter):
    """``TEXT_FORMAT``, with ``[<request id>]`` after the logger name when the record has one."""

    def __init__(self, prefix: str = ""):
        super().__init__(prefix + TEXT_FORMAT)
        self._with_id = logging.PercentStyle(prefix + _TEXT_FORMAT_WITH_ID)

    def formatMessage(self, record: logging.LogRecord) -> str:
        if getattr(record, "request_id", None):
            return self._with_id.format(record)
        return super().formatMessage(record)


class JsonFormatter(logging.Formatter):
    """One JSON object per record; ``fields``: added to every object (e.g. a rank process's ``rank``)."""

    def __init__(self, fields: dict[str, Any] | None = None):
        super().__init__()
        self.fields = dict(fields or {})

    def format(self, record: logging.LogRecord) -> str:
        when = datetime.datetime.fromtimestamp(record.created, tz=datetime.timezone.utc)
        obj: dict[str, Any] = {"time": when.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
                               "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        request_id = getattr(record, "request_id", None)
        if request_id:
            obj["request_id"] = request_id
        obj.update(self.fields)
        extra = getattr(record, "fields", None)
        if isinstance(extra, dict):
            obj.update(extra)
        if record.exc_info:
            obj["exc_info"] = self.formatException(record.exc_info)
        elif record.exc_text:
            obj["exc_info"] = record.exc_text
        if record.stack_info:
            obj["stack_info"] = self.formatStack(record.stack_info)
        # NOTE: one line per record: json.dumps escapes the newlines of messages and tracebacks
        return json.dumps(obj, ensure_ascii=False, default=str)


def configure_logging(level: int | str, fmt: str = "text", *, prefix: str = "",
                      fields: dict[str, Any] | None = None) -> logging.Handler:
    """Replace the root logger's handlers with one stderr handler in ``fmt``; returns it.

    ``prefix``: put before every text line (a rank process's ``[rank N] ``); ``fields``: added to every
    JSON object. ``json`` also routes ``warnings.warn`` through logging and turns off Hugging Face's
    download progress bars, so that every line stays an object. Child processes started afterwards
    inherit the format (``KVFORGE_LOG_FORMAT``).
    """
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format: must be one of {', '.join(LOG_FORMATS)}, got {fmt!r}")
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter(fields) if fmt == "json" else TextFormatter(prefix))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
    os.environ[LOG_FORMAT_ENV] = fmt
    if fmt == "json":
        logging.captureWarnings(True)
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    return handler


def inherited_format() -> str:
    """The format a child process should use: its parent's (``KVFORGE_LOG_FORMAT``), else ``text``."""
    fmt = os.environ.get(LOG_FORMAT_ENV, "text")
    return fmt if fmt in LOG_FORMATS else "text"
