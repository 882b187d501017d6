"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: Anthropic's Messages API on the chat
machinery.

A request's ``system`` and ``messages`` become a chat conversation (``CountTokensRequest.conversation``),
rendered with the model's chat template and the request's tools; the text of a final assistant message
(a prefill) follows the generation prompt, and the answer continues it. The output is split as chat's is
(the server's ``--reasoning-parser``, then the request's :class:`~kvforge.server.tools.ToolPlan`) into
content blocks: ``thinking`` (when the request enables thinking), ``text`` and ``tool_use``. Streamed, the
same blocks come as Anthropic's events, one block open at a time. Errors on these routes take Anthropic's
shape (``server/errors.py``). docs/server.md ("Anthropic Messages API") describes the fields.
"""

from __future__ import annotations

import json
import uuid
from typing import TYPE_CHECKING, Any, AsyncGenerator, AsyncIterator, Iterator

import pydantic_core
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from kvforge.errors import EngineDeadError, RequestFailedError
from kvforge.sampling_params import SamplingParams, StructuredOutputsParams
from kvforge.server.anthropic_protocol import CountTokensRequest, MessagesRequest
from kvforge.server.chat_media import ImagePart, engine_prompt, load_images
from kvforge.server.disconnect import AbortingStreamingResponse, until_disconnect
from kvforge.server.errors import APIError, anthropic_error_body, bad_request_from_value_error
from kvforge.server.protocol import Constraint
from kvforge.server.request_fields import FieldPolicy
from kvforge.server.request_id import current_request
from kvforge.server.tools import FunctionDef, ToolOptions, ToolPlan
from kvforge.tool_parsing import ReasoningParser, StreamDelta, get_reasoning_parser

if TYPE_CHECKING:
    from kvforge.outputs import RequestOutput
    from kvforge.server.models import ServedModel, ServedModels
    from kvforge.server.openai_api import OpenAIServing

#: Anthropic's tool choices as ToolPlan's
_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def add_anthropic_routes(app: FastAPI, models: ServedModels, fields: FieldPolicy) -> None:
    """Register the two endpoints; a request's ``model`` picks the served model as chat's does."""

    @app.post("/v1/messages")
    async def create_message(req: MessagesRequest, request: Request):
        fields.screen(req)
        served = models.resolve(req.model)
        return await until_disconnect(request, create(req, served))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(req: CountTokensRequest):
        fields.screen(req)
        if req.image_urls():  # a model's image placeholders are counted where the engine processes prompts
            where = req.image_urls()[0][0]
            raise APIError(400, f"{where}: count_tokens does not count images yet; send the request without them",
                           where)
        _, ids = await render(req, models.resolve(req.model).serving)
        return {"input_tokens": len(ids)}


def tool_input(arguments: str) -> dict[str, Any]:
    """A ``tool_use`` block's ``input``: the call's arguments; for a call cut short by ``max_tokens``, as
    much of them as was written: the complete values (as the anthropic client parses a stream's partial
    JSON: a string cut short is left out)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        value = pydantic_core.from_json(arguments, allow_partial=True) if arguments else {}
    return value if isinstance(value, dict) else {}


def new_tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def _functions(req: CountTokensRequest) -> list[FunctionDef]:
    return [FunctionDef(name=t.name, description=t.description, parameters=t.input_schema) for t in req.tools or []]


async def render(req: CountTokensRequest, serving: OpenAIServing) -> tuple[str, list[int]]:
    """The prompt and its token ids: the conversation through the chat template (with the tools), then
    the prefill's text, if any."""
    conv, prefill = req.conversation()
    tools = [f.template_dict() for f in _functions(req)] or None
    prompt = await serving.render_conversation(conv, True, None, tools=tools) + (prefill or "")
    return prompt, await serving.encode(prompt, False, "messages")


