"""Tool-call and reasoning parsers: the contract between a model's raw output text and the chat API.

Each model family marks tool calls and reasoning in its own text format (Hermes' ``<tool_call>`` tags,
Mistral's ``[TOOL_CALLS]``, DeepSeek-R1's ``</think>``). A :class:`ToolParser` splits an output into
content and :class:`FunctionCall` s; a :class:`ReasoningParser` splits it into reasoning and content.
Both are plugins (hooks ``register_tool_parsers`` and ``register_reasoning_parsers``, looked up with
:func:`get_tool_parser` / :func:`get_reasoning_parser`). The server builds one instance per request,
because streaming keeps state, and calls ``parse`` for a whole output or ``feed`` / ``finish`` while
streaming.

NOTE: the streaming invariant. For ANY split of an output into chunks fed in order, then ``finish()``,
the streamed content concatenates to ``parse(text).content or ""``; call ``i`` streams its name exactly
once and argument fragments that concatenate to ``parse(text).calls[i].arguments``; as many calls stream
as ``parse`` finds. For a reasoning parser, both streams concatenate to ``parse``'s two parts (None read
as ""). The base classes hold it by construction: ``parse`` IS the stream of a single chunk, and a
subclass writes only ``_consume``, which must never decide something that later text could change.

Whitespace: content (and reasoning) that is whitespace only is reported as None, so a stream holds back
leading whitespace until something else follows, and drops it if nothing does. Otherwise text is kept
verbatim, newlines around markers included (as vLLM does).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Union

from kvforge.plugin_manager import get_plugin_manager

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

#: a value as ``json.loads`` returns it
JSONValue = Union[dict[str, "JSONValue"], list["JSONValue"], str, int, float, bool, None]


@dataclass
class FunctionCall:
    name: str
    arguments: str  # JSON text of an object: json.dumps(args, ensure_ascii=False), e.g. '{"city": "Paris"}'


@dataclass
class ParsedToolCalls:
    """A whole model output, parsed."""

    content: str | None  # the text outside the tool calls; None when it is empty or whitespace only
    calls: list[FunctionCall]


@dataclass
class ToolCallDelta:
    """One streamed piece of tool call number ``index`` (0-based, in order of appearance)."""

    index: int
    name: str | None = None  # set exactly once per index: on the first delta of that call
    arguments: str = ""  # a fragment of the arguments JSON text


@dataclass
class StreamDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class _LeadingWhitespace:
    """Holds a stream back while all of it is whitespace (``parse`` reports that as None)."""

    def __init__(self) -> None:
        self.held = ""
        self.open = False  # something other than whitespace went out: pass everything through

    def push(self, text: str) -> str:
        if self.open:
            return text
        self.held += text
        if not self.held.strip():
            return ""
        self.open, text, self.held = True, self.held, ""
        return text


class _TextStream:
    """Helpers both parser kinds give their subclasses' ``_consume``."""

    @staticmethod
    def _held_back(text: str, *markers: str) -> int:
        """The length of the longest suffix of ``text`` that is a proper prefix of a marker: what must wait."""
        for n in range(min(len(text), max(map(len, markers)) - 1), 0, -1):
            if any(marker.startswith(text[-n:]) for marker in markers):
                return n
        return 0

    @staticmethod
    def _decode_at(text: str, pos: int) -> tuple[JSONValue, int] | None:
        """The JSON value starting exactly at ``pos`` and the index after it; None if there is none (yet)."""
        try:
            return json.JSONDecoder().raw_decode(text, pos)
        except (ValueError, RecursionError):
            return None

    @classmethod
    def _decode(cls, text: str) -> JSONValue:
        """``text`` (surrounding whitespace allowed) as one JSON value; None if it is not one."""
        stripped = text.strip()
        found = cls._decode_at(stripped, 0)
        return found[0] if found is not None and found[1] == len(stripped) else None


