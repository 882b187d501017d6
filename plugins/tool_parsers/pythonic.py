"""Pythonic tool calls (Llama 3.2, Llama 4): a Python list of calls with keyword arguments::

    <|python_start|>[get_weather(city="Paris", unit="c"), get_time()]<|python_end|>

The wrappers are optional. Arguments must be literals of JSON's types (str, int, float, bool, None,
lists, dicts with string keys), read with ``ast``, never evaluated. All or nothing: the whole output is a
call list, or it is content. Output that cannot start such a list (``[1] See ...``) streams as content
at once; one that can is held back to the end, since any later text could make it content.
"""
from __future__ import annotations

import ast
import re

from kvforge.tool_parsing import FunctionCall, ToolParser

START, END = "<|python_start|>", "<|python_end|>"
IDENTIFIER = re.compile(r"[A-Za-z_]\w*")


class PythonicToolParser(ToolParser):
    def __init__(self, tokenizer=None):
        super().__init__(tokenizer)
        self._is_content = False  # decided once the output's start cannot open a call list

    def _consume(self, text: str, final: bool) -> tuple[list[str | FunctionCall], int]:
        if not self._is_content and not final:
            self._is_content = not _may_open_calls(text)
        if self._is_content:
            return [text], len(text)
        if not final:
            return [], 0
        calls = self._calls(text)
        return ([*calls] if calls else [text]), len(text)

    def _calls(self, text: str) -> list[FunctionCall] | None:
        text = text.strip()
        text = text[len(START):] if text.startswith(START) else text
        text = text[:-len(END)] if text.endswith(END) else text
        try:
            tree = ast.parse(text.strip(), mode="eval").body
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return None
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = [call for node in tree.elts if (call := self._one_call(node)) is not None]
        return calls if len(calls) == len(tree.elts) else None  # all or nothing

    def _one_call(self, node: ast.expr) -> FunctionCall | None:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or node.args:
            return None
        arguments = {}
        for keyword in node.keywords:
            try:
                value = ast.literal_eval(keyword.value)
                if keyword.arg is None or not _is_json(value):  # **kwargs, or a tuple, set, bytes, complex...
                    return None
            except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
                return None
            arguments[keyword.arg] = value
        return self._call(node.func.id, arguments)


def _may_open_calls(text: str) -> bool:
    """Whether ``text`` is blank or a prefix of ``[<|python_start|>] [ name (``, possibly with more after."""
    head = text.lstrip()
    if START.startswith(head):
        return True
    head = head[len(START):].lstrip() if head.startswith(START) else head
    if not head or head[0] != "[":
        return not head
    head = head[1:].lstrip()
    name = IDENTIFIER.match(head)
    if name is None:
        return not head
    rest = head[name.end():].lstrip()
    return not rest or rest[0] == "("


def _is_json(value) -> bool:
    if value is None or isinstance(value, (str, bool, int, float)):
        return True
    if isinstance(value, list):
        return all(_is_json(v) for v in value)
    return isinstance(value, dict) and all(isinstance(k, str) and _is_json(v) for k, v in value.items())