async def create(req: MessagesRequest, served: ServedModel) -> JSONResponse | AbortingStreamingResponse:
    """Answer one request: the whole message, or its event stream with ``stream: true``."""
    serving: OpenAIServing = served.serving
    options: ToolOptions = getattr(serving, "tool_options", None) or ToolOptions()
    http = current_request()
    if req.metadata is not None and req.metadata.user_id is not None and http is not None:
        http.user = req.metadata.user_id  # written in the request line
    plan = _tool_plan(req, options)
    constraint = _constraint(req, plan)
    thinking = req.thinking.type if req.thinking is not None and req.thinking.type != "disabled" else None
    if thinking and options.reasoning_parser is None:
        raise APIError(
            400,
            f"thinking: {thinking} thinking needs the server to split reasoning out of "
            "the output, and it runs without --reasoning-parser; leave thinking out",
            "thinking",
        )
    if thinking and constraint is not None:
        raise APIError(
            400,
            f"thinking: {constraint.field} constrains the output from its first token, so the model "
            "cannot think first; leave thinking out, or use tool_choice auto or none",
            "thinking",
        )
    images = await load_images([ImagePart(where, "image", url) for where, url in req.image_urls()], serving.engine,
                               serving.media)
    prompt, ids = await render(req, serving)
    max_tokens = serving.max_tokens(len(ids), req.max_tokens, "messages")
    try:
        params = SamplingParams(
            temperature=_or(req.temperature, 1.0),
            top_p=_or(req.top_p, 1.0),
            top_k=req.top_k or 0,
            max_tokens=max_tokens,
            stop=req.stop_sequences or None,
            structured_outputs=constraint.params if constraint is not None else None,
        )
    except ValueError as exc:
        raise bad_request_from_value_error(exc) from None
    if constraint is not None:
        await serving.check_structured(constraint.params, constraint.field)
    # NOTE: a constrained output skips the reasoning parser (as chat's): the constraint holds from the first token
    reasoning = (
        get_reasoning_parser(options.reasoning_parser) if options.reasoning_parser and constraint is None else None
    )
    reply = _Reply(served.name, plan, reasoning, req.show_thinking(), req.stop_sequences or [], len(ids))
    started = await serving.start([engine_prompt(prompt, ids, images)], [params], reply.id, 0, served.lora_request)
    if req.stream:
        return serving.stream(reply.events(serving.merged(started)), started)
    text, finish, matched, n_out = "", None, None, 0
    async for _, out in serving.merged(started):
        reply.input_tokens = len(out.prompt_token_ids) or reply.input_tokens  # images' placeholders expanded
        for c in out.outputs:
            text, n_out = text + c.text, n_out + len(c.token_ids)
            if c.finish_reason is not None:
                finish, matched = c.finish_reason, c.stop_reason
    return JSONResponse(reply.whole(text, finish, matched, n_out))


def _or(value: float | None, default: float) -> float:
    return default if value is None else value


def _tool_plan(req: MessagesRequest, options: ToolOptions) -> ToolPlan:
    choice, functions = req.tool_choice, _functions(req)
    if choice is not None and choice.type != "none" and not functions:
        raise APIError(400, f"tool_choice: {choice.type!r} needs tools; the request has none", "tool_choice")
    if choice is not None and choice.type == "tool" and choice.name not in [f.name for f in functions]:
        raise APIError(
            400, f"tool_choice: {choice.name!r} is not one of the tools {[f.name for f in functions]}", "tool_choice"
        )
    name = None if choice is None else choice.name if choice.type == "tool" else _CHOICES[choice.type]
    no_parallel = getattr(choice, "disable_parallel_tool_use", None)
    return ToolPlan.build(functions, name, None if no_parallel is None else not no_parallel, options)


def _constraint(req: MessagesRequest, plan: ToolPlan) -> Constraint | None:
    """A forced tool choice's constraint (``any``, ``tool``), or ``output_config.format``'s; not both."""
    fmt = req.output_config.format if req.output_config is not None else None
    tools = plan.constraint()
    if tools is not None and fmt is not None:
        raise APIError(
            400,
            f"output_config.format: a forced ({'any' if plan.mode == 'required' else 'tool'}) tool_choice constrains the output "
            "itself; it cannot be combined with a format",
            "output_config.format",
        )
    if tools is not None:
        return Constraint(tools, "tool_choice")
    return Constraint(StructuredOutputsParams(json=fmt.schema_), "output_config.format") if fmt is not None else None


