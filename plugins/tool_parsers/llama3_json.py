"""Llama 3.1 / 3.2 JSON tool calls::

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}

The ``<|python_tag|>`` is optional; ``"arguments"`` is accepted for ``"parameters"``; several calls are
separated by ``;``. All or nothing: the whole output is calls, or it is content. An output that does not
start (after whitespace) with ``{`` or ``<|python_tag|>`` is content and streams at once; one that does is
held back to the end, since any later text could make it content.
"""
from __future__ import annotations

from kvforge.tool_parsing import FunctionCall, ToolParser

TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    def __init__(self, tokenizer=None):
        super().__init__(tokenizer)
        self._is_content = False  # decided from the output's first characters

    def _consume(self, text: str, final: bool) -> tuple[list[str | FunctionCall], int]:
        if not self._is_content and not final:
            head = text.lstrip()
            if head.startswith(TAG):
                head = head[len(TAG):].lstrip()
            elif TAG.startswith(head):  # blank, or a prefix of the tag
                return [], 0
            self._is_content = bool(head) and not head.startswith("{")
        if self._is_content:
            return [text], len(text)
        if not final:
            return [], 0
        calls = self._calls(text)
        return ([*calls] if calls else [text]), len(text)

    def _calls(self, text: str) -> list[FunctionCall] | None:
        text = text.strip()
        pos = len(TAG) if text.startswith(TAG) else 0
        calls = []
        while True:
            pos = _skip_space(text, pos)
            found = self._decode_at(text, pos)
            if found is None:
                return None
            obj, pos = found
            if not isinstance(obj, dict):
                return None
            call = self._call(obj.get("name"), obj.get("parameters", obj.get("arguments")))
            if call is None:
                return None
            calls.append(call)
            pos = _skip_space(text, pos)
            if pos == len(text):
                return calls
            if text[pos] != ";":
                return None
            pos += 1


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos
