"""Function tools: a request's ``tools`` and ``tool_choice`` as a :class:`ToolPlan`, and the model's output
as content and tool calls.

``tool_choice`` (vLLM's behaviour, docs/tools.md):

- ``none`` (the default without tools): the output is content; tools still reach the chat template.
- ``auto`` (the default with tools): the model decides; the server's ``--tool-call-parser`` reads calls out
  of the text. Refused (400) unless the server runs with ``--enable-auto-tool-choice --tool-call-parser``.
- ``required``: the output is constrained (structured outputs) to a JSON array of ``{"name", "parameters"}``
  objects, one of the tools each, at least one (exactly one with ``parallel_tool_calls=false``).
- a named function: the output is constrained to that function's ``parameters`` schema: it IS the arguments.

So ``required`` and named choices always parse, whatever the model; ``auto`` is as good as the parser and
the model. Parsing never fails a request: text that is not a call stays content.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Literal

from pydantic import field_validator

from kvforge.sampling_params import StructuredOutputsParams
from kvforge.server.errors import APIError
from kvforge.server.request_fields import RequestBody
from kvforge.tool_parsing import FunctionCall, StreamDelta, ToolCallDelta, ToolParser, get_tool_parser

_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function names


class FunctionDef(RequestBody):
    name: str
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments object; None: any object
    strict: bool | None = None  # accepted: required and named choices are always held to the schema

    @field_validator("name")
    @classmethod
    def _name(cls, v):
        if not _NAME.match(v):
            raise ValueError(f"function name {v!r} must be 1 to 64 letters, digits, underscores or dashes")
        return v

    def arguments_schema(self) -> dict:
        return self.parameters if self.parameters is not None else {"type": "object"}

    def template_dict(self) -> dict:
        """The chat template's (and OpenAI's) ``{"type": "function", "function": {...}}`` entry."""
        fn = {"name": self.name} | ({"description": self.description} if self.description is not None else {})
        return {"type": "function", "function": fn | {"parameters": self.arguments_schema()}}


class ChatTool(RequestBody):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(RequestBody):
    name: str


class NamedToolChoice(RequestBody):
    type: Literal["function"]
    function: NamedFunction


@dataclass(frozen=True)
class ToolOptions:
    """The server's tool and reasoning flags (``kvforge serve``)."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None

    def __post_init__(self):
        from kvforge.tool_parsing import get_reasoning_parser

        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser NAME")
        if self.tool_call_parser is not None:
            get_tool_parser(self.tool_call_parser)  # ValueError listing the names
        if self.reasoning_parser is not None:
            get_reasoning_parser(self.reasoning_parser)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolPlan:
    """One request's tools and what its ``tool_choice`` makes of the output."""

    mode: Literal["none", "auto", "required", "named"]
    functions: list[FunctionDef] = field(default_factory=list)
    name: str | None = None  # the named function
    parallel: bool = True
    parser: type[ToolParser] | None = None  # auto's parser

    @classmethod
    def build(cls, functions: list[FunctionDef] | None, tool_choice: str | None, parallel_tool_calls: bool | None,
              options: ToolOptions, *, field: str = "tool_choice") -> ToolPlan:
        """``tool_choice``: None, ``"none" | "auto" | "required"``, or a function's name (callers unwrap
        their API's named-choice object). ``APIError`` 400 naming the field on a bad combination."""
        functions = list(functions or [])
        names = [f.name for f in functions]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise APIError(400, f"tools: function name(s) {twice} given more than once", "tools")
        if tool_choice is None:
            tool_choice = "auto" if functions else "none"
        parallel = True if parallel_tool_calls is None else parallel_tool_calls
        if tool_choice != "none" and not functions:
            raise APIError(400, f"{field}: {tool_choice!r} needs tools; the request has none", field)
        if tool_choice == "none":
            return cls("none", functions, parallel=parallel)
        if tool_choice == "auto":
            if not options.enable_auto_tool_choice or options.tool_call_parser is None:
                raise APIError(400, f'{field}: "auto" tool choice requires the server to run with '
                                    "--enable-auto-tool-choice and --tool-call-parser", field)
            return cls("auto", functions, parallel=parallel, parser=get_tool_parser(options.tool_call_parser))
        if tool_choice == "required":
            return cls("required", functions, parallel=parallel)
        if isinstance(tool_choice, str) and tool_choice in names:
            return cls("named", functions, name=tool_choice, parallel=parallel)
        raise APIError(400, f"{field}: {tool_choice!r} is not none, auto, required or one of the tools {names}", field)

    @property
    def constrained(self) -> bool:
        return self.mode in ("required", "named")

    def template_tools(self) -> list[dict] | None:
        return [f.template_dict() for f in self.functions] or None

    def constraint(self) -> StructuredOutputsParams | None:
        """The structured-output constraint that makes ``required`` and named choices parse."""
        if self.mode == "named":
            return StructuredOutputsParams(json=self._named().arguments_schema())
        if self.mode != "required":
            return None
        calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [f.name]},
                                                   "parameters": f.arguments_schema()},
                  "required": ["name", "parameters"], "additionalProperties": False} for f in self.functions]
        array = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        return StructuredOutputsParams(json=array | ({} if self.parallel else {"maxItems": 1}))

    def _named(self) -> FunctionDef:
        """The named choice's function (``build`` checked that it is one of the tools)."""
        return next(f for f in self.functions if f.name == self.name)

    def new_parser(self) -> ToolParser:
        """A fresh instance of auto's parser (``build`` gives every auto plan one)."""
        if self.parser is None:
            raise ValueError(f"a {self.mode!r} tool choice has no tool-call parser")
        return self.parser()

    # -- the output -----------------------------------------------------------------------------------
    def parse(self, text: str) -> tuple[str | None, list[FunctionCall]]:
        """A whole output as ``(content, calls)``, as :meth:`stream` gives it piece by piece. A constrained
        output is calls only, even one cut short by ``max_tokens``: its last call's arguments are then
        the JSON text so far (the wrapper of ``required``'s array never shows as content)."""
        if self.mode == "none":
            return text, []
        if self.mode == "named":
            return None, [FunctionCall(self._named().name, text.strip())]
        if self.mode == "required":
            stream = self.stream()
            deltas = [*stream.feed(text).tool_calls, *stream.finish().tool_calls]
            return None, [FunctionCall(d.name or "", d.arguments) for d in deltas]
        parsed = self.new_parser().parse(text)
        calls = parsed.calls if self.parallel else parsed.calls[:1]
        return (parsed.content if calls else text), calls

    def stream(self) -> ToolStream:
        return ToolStream(self)