class ToolParser(_TextStream):
    """Splits one model output into content and function calls; one instance per request.

    A subclass implements :meth:`_consume` and inherits ``parse``, ``feed`` and ``finish``. The built-in
    parsers stream each call whole (its name and complete arguments in one delta) the moment it closes:
    until then it may still turn out malformed, and a malformed call is content.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None = None):
        self.tokenizer = tokenizer  # the request's tokenizer, for formats that need it; may be None
        self._pending = ""  # fed but not consumed yet: an open call, or a suffix that may start a marker
        self._content = _LeadingWhitespace()
        self._num_calls = 0

    def parse(self, text: str) -> ParsedToolCalls:
        """The whole output at once (the stream of one chunk, so streaming agrees); never raises."""
        fresh = type(self)(self.tokenizer)
        deltas = (fresh.feed(text), fresh.finish())
        names: dict[int, str] = {}
        arguments: dict[int, str] = {}
        for delta in deltas:
            for piece in delta.tool_calls:
                if piece.name is not None:
                    names[piece.index] = piece.name
                arguments[piece.index] = arguments.get(piece.index, "") + piece.arguments
        content = "".join(d.content for d in deltas)
        return ParsedToolCalls(content or None, [FunctionCall(names[i], arguments[i]) for i in sorted(arguments)])

    def feed(self, delta: str) -> StreamDelta:
        """Streaming: the next piece of output text; returns what can be told apart already."""
        self._pending += delta
        return self._step(final=False)

    def finish(self) -> StreamDelta:
        """The output ended: flush what was held back (an unclosed call parses or becomes content)."""
        return self._step(final=True)

    def _step(self, final: bool) -> StreamDelta:
        items, used = self._consume(self._pending, final)
        self._pending = self._pending[used:]
        if final and self._pending:  # what a subclass left unexplained at the end is content
            items, self._pending = [*items, self._pending], ""
        out = StreamDelta()
        for item in items:
            if isinstance(item, FunctionCall):
                out.tool_calls.append(ToolCallDelta(self._num_calls, item.name, item.arguments))
                self._num_calls += 1
            else:
                out.content += self._content.push(item)
        return out

    def _consume(self, text: str, final: bool) -> tuple[list[str | FunctionCall], int]:
        """Interpret a prefix of ``text`` (the output fed and not consumed yet).

        :return: its pieces of content and its completed calls, in order, and the prefix's length. Consume
            only what no later text can reinterpret: hold back an open call, or a suffix that could start a
            marker (:meth:`_held_back`). With ``final`` the output has ended: consume everything.

        The base class knows no tool-call format: everything is content.
        """
        return [text], len(text)

    @staticmethod
    def _call(name: object, arguments: object) -> FunctionCall | None:
        """A call if ``name`` is a non-empty string and ``arguments`` an object (or the JSON text of one),
        with the arguments normalised to ``json.dumps(..., ensure_ascii=False)``; None otherwise."""
        if isinstance(arguments, str):  # some models encode the arguments object as a JSON string
            arguments = ToolParser._decode(arguments)
        if not (isinstance(name, str) and name.strip() and isinstance(arguments, dict)):
            return None
        try:
            return FunctionCall(name.strip(), json.dumps(arguments, ensure_ascii=False, allow_nan=False))
        except (TypeError, ValueError, RecursionError):  # not JSON-able (non-string keys, inf, too deep)
            return None


class ReasoningParser(_TextStream):
    """Splits one model output into reasoning and content; one instance per request.

    A subclass implements :meth:`_consume` and inherits ``parse``, ``feed`` and ``finish``.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None = None):
        self.tokenizer = tokenizer
        self._pending = ""
        self._reasoning = _LeadingWhitespace()
        self._content = _LeadingWhitespace()

    def parse(self, text: str) -> tuple[str | None, str | None]:
        """``(reasoning_content, content)`` of a whole output, None for a part that is absent or blank."""
        fresh = type(self)(self.tokenizer)
        (reasoning, content), (reasoning_end, content_end) = fresh.feed(text), fresh.finish()
        return (reasoning + reasoning_end) or None, (content + content_end) or None

    def feed(self, delta: str) -> tuple[str, str]:
        """Streaming: the next piece of output text; returns ``(reasoning piece, content piece)``."""
        self._pending += delta
        return self._step(final=False)

    def finish(self) -> tuple[str, str]:
        """The output ended: flush what was held back."""
        return self._step(final=True)

    def _step(self, final: bool) -> tuple[str, str]:
        reasoning, content, used = self._consume(self._pending, final)
        self._pending = self._pending[used:]
        if final and self._pending:
            content, self._pending = content + self._pending, ""
        return self._reasoning.push(reasoning), self._content.push(content)

    def _consume(self, text: str, final: bool) -> tuple[str, str, int]:
        """Interpret a prefix of ``text`` as ``(reasoning, content, its length)``, with the same rule as
        :meth:`ToolParser._consume`. The base class finds no reasoning: everything is content."""
        return "", text, len(text)


def _resolve(kind: str, name: str, contract: type) -> type:
    cls = get_plugin_manager().get(kind, name)  # ValueError listing the valid names for an unknown one
    if not (isinstance(cls, type) and issubclass(cls, contract)):
        plugin = get_plugin_manager().registries[kind].plugin_of(name)
        raise TypeError(f"{kind} {name!r} from plugin {plugin!r} is {cls!r}, "
                        f"not a subclass of kvforge.tool_parsing.{contract.__name__}")
    return cls


def get_tool_parser(name: str) -> type[ToolParser]:
    """The tool parser class registered as ``name`` (``ValueError`` listing the valid names if unknown)."""
    return _resolve("tool_parser", name, ToolParser)


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The reasoning parser class registered as ``name`` (``ValueError`` listing the valid names if unknown)."""
    return _resolve("reasoning_parser", name, ReasoningParser)
