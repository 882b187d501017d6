"""One chat choice's output as the API returns it: reasoning split off (``--reasoning-parser``), then tool
calls read out of the rest (:class:`~kvforge.server.tools.ToolPlan`), whole or streamed.

A constrained output (a ``required`` or named ``tool_choice``, ``response_format``, ``structured_outputs``)
skips the reasoning parser: the constraint holds from the first token, so the whole output is the
constrained value.
"""
from __future__ import annotations

from typing import Literal, TypedDict

from typing_extensions import NotRequired  # typing's from Python 3.11

from kvforge.server.tools import ToolPlan, ToolStream, new_call_id
from kvforge.tool_parsing import ReasoningParser, StreamDelta


class FunctionJSON(TypedDict):
    name: str
    arguments: str  # a JSON object, as text


class ToolCallJSON(TypedDict):
    id: str
    type: Literal["function"]
    function: FunctionJSON


class AssistantMessage(TypedDict):
    """A whole choice's ``message``."""

    role: Literal["assistant"]
    content: str | None
    reasoning_content: NotRequired[str | None]  # with a reasoning parser
    tool_calls: NotRequired[list[ToolCallJSON]]


class FunctionDeltaJSON(TypedDict):
    name: NotRequired[str]  # in a call's first delta
    arguments: str


class ToolCallDeltaJSON(TypedDict):
    """A streamed call: the first delta of a call has its id, type and name; later ones argument fragments."""

    index: int
    id: NotRequired[str]
    type: NotRequired[Literal["function"]]
    function: FunctionDeltaJSON


class ChatDelta(TypedDict, total=False):
    """A streamed choice's ``delta``: keys only where there is something to say."""

    reasoning_content: str
    content: str
    tool_calls: list[ToolCallDeltaJSON]


class ChoiceOutput:
    """One choice: :meth:`message` for a whole output; :meth:`delta` per streamed piece, ``final`` on the
    last (it flushes what the parsers held back)."""

    def __init__(self, plan: ToolPlan, reasoning: type[ReasoningParser] | None, constrained: bool):
        self.plan = plan
        self.reasoning_cls = None if constrained else reasoning
        self.reasoning = self.reasoning_cls() if self.reasoning_cls else None
        self.tools: ToolStream = plan.stream()
        self.call_ids: dict[int, str] = {}

    @property
    def has_calls(self) -> bool:
        return bool(self.call_ids)

    def finish_reason(self, reason: str | None) -> str | None:
        """``tool_calls`` for an output that ended by itself with calls (OpenAI's and vLLM's)."""
        return "tool_calls" if reason == "stop" and self.has_calls else reason

    # -- whole -------------------------------------------------------------------------------------------
    def message(self, text: str) -> AssistantMessage:
        reasoning = None
        if self.reasoning_cls is not None:
            reasoning, content_text = self.reasoning_cls().parse(text)
            text = content_text or ""
        content, calls = self.plan.parse(text)
        msg: AssistantMessage = {"role": "assistant", "content": content if (content or not calls) else None}
        if self.reasoning_cls is not None:
            msg["reasoning_content"] = reasoning
        if calls:
            msg["tool_calls"] = []
            for i, call in enumerate(calls):
                self.call_ids[i] = new_call_id()
                msg["tool_calls"].append({"id": self.call_ids[i], "type": "function",
                                          "function": {"name": call.name, "arguments": call.arguments}})
        return msg

    # -- streamed ----------------------------------------------------------------------------------------
    def delta(self, text: str, final: bool) -> ChatDelta:
        """The chat delta of one piece of output (keys only where there is something to say)."""
        reasoning = ""
        if self.reasoning is not None:
            reasoning, text = self.reasoning.feed(text)
            if final:
                r_end, c_end = self.reasoning.finish()
                reasoning, text = reasoning + r_end, text + c_end
        pieces = [self.tools.feed(text)] + ([self.tools.finish()] if final else [])
        out: ChatDelta = {}
        if reasoning:
            out["reasoning_content"] = reasoning
        content = "".join(p.content for p in pieces)
        if content:
            out["content"] = content
        calls = self._call_deltas(pieces)
        if calls:
            out["tool_calls"] = calls
        return out

    def _call_deltas(self, pieces: list[StreamDelta]) -> list[ToolCallDeltaJSON]:
        """OpenAI's streamed tool calls: a call's first delta has its id, type and name; later ones add
        argument fragments."""
        out: list[ToolCallDeltaJSON] = []
        for piece in pieces:
            for d in piece.tool_calls:
                if d.index not in self.call_ids:
                    self.call_ids[d.index] = new_call_id()
                    out.append({"index": d.index, "id": self.call_ids[d.index], "type": "function",
                                "function": {"name": d.name or "", "arguments": d.arguments}})
                elif out and out[-1]["index"] == d.index:  # merge fragments of one call in one delta
                    out[-1]["function"]["arguments"] += d.arguments
                else:
                    out.append({"index": d.index, "function": {"arguments": d.arguments}})
        return out
