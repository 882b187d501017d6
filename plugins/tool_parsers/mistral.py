"""Mistral tool calls, in either of its two forms::

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": ..., "arguments": ...}]
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}

Text before (or between) the ``[TOOL_CALLS]`` groups is content. A group is complete when its JSON closes;
one that is malformed is content, from its ``[TOOL_CALLS]`` up to the next one (or the end).
"""
from __future__ import annotations

import re

from kvforge.tool_parsing import FunctionCall, ToolParser

MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"
NAME = re.compile(r"\s*[\w.\-]+\s*")


class MistralToolParser(ToolParser):
    def _consume(self, text: str, final: bool) -> tuple[list[str | FunctionCall], int]:
        items: list[str | FunctionCall] = []
        pos = 0
        while True:
            start = text.find(MARKER, pos)
            if start < 0:  # plain text, except a suffix that may grow into [TOOL_CALLS]
                end = len(text) if final else len(text) - self._held_back(text[pos:], MARKER)
                items.append(text[pos:end])
                return items, end
            items.append(text[pos:start])
            group = self._group(text, start + len(MARKER))
            if group is None:  # its JSON has not closed
                if not final:
                    return items, start
                after = text.find(MARKER, start + len(MARKER))
                pos = len(text) if after < 0 else after
                items.append(text[start:pos])
                continue
            calls, end = group
            if calls:
                items.extend(calls)
            else:
                items.append(text[start:end])
            pos = end

    def _group(self, text: str, pos: int) -> tuple[list[FunctionCall] | None, int] | None:
        """The calls after a marker at ``pos`` (None: not calls) and where they end; None until the JSON closes."""
        body = len(text) - len(text[pos:].lstrip())
        if body == len(text):
            return None
        if text[body] == "[":  # the JSON list form
            found = self._decode_at(text, body)
            if found is None:
                return None
            value, end = found
            if not isinstance(value, list):  # never: the JSON starts with "["
                return None, end
            calls = [call for o in value if isinstance(o, dict)
                     and (call := self._call(o.get("name"), o.get("arguments"))) is not None]
            return (calls if calls and len(calls) == len(value) else None), end  # all or nothing
        args_at = text.find(ARGS, pos)  # the name[ARGS]{...} form
        if args_at < 0:
            return None
        obj_at = len(text) - len(text[args_at + len(ARGS):].lstrip())
        if obj_at == len(text):
            return None
        if text[obj_at] != "{":
            return None, obj_at
        found = self._decode_at(text, obj_at)
        if found is None:
            return None
        name = text[pos:args_at]
        call = self._call(name, found[0]) if NAME.fullmatch(name) else None
        return ([call] if call else None), found[1]