class _Reply:
    """One request's message: its content blocks, whole or streamed, and why it stopped."""

    def __init__(
        self,
        model: str,
        plan: ToolPlan,
        reasoning: type[ReasoningParser] | None,
        show_thinking: bool,
        stop_sequences: list[str],
        input_tokens: int,
    ):
        self.model, self.plan, self.reasoning, self.show_thinking = model, plan, reasoning, show_thinking
        self.stop_sequences, self.input_tokens = stop_sequences, input_tokens
        self.id = f"msg_{uuid.uuid4().hex}"

    def head(self) -> dict[str, Any]:
        """The message before any content (``message_start``'s)."""
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": self.input_tokens, "output_tokens": 0},
        }

    def stop(self, finish: str | None, matched: int | str | None, called: bool) -> dict[str, Any]:
        """``stop_reason`` and ``stop_sequence``: ``max_tokens`` for an output cut at max_tokens, ``tool_use``
        for one with calls, ``stop_sequence`` for one that met a stop sequence, else ``end_turn``."""
        if finish == "length":
            return {"stop_reason": "max_tokens", "stop_sequence": None}
        if called:
            return {"stop_reason": "tool_use", "stop_sequence": None}
        if isinstance(matched, str) and matched in self.stop_sequences:
            return {"stop_reason": "stop_sequence", "stop_sequence": matched}
        return {"stop_reason": "end_turn", "stop_sequence": None}

    def whole(self, text: str, finish: str | None, matched: int | str | None, output_tokens: int) -> dict[str, Any]:
        blocks: list[dict[str, Any]] = []
        if self.reasoning is not None:
            thought, content_text = self.reasoning().parse(text)
            text = content_text or ""
            if thought and self.show_thinking:
                blocks.append({"type": "thinking", "thinking": thought, "signature": ""})
        content, calls = self.plan.parse(text)
        if content:
            blocks.append({"type": "text", "text": content})
        for call in calls:
            blocks.append(
                {"type": "tool_use", "id": new_tool_use_id(), "name": call.name, "input": tool_input(call.arguments)}
            )
        return self.head() | {
            "content": blocks,
            **self.stop(finish, matched, bool(calls)),
            "usage": {"input_tokens": self.input_tokens, "output_tokens": output_tokens},
        }

    async def events(self, outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncGenerator[str, None]:
        """The server-sent events of the message; a failure ends them with an ``error`` event."""
        blocks = _Blocks()
        yield _event("message_start", message=self.head())
        reasoner = self.reasoning() if self.reasoning is not None else None
        tools = self.plan.stream()
        finish, matched, n_out = None, None, 0
        try:
            async for _, out in outputs:
                self.input_tokens = len(out.prompt_token_ids) or self.input_tokens  # images' placeholders expanded
                for c in out.outputs:
                    n_out += len(c.token_ids)
                    if c.finish_reason is not None:
                        finish, matched = c.finish_reason, c.stop_reason
                    text = c.text
                    if reasoner is not None:
                        thought, text = reasoner.feed(text)
                        for chunk in blocks.thinking(thought if self.show_thinking else ""):
                            yield chunk
                    for chunk in blocks.delta(tools.feed(text)):
                        yield chunk
        except (RequestFailedError, EngineDeadError) as exc:
            status, message = (
                (exc.failure.status, exc.failure.message) if isinstance(exc, RequestFailedError) else (503, str(exc))
            )
            yield _event("error", error=anthropic_error_body(status, message)["error"])
            return
        if reasoner is not None:  # flush what the parsers held back
            thought, text = reasoner.finish()
            for chunk in [*blocks.thinking(thought if self.show_thinking else ""), *blocks.delta(tools.feed(text))]:
                yield chunk
        for chunk in [*blocks.delta(tools.finish()), *blocks.close()]:
            yield chunk
        yield _event(
            "message_delta",
            delta=self.stop(finish, matched, bool(blocks.calls)),
            usage={"input_tokens": self.input_tokens, "output_tokens": n_out},
        )
        yield _event("message_stop")


def _event(kind: str, **fields: Any) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields}, ensure_ascii=False)}\n\n"


class _Blocks:
    """The content blocks of one streamed message: a block starts with its first piece, and the one open
    before it stops then (Anthropic streams one block at a time); :meth:`close` stops the last."""

    def __init__(self):
        self.started = 0
        self.open: str | None = None  # the open block's type
        self.calls: dict[int, int] = {}  # a parsed call's index -> its block's index

    def _start(self, block: dict[str, Any]) -> Iterator[str]:
        yield from self.close()
        self.open, self.started = block["type"], self.started + 1
        yield _event("content_block_start", index=self.started - 1, content_block=block)

    def close(self) -> Iterator[str]:
        if self.open is not None:
            self.open = None
            yield _event("content_block_stop", index=self.started - 1)

    def thinking(self, piece: str) -> Iterator[str]:
        if not piece:
            return
        if self.open != "thinking":
            yield from self._start({"type": "thinking", "thinking": "", "signature": ""})
        yield _event("content_block_delta", index=self.started - 1, delta={"type": "thinking_delta", "thinking": piece})

    def delta(self, delta: StreamDelta) -> Iterator[str]:
        if delta.content:
            if self.open != "text":
                yield from self._start({"type": "text", "text": ""})
            yield _event(
                "content_block_delta", index=self.started - 1, delta={"type": "text_delta", "text": delta.content}
            )
        for d in delta.tool_calls:
            if d.index not in self.calls:
                yield from self._start({"type": "tool_use", "id": new_tool_use_id(), "name": d.name or "", "input": {}})
                self.calls[d.index] = self.started - 1
            if d.arguments:
                yield _event(
                    "content_block_delta",
                    index=self.calls[d.index],
                    delta={"type": "input_json_delta", "partial_json": d.arguments},
                )