class ToolStream:
    """One choice's output, streamed: :meth:`feed` each text delta, then :meth:`finish`; each returns a
    :class:`~kvforge.tool_parsing.StreamDelta` (content, and calls with their argument fragments)."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.parser = plan.new_parser() if plan.mode == "auto" else None
        self.buf = ""  # required: the JSON array so far
        self.pos = 0  # required: where the next element may start
        self.calls = 0  # calls streamed so far

    def feed(self, text: str) -> StreamDelta:
        mode = self.plan.mode
        if mode == "none":
            return StreamDelta(content=text)
        if self.parser is not None:  # auto
            return self._limit(self.parser.feed(text))
        if mode == "named":  # the output IS the arguments: stream it as they come
            out = StreamDelta()
            if self.calls == 0:
                out.tool_calls.append(ToolCallDelta(0, self.plan.name, ""))
                self.calls = 1
            if text:
                out.tool_calls.append(ToolCallDelta(0, None, text))
            return out
        self.buf += text
        return self._required_elements()

    def finish(self) -> StreamDelta:
        """What the output held back; for ``required``, an element cut short (by ``max_tokens``) as a
        last call: its arguments the JSON text so far, its name completed from the tools when only one
        begins with what was written (no call when none can be named)."""
        if self.parser is not None:  # auto
            return self._limit(self.parser.finish())
        out = StreamDelta()
        if self.plan.mode == "required":
            rest = self.buf[self.pos:].lstrip(" \t\r\n[,")
            cut = _CUT_ELEMENT.match(rest)
            if cut is not None:
                written = json_prefix(cut["name"])
                names = [f.name for f in self.plan.functions
                         if (f.name == written if cut["closed"] else f.name.startswith(written))]
                if len(names) == 1:
                    out.tool_calls.append(ToolCallDelta(self.calls, names[0], (cut["args"] or "").rstrip()))
                    self.calls += 1
        return out

    def _limit(self, delta: StreamDelta) -> StreamDelta:
        """``parallel_tool_calls=false`` under auto: the first call only."""
        if not self.plan.parallel:
            delta.tool_calls = [d for d in delta.tool_calls if d.index == 0]
        self.calls = max([self.calls] + [d.index + 1 for d in delta.tool_calls])
        return delta

    def _required_elements(self) -> StreamDelta:
        """Each array element as soon as it is complete (the constraint guarantees the shape)."""
        out = StreamDelta()
        decoder = json.JSONDecoder()
        while True:
            rest = self.buf[self.pos:]
            skipped = len(rest) - len(rest.lstrip(" \t\r\n[,"))
            if skipped == len(rest) or rest[skipped] == "]":
                return out
            try:
                value, end = decoder.raw_decode(self.buf, self.pos + skipped)
            except ValueError:  # the element is not complete yet
                return out
            self.pos = end
            calls = _required_calls([value])
            if calls:
                out.tool_calls.append(ToolCallDelta(self.calls, calls[0].name, calls[0].arguments))
                self.calls += 1


#: the start of a ``required`` array element cut short: its name (perhaps unfinished) and its arguments so far
_CUT_ELEMENT = re.compile(r'\{\s*"name"\s*:\s*"(?P<name>(?:[^"\\]|\\.)*)(?P<closed>")?'
                          r'(?:\s*,\s*"parameters"\s*:\s*(?P<args>.*))?', re.S)


def json_prefix(text: str) -> str:
    """The value of a JSON string's contents so far (escapes decoded; a dangling escape dropped)."""
    for end in range(len(text), max(-1, len(text) - 6), -1):
        try:
            return json.loads(f'"{text[:end]}"')
        except ValueError:
            continue
    return text


def _required_calls(value: object) -> list[FunctionCall]:
    """The calls of a ``required`` output (a list of ``{"name", "parameters"}``); [] if it is not one."""
    if not isinstance(value, list) or not value:
        return []
    calls = []
    for item in value:
        if not (isinstance(item, dict) and isinstance(item.get("name"), str) and isinstance(item.get("parameters"), dict)):
            return []
        calls.append(FunctionCall(item["name"], json.dumps(item["parameters"], ensure_ascii=False)))
    return calls
