"""``POST /v1/responses`` and ``GET /v1/responses/{id}``: OpenAI's Responses API on the chat machinery.

A request's input items become a chat conversation (``responses_protocol.conversation``), rendered with
the model's chat template and the request's function tools; the output is split as chat's is (the
server's ``--reasoning-parser``, then the request's :class:`~kvforge.server.tools.ToolPlan`) into output
items: a ``reasoning`` item, a ``message`` and ``function_call`` items. Streamed, the same items are
built from typed events (``response.output_text.delta``...), numbered from 0. Finished responses are kept
in a bounded :class:`~kvforge.server.response_store.ResponseStore` unless ``store`` is false, for
``GET /v1/responses/{id}`` and ``previous_response_id``. docs/responses.md describes the fields.
"""
from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any, AsyncGenerator, AsyncIterator, Generator, Iterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from kvforge.errors import EngineDeadError, RequestFailedError
from kvforge.sampling_params import SamplingParams, StructuredOutputsParams
from kvforge.server.chat_media import ImagePart, engine_prompt, load_images
from kvforge.server.disconnect import AbortingStreamingResponse, until_disconnect
from kvforge.server.errors import APIError, bad_request_from_value_error
from kvforge.server.protocol import JSON_MODE_SCHEMA, Constraint
from kvforge.server.request_fields import FieldPolicy
from kvforge.server.response_store import ResponseStore, StoredResponse, json_bytes
from kvforge.server.responses_protocol import (
    ITEM,
    FunctionChoice,
    Message,
    ResponsesRequest,
    TextFormatJSONObject,
    TextFormatJSONSchema,
    conversation,
    item_json,
)
from kvforge.server.tools import ToolOptions, ToolPlan, new_call_id
from kvforge.tool_parsing import ReasoningParser, StreamDelta, get_reasoning_parser

if TYPE_CHECKING:
    from kvforge.outputs import RequestOutput
    from kvforge.server.models import ServedModel, ServedModels
    from kvforge.server.openai_api import OpenAIServing

#: the store's bounds, as the 404 and 400 for an id it does not hold say them
_KEPT = "kvforge keeps the {} most recent responses created with store=true, {} bytes of them at most"

