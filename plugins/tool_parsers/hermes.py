"""Hermes-style tool calls (Hermes 2 Pro / 3, Qwen2.5, Qwen3)::

    Let me check.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

One or more calls; the text around them is content. A call whose JSON is not ``{"name": ..., "arguments":
{...}}`` is content, tags included. An output that ends inside a call (the model stopped at EOS before
``</tool_call>``) is parsed as if closed, and is content if that fails.
"""
from __future__ import annotations

from kvforge.tool_parsing import FunctionCall, ToolParser

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    def _consume(self, text: str, final: bool) -> tuple[list[str | FunctionCall], int]:
        items: list[str | FunctionCall] = []
        pos = 0
        while True:
            start = text.find(OPEN, pos)
            if start < 0:  # plain text, except a suffix that may grow into <tool_call>
                end = len(text) if final else len(text) - self._held_back(text[pos:], OPEN)
                items.append(text[pos:end])
                return items, end
            items.append(text[pos:start])
            body = start + len(OPEN)
            close = text.find(CLOSE, body)
            if close < 0:
                if not final:
                    return items, start  # an open call: wait for its close tag
                items.append(self._hermes_call(text[body:]) or text[start:])
                return items, len(text)
            items.append(self._hermes_call(text[body:close]) or text[start:close + len(CLOSE)])
            pos = close + len(CLOSE)

    def _hermes_call(self, body: str) -> FunctionCall | None:
        obj = self._decode(body)
        return self._call(obj.get("name"), obj.get("arguments")) if isinstance(obj, dict) else None