logger = logging.getLogger("kvforge.server")


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def add_responses_routes(app: FastAPI, models: ServedModels, store: ResponseStore, fields: FieldPolicy) -> None:
    """Register the endpoints; a request's ``model`` picks the served model as chat's does."""

    @app.post("/v1/responses")
    async def create_response(req: ResponsesRequest, request: Request):
        fields.screen(req)
        served = models.resolve(req.model)
        return await until_disconnect(request, create(req, served, store))

    def stored(response_id: str) -> StoredResponse:
        found = store.get(response_id)
        if found is None:
            raise APIError(404, f"No response found with id '{response_id}' "
                                f"({_KEPT.format(store.capacity, store.max_bytes)})", "response_id", code="not_found")
        return found

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str):
        return JSONResponse(stored(response_id).body)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        stored(response_id)
        store.delete(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    @app.get("/v1/responses/{response_id}/input_items")
    async def list_input_items(response_id: str, after: str | None = None, limit: int = 20, order: str = "desc"):
        """OpenAI's ``include`` query changes nothing here: these items carry no optional data."""
        if not 1 <= limit <= 100:
            raise APIError(400, f"limit: must be in [1, 100], got {limit}", "limit")
        if order not in ("asc", "desc"):
            raise APIError(400, f"order: must be 'asc' or 'desc', got {order!r}", "order")
        found = stored(response_id)
        items = [item_json(item, response_id, i) for i, item in enumerate(found.items[:found.input_count])]
        if order == "desc":
            items.reverse()
        if after is not None:
            at = next((i for i, item in enumerate(items) if item["id"] == after), None)
            if at is None:
                raise APIError(400, f"after: no input item {after!r} in response '{response_id}'", "after")
            items = items[at + 1:]
        page = items[:limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}


async def create(req: ResponsesRequest, served: ServedModel, store: ResponseStore
                 ) -> JSONResponse | AbortingStreamingResponse:
    """Answer one request: the whole response, or its event stream with ``stream: true``."""
    serving: OpenAIServing = served.serving
    options: ToolOptions = getattr(serving, "tool_options", None) or ToolOptions()
    for name in ("user", "safety_identifier"):
        if getattr(req, name) is not None:
            logger.info("request from %s %r", name, getattr(req, name))
    history: list[Any] = []
    previous: StoredResponse | None = None
    if req.previous_response_id is not None:
        previous = store.get(req.previous_response_id)
        if previous is None:
            raise APIError(400, f"previous_response_id: Previous response with id '{req.previous_response_id}' not "
                                f"found ({_KEPT.format(store.capacity, store.max_bytes)})",
                           "previous_response_id", code="previous_response_not_found")
        history = previous.items
    items = history + req.items()
    images = await load_images(input_images(items, len(history)), serving.engine, serving.media)
    items_bytes = _stored_size(req, items, previous, store)
    plan = _tool_plan(req, options)
    constraint = _format_constraint(req)
    tools_constraint = plan.constraint()  # a required or named tool choice's
    if tools_constraint is not None:
        if constraint is not None:
            raise APIError(400, f"text.format: a {plan.mode} tool_choice constrains the output itself; it cannot be "
                                f"combined with a {req.text_format().type} format", "text.format")
        constraint = Constraint(tools_constraint, "tools")
    try:
        prompt = await serving.render_conversation(conversation(items, req.instructions), True, None,
                                                   tools=plan.template_tools())
    except APIError as exc:  # the chat error names messages: here they came from input
        if exc.param != "messages":
            raise
        raise APIError(exc.status, exc.message.replace("messages", "input", 1), "input") from None
    ids = await serving.encode(prompt, False, "input")
    max_tokens = serving.max_tokens(len(ids), req.max_output_tokens, "input")
    try:
        params = SamplingParams(temperature=_or(req.temperature, 1.0), top_p=_or(req.top_p, 1.0),
                                max_tokens=max_tokens, stop=req.stop, ignore_eos=req.ignore_eos,
                                structured_outputs=constraint.params if constraint is not None else None)
    except ValueError as exc:
        raise bad_request_from_value_error(exc) from None
    if constraint is not None:
        await serving.check_structured(constraint.params, constraint.field)
    reasoning = get_reasoning_parser(options.reasoning_parser) if options.reasoning_parser else None
    turn = _Turn(req, served.name, plan, reasoning if constraint is None else None, len(ids), items, store, serving,
                 items_bytes)
    started = await serving.start([engine_prompt(prompt, ids, images)], [params], turn.id, 0,
                                  served.lora_request)
    if req.stream:
        return serving.stream(turn.events(serving.merged(started)), started)
    text, finish, n_out, cached = "", None, 0, 0
    async for _, out in serving.merged(started):
        turn.input_tokens = len(out.prompt_token_ids) or turn.input_tokens  # images' placeholders expanded
        cached = out.num_cached_tokens
        for c in out.outputs:
            text, n_out, finish = text + c.text, n_out + len(c.token_ids), c.finish_reason or finish
    output, reasoning_text = turn.whole_output(text, finish)
    body = turn.finished(output, finish, n_out, cached, await turn.count_tokens(reasoning_text))
    turn.keep(body)
    return JSONResponse(body)


def input_images(items: list[Any], earlier: int) -> list[ImagePart]:
    """The conversation's ``input_image`` parts in order: this request's named ``input.N.content.M``, the
    ``earlier`` items' (a ``previous_response_id`` chain's) ``previous_response_id``."""
    parts = []
    for k, item in enumerate(items):
        for j, part in item.images() if isinstance(item, Message) else ():
            where = f"input.{k - earlier}.content.{j}" if k >= earlier else "previous_response_id"
            if part.image_url is None:
                raise APIError(400, f"{where}: a file_id image is not supported (kvforge has no file store): "
                                    "send image_url", where)
            parts.append(ImagePart(where, "input_image", part.image_url))
    return parts


def _stored_size(req: ResponsesRequest, items: list[Any], previous: StoredResponse | None,
                 store: ResponseStore) -> int | None:
    """The JSON size of the conversation a stored response would keep (None with ``store: false``): a 400
    naming ``input`` before any work when it alone is over the store's byte limit."""
    if not req.store:
        return None
    size = store.measure(items, previous)
    if size > store.max_bytes:
        raise APIError(400, f"input: with store=true this conversation would take {size} bytes of the response "
                            f"store, over its limit of {store.max_bytes} (--max-responses-store-bytes); send "
                            "store=false or start a new conversation", "input")
    return size


def _or(value: float | None, default: float) -> float:
    return default if value is None else value


def _tool_plan(req: ResponsesRequest, options: ToolOptions) -> ToolPlan:
    choice = req.tool_choice.name if isinstance(req.tool_choice, FunctionChoice) else req.tool_choice
    return ToolPlan.build(list(req.tools or []), choice, req.parallel_tool_calls, options)


def _format_constraint(req: ResponsesRequest) -> Constraint | None:
    fmt = req.text_format()
    if isinstance(fmt, TextFormatJSONObject):
        return Constraint(StructuredOutputsParams(json=JSON_MODE_SCHEMA), "text.format")
    if isinstance(fmt, TextFormatJSONSchema):
        return Constraint(StructuredOutputsParams(json=fmt.schema_), "text.format")
    return None


class _Turn:
    """One request's response: its echoed settings, its output items (whole or streamed), its storage."""

    def __init__(self, req: ResponsesRequest, model: str, plan: ToolPlan, reasoning: type[ReasoningParser] | None,
                 input_tokens: int, items: list[Any], store: ResponseStore, serving: OpenAIServing,
                 items_bytes: int | None = None):
        self.req, self.model, self.plan, self.reasoning = req, model, plan, reasoning
        self.input_tokens, self.items, self.store, self.serving = input_tokens, items, store, serving
        self.items_bytes = items_bytes  # ResponseStore.measure(items), when create() measured it
        self.id = _new_id("resp")
        self.created_at = int(time.time())
        self.encrypted_reasoning = "reasoning.encrypted_content" in (req.include or [])

    # -- the response object ------------------------------------------------------------------------
    def head(self) -> dict[str, Any]:
        """The response before any output: the request's settings, echoed as OpenAI echoes them."""
        req, plan = self.req, self.plan
        choice = {"type": "function", "name": plan.name} if plan.mode == "named" else plan.mode
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": "in_progress",
                "background": False, "error": None, "incomplete_details": None, "instructions": req.instructions,
                "max_output_tokens": req.max_output_tokens, "max_tool_calls": None, "metadata": req.metadata or {},
                "model": self.model, "output": [], "parallel_tool_calls": plan.parallel,
                "previous_response_id": req.previous_response_id, "reasoning": None, "service_tier": None,
                "store": req.store, "temperature": _or(req.temperature, 1.0),
                "text": {"format": req.text_format().model_dump(by_alias=True, exclude_none=True)},
                "tool_choice": choice, "tools": [t.echo() for t in req.tools or []], "top_logprobs": None,
                "top_p": _or(req.top_p, 1.0), "truncation": "disabled", "usage": None, "user": req.user,
                "safety_identifier": req.safety_identifier}

    def finished(self, output: list[dict], finish: str | None, output_tokens: int, cached: int,
                 reasoning_tokens: int) -> dict[str, Any]:
        body = self.head() | {"output": output, "usage": {
            "input_tokens": self.input_tokens,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": self.input_tokens + output_tokens}}
        if finish == "length":
            body |= {"status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"}}
        else:
            body |= {"status": "completed", "completed_at": int(time.time())}
        return body

    def failed(self, output: list[dict], status: int, message: str) -> dict[str, Any]:
        code = "invalid_prompt" if status < 500 else "server_error"
        return self.head() | {"status": "failed", "output": output, "error": {"code": code, "message": message}}

    def keep(self, body: dict[str, Any]) -> None:
        """Store the response (``store: true``) with the conversation it ends: its output items but a call
        cut short (its arguments are not JSON yet), and none of a failed response's. One larger than the
        store's byte limit with its output is not kept (a warning says so)."""
        if not self.req.store:
            return
        output = []
        for item in body["output"] if body["status"] != "failed" else []:
            try:
                output.append(ITEM.validate_python(item))
            except ValidationError:
                pass
        items_bytes = self.store.measure(self.items) if self.items_bytes is None else self.items_bytes
        if not self.store.put(body, self.items + output, items_bytes + sum(json_bytes(i) for i in output),
                              len(self.items)):
            logger.warning("response %s not stored: with its output it is larger than the response store's limit "
                           "of %d bytes", self.id, self.store.max_bytes)

    async def count_tokens(self, text: str) -> int:
        """Reasoning tokens, counted by tokenizing the reasoning text again (0 without a reasoning parser)."""
        if not text:
            return 0
        tok = self.serving.tokenizer()
        return len(await asyncio.to_thread(tok.encode, text, add_special_tokens=False))

    # -- whole --------------------------------------------------------------------------------------
    def whole_output(self, text: str, finish: str | None) -> tuple[list[dict], str]:
        """The output items of a whole output, and its reasoning text."""
        items: list[dict] = []
        reasoning = None
        if self.reasoning is not None:
            reasoning, content_text = self.reasoning().parse(text)
            text = content_text or ""
        if reasoning:
            items.append(_reasoning_item(_new_id("rs"), reasoning, "completed", self.encrypted_reasoning))
        content, calls = self.plan.parse(text)
        if content or not calls:
            status = "incomplete" if finish == "length" else "completed"
            items.append(_message_item(_new_id("msg"), content or "", status))
        for i, call in enumerate(calls):  # a constrained output cut short: its last call is
            cut = finish == "length" and self.plan.constrained and i == len(calls) - 1
            items.append({"id": _new_id("fc"), "type": "function_call", "call_id": new_call_id(),
                          "name": call.name, "arguments": call.arguments, "status": "incomplete" if cut else "completed"})
        return items, reasoning or ""

    # -- streamed -----------------------------------------------------------------------------------
    async def events(self, outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncGenerator[str, None]:
        """The server-sent events of the response; a failure ends them with ``response.failed``."""
        stream = _EventStream(self.encrypted_reasoning)
        yield stream.event("response.created", response=self.head())
        yield stream.event("response.in_progress", response=self.head())
        reasoner = self.reasoning() if self.reasoning is not None else None
        tools = self.plan.stream()
        finish, n_out, cached = None, 0, 0
        try:
            async for _, out in outputs:
                self.input_tokens = len(out.prompt_token_ids) or self.input_tokens  # images' placeholders expanded
                cached = out.num_cached_tokens
                for c in out.outputs:
                    n_out, finish = n_out + len(c.token_ids), c.finish_reason or finish
                    text = c.text
                    if reasoner is not None:
                        reasoning, text = reasoner.feed(text)
                        for chunk in stream.reasoning(reasoning):
                            yield chunk
                    for chunk in stream.delta(tools.feed(text)):
                        yield chunk
        except (RequestFailedError, EngineDeadError) as exc:
            status, message = ((exc.failure.status, exc.failure.message) if isinstance(exc, RequestFailedError)
                               else (503, str(exc)))
            body = self.failed(stream.output, status, message)
            yield stream.event("response.failed", response=body)
            self.keep(body)
            return
        if reasoner is not None:  # flush what the parsers held back
            reasoning, text = reasoner.finish()
            for chunk in [*stream.reasoning(reasoning), *stream.delta(tools.feed(text))]:
                yield chunk
        for chunk in [*stream.delta(tools.finish()), *stream.close(finish == "length", self.plan.mode)]:
            yield chunk
        body = self.finished(stream.output, finish, n_out, cached, await self.count_tokens(stream.reasoning_text))
        yield stream.event("response.completed" if body["status"] == "completed" else "response.incomplete",
                           response=body)
        self.keep(body)


def _message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": []}]
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def _reasoning_item(item_id: str, text: str | None, status: str, encrypted: bool = False) -> dict[str, Any]:
    """``encrypted``: include=["reasoning.encrypted_content"] asked for the item's reasoning in a form a
    stateless client sends back: kvforge has no secret, so it is the text, base64-encoded."""
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    item = {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}
    if encrypted and text is not None:
        item["encrypted_content"] = base64.b64encode(text.encode()).decode()
    return item


class _EventStream:
    """The numbered events of one streamed response, and the output items they build (``output``, in
    output-index order). Items open as their first piece comes; the reasoning item closes when the
    answer starts, a call when the next one starts, the rest at :meth:`close`."""

    def __init__(self, encrypted_reasoning: bool = False):
        self.encrypted_reasoning = encrypted_reasoning
        self.seq = 0
        self.output: list[dict] = []
        self.reasoning_text = ""
        self.text = ""
        self.reasoning_at: int | None = None  # output index of the reasoning item
        self.message_at: int | None = None
        self.calls_at: dict[int, int] = {}  # call index -> output index
        self.open_call: int | None = None  # output index of the call still streaming

    def event(self, kind: str, **fields: Any) -> str:
        data = json.dumps({"type": kind, "sequence_number": self.seq, **fields}, ensure_ascii=False)
        self.seq += 1
        return f"event: {kind}\ndata: {data}\n\n"

    def _add(self, item: dict) -> tuple[int, str]:
        self.output.append(item)
        index = len(self.output) - 1
        return index, self.event("response.output_item.added", output_index=index, item=item)

    def _where(self, index: int) -> dict[str, Any]:
        return {"item_id": self.output[index]["id"], "output_index": index}

    def reasoning(self, piece: str) -> Iterator[str]:
        if not piece:
            return
        if self.reasoning_at is None:
            self.reasoning_at, added = self._add(_reasoning_item(_new_id("rs"), None, "in_progress"))
            yield added
            yield self.event("response.content_part.added", **self._where(self.reasoning_at), content_index=0,
                             part={"type": "reasoning_text", "text": ""})
        self.reasoning_text += piece
        yield self.event("response.reasoning_text.delta", **self._where(self.reasoning_at), content_index=0,
                         delta=piece)

    def _close_reasoning(self) -> Iterator[str]:
        at = self.reasoning_at
        if at is None or self.output[at]["status"] != "in_progress":
            return
        part = {"type": "reasoning_text", "text": self.reasoning_text}
        yield self.event("response.reasoning_text.done", **self._where(at), content_index=0, text=part["text"])
        yield self.event("response.content_part.done", **self._where(at), content_index=0, part=part)
        self.output[at] = _reasoning_item(self.output[at]["id"], part["text"], "completed", self.encrypted_reasoning)
        yield self.event("response.output_item.done", output_index=at, item=self.output[at])

    def delta(self, delta: StreamDelta) -> Iterator[str]:
        if delta.content:
            yield from self._close_reasoning()
            at = self.message_at
            if at is None:
                at = yield from self._open_message()
            self.text += delta.content
            yield self.event("response.output_text.delta", **self._where(at), content_index=0,
                             delta=delta.content, logprobs=[])
        for d in delta.tool_calls:
            yield from self._close_reasoning()
            if d.index not in self.calls_at:
                yield from self._close_call("completed")
                item = {"id": _new_id("fc"), "type": "function_call", "call_id": new_call_id(),
                        "name": d.name or "", "arguments": "", "status": "in_progress"}
                self.calls_at[d.index], added = self._add(item)
                self.open_call = self.calls_at[d.index]
                yield added
            at = self.calls_at[d.index]
            if d.arguments:
                self.output[at]["arguments"] += d.arguments
                yield self.event("response.function_call_arguments.delta", **self._where(at), delta=d.arguments)

    def _open_message(self) -> Generator[str, None, int]:
        """The events that open the message item; returns its output index."""
        self.message_at, added = self._add(_message_item(_new_id("msg"), None, "in_progress"))
        yield added
        yield self.event("response.content_part.added", **self._where(self.message_at), content_index=0,
                         part={"type": "output_text", "text": "", "annotations": []})
        return self.message_at

    def _close_call(self, status: str) -> Iterator[str]:
        at, self.open_call = self.open_call, None
        if at is None:
            return
        item = self.output[at] = self.output[at] | {"status": status}
        yield self.event("response.function_call_arguments.done", **self._where(at), arguments=item["arguments"])
        yield self.event("response.output_item.done", output_index=at, item=item)

    def close(self, truncated: bool, tool_mode: str) -> Iterator[str]:
        """Close every open item, in output-index order; an answer with neither text nor calls is an
        empty message (as a whole output's is)."""
        yield from self._close_reasoning()
        if self.message_at is None and not self.calls_at:
            yield from self._open_message()
        status = "incomplete" if truncated else "completed"
        for at in range(len(self.output)):
            if at == self.message_at:
                part = {"type": "output_text", "text": self.text, "annotations": []}
                yield self.event("response.output_text.done", **self._where(at), content_index=0, text=self.text,
                                 logprobs=[])
                yield self.event("response.content_part.done", **self._where(at), content_index=0, part=part)
                self.output[at] = _message_item(self.output[at]["id"], self.text, status)
                yield self.event("response.output_item.done", output_index=at, item=self.output[at])
            elif at == self.open_call:  # a constrained output is calls only: cut short, its last is incomplete
                yield from self._close_call("incomplete" if truncated and tool_mode in ("named", "required")
                                            else "completed")
