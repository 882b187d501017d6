"""The request body of ``POST /v1/responses`` (OpenAI's Responses API), and its input items as the chat
template's messages.

As with chat (``server/protocol.py``), every field is honoured, accepted without effect, or refused: the
Responses fields kvforge cannot honour (``RESPONSES_REFUSED``) are a 400 saying why; a field outside the
API is ``server/request_fields.py``'s. docs/responses.md lists them, and a test holds the lists to this model.

Input items are the ones a client sends back to continue a conversation: messages (``type`` optional),
the model's ``function_call`` items and their ``function_call_output`` results, and ``reasoning`` items
(accepted so that a response's ``output`` can be sent back as it is; their text is not rendered, as chat
templates drop earlier turns' reasoning). What an item carries but the prompt does not show costs stored
memory and no tokens, so no token limit bounds it: ``MAX_UNRENDERED_ITEM_BYTES`` does.
"""
from __future__ import annotations

import hashlib
import json
from typing import Annotated, Any, Literal, Union

from pydantic import (
    Discriminator,
    Field,
    StrictStr,
    Tag,
    TypeAdapter,
    field_validator,
    model_validator,
)

from kvforge.server.request_fields import RequestBody
from kvforge.server.tools import FunctionDef

#: Responses fields kvforge does not implement: a 400 whenever one is set to anything but its neutral
#: value (``None`` always; the value given here too).
RESPONSES_REFUSED: dict[str, tuple[str, Any]] = {
    "background": ("background responses are not supported: kvforge answers while the request is open", False),
    "background_options": ("background responses are not supported", None),
    "conversation": ("conversation objects are not supported: chain responses with previous_response_id", None),
    "context_management": ("server-side context compaction is not supported", []),
    "max_tool_calls": ("kvforge runs no built-in tools, so it counts no tool calls", None),
    "prompt": ("stored prompt templates are not supported: send input and instructions", None),
    "top_logprobs": ("log probabilities are not returned by the Responses API yet: use /v1/chat/completions", 0),
    "truncation": ("kvforge never drops input to fit the context: a too-long input is a 400", "disabled"),
    "moderation": ("moderation is not supported", None),
    "image": ("image output is not supported", None),
    "access_programs": ("access programs are OpenAI's", None),
}
#: metadata bounds (OpenAI's)
MAX_METADATA_KEYS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512
#: bytes (JSON) an input item may carry that are not rendered into the prompt: a whole ``reasoning`` item,
#: ids, annotations, logprobs. The reasoning kvforge returns is bounded by the output's tokens (~4 bytes
#: each): 1 MiB leaves room for ~250k tokens of it sent back, while refusing a client that would fill the
#: response store with items that cost no tokens (issue 34)
MAX_UNRENDERED_ITEM_BYTES = 2**20


# -- input items ------------------------------------------------------------------------------------
class InputText(RequestBody):
    type: Literal["input_text"]
    text: str


class InputImage(RequestBody):
    """An image part of a user message: ``image_url`` a data URL or an http(s) URL (a ``file_id`` of
    OpenAI's file store is a 400); for a model that takes images (``server/chat_media.py``)."""
    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    detail: Literal["low", "high", "auto", "original"] | None = None  # accepted without effect


class OutputText(RequestBody):
    type: Literal["output_text"]
    text: str
    annotations: list[Any] = []  # echoed back by clients; kvforge writes none
    logprobs: list[Any] | None = None


class Refusal(RequestBody):
    type: Literal["refusal"]
    refusal: str


ContentPart = Annotated[Union[InputText, InputImage, OutputText, Refusal], Field(discriminator="type")]
Status = Literal["in_progress", "completed", "incomplete"]


class Message(RequestBody):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: list[ContentPart] | str  # the list first: its errors are the ones reported
    id: str | None = None  # an output message sent back
    status: Status | None = None
    phase: Literal["commentary", "final_answer"] | None = None  # accepted as clients echo it; not rendered

    @model_validator(mode="after")
    def _parts_fit_the_role(self):
        kinds = {p.type for p in self.content} if isinstance(self.content, list) else set()
        if self.role != "assistant" and kinds - {"input_text", "input_image"}:
            raise ValueError(f"a {self.role} message takes input_text and input_image parts, got "
                             f"{sorted(kinds - {'input_text', 'input_image'})}")
        if self.role == "assistant" and kinds & {"input_text", "input_image"}:
            raise ValueError("an assistant message takes output_text (or refusal) parts, not input_text or input_image")
        return self

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.refusal if isinstance(p, Refusal) else p.text for p in self.content
                       if not isinstance(p, InputImage))

    def images(self) -> list[tuple[int, InputImage]]:
        """Its image parts and their places in ``content``."""
        return [(j, p) for j, p in enumerate(self.content) if isinstance(p, InputImage)] \
            if isinstance(self.content, list) else []

    def template_content(self) -> str | list[dict]:
        """Its content as the chat template gets it: the text, or with images, ``{"type": "text"}`` and
        ``{"type": "image"}`` parts in order (as chat's ``ChatMessage.template_dict``)."""
        if not self.images() or not isinstance(self.content, list):
            return self.text()
        return [{"type": "image"} if isinstance(p, InputImage) else
                {"type": "text", "text": p.refusal if isinstance(p, Refusal) else p.text} for p in self.content]


class FunctionCallItem(RequestBody):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON text of an object
    id: str | None = None
    status: Status | None = None

    @field_validator("arguments")
    @classmethod
    def _an_object(cls, v):
        try:
            args = json.loads(v)
        except ValueError:
            args = None
        if not isinstance(args, dict):
            raise ValueError("arguments must be the JSON text of an object")
        return v


class FunctionCallOutputItem(RequestBody):
    type: Literal["function_call_output"]
    call_id: str
    output: list[InputText] | str
    id: str | None = None
    status: Status | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class ReasoningItem(RequestBody):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict[str, Any]] = []
    content: list[dict[str, Any]] | None = None
    # what include=["reasoning.encrypted_content"] asked for: kept, not rendered (as the text is not)
    encrypted_content: str | None = None
    status: Status | None = None


_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


def _item_type(v: Any) -> str | None:
    kind = v.get("type", "message") if isinstance(v, dict) else getattr(v, "type", None)
    return kind if kind in _ITEM_TYPES else None


InputItem = Annotated[
    Union[Annotated[Message, Tag("message")], Annotated[FunctionCallItem, Tag("function_call")],
          Annotated[FunctionCallOutputItem, Tag("function_call_output")], Annotated[ReasoningItem, Tag("reasoning")]],
    Discriminator(_item_type, custom_error_type="item_type", custom_error_message=(
        "an input item must be a message, function_call, function_call_output or reasoning item "
        "(kvforge runs no built-in tools, so no other item can come back)")),
]
ITEM = TypeAdapter(InputItem)
#: the id prefix OpenAI gives each item type
_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def item_json(item: Any, response_id: str, index: int) -> dict[str, Any]:
    """An input item as ``GET /v1/responses/{id}/input_items`` lists it (OpenAI's shape): with an id (one
    derived from the response and the item's place when the client sent none, so pages are stable) and a
    status; a message's text as parts (``input_text``, or ``output_text`` for the assistant's)."""
    body = item.model_dump(mode="json", by_alias=True, exclude_none=True)
    if body.get("id") is None:
        digest = hashlib.sha256(f"{response_id}:{index}".encode()).hexdigest()[:32]
        body["id"] = f"{_ID_PREFIX[body['type']]}_{digest}"
    body.setdefault("status", "completed")
    if body["type"] == "message" and isinstance(body["content"], str):
        kind = "output_text" if body["role"] == "assistant" else "input_text"
        body["content"] = [{"type": kind, "text": body["content"]} | ({"annotations": []} if kind == "output_text"
                                                                      else {})]
    return body


def unrendered_bytes(item: Any) -> int:
    """The JSON size of what an input item carries but :func:`conversation` does not render: all of a
    reasoning item; a message's or a call's id, status and annotations; not a message's text, a call's name
    and arguments, or an output's text (rendered, so bounded by the context length)."""
    exclude: Any = set()
    if isinstance(item, Message):
        exclude = {"content"} if isinstance(item.content, str) else {"content": {"__all__": {"text", "refusal"}}}
    elif isinstance(item, FunctionCallItem):
        exclude = {"name", "arguments"}
    elif isinstance(item, FunctionCallOutputItem):
        exclude = {"output"} if isinstance(item.output, str) else {"output": {"__all__": {"text"}}}
    return len(item.model_dump_json(exclude=exclude).encode())


def conversation(items: list[Any], instructions: str | None) -> list[dict]:
    """The items as chat-template messages: ``instructions`` first (a system message), calls as an
    assistant message's ``tool_calls`` (arguments as objects, as vLLM passes them), merged into the
    assistant message just before them, and outputs as ``tool`` messages."""
    conv: list[dict] = [{"role": "system", "content": instructions}] if instructions else []
    for item in items:
        if isinstance(item, Message):
            conv.append({"role": item.role, "content": item.template_content()})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": json.loads(item.arguments)}}
            last = conv[-1] if conv else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:  # NOTE: content "" not None: templates such as SmolLM2's read every message's content
                conv.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            conv.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    return conv


# -- tools and text formats -------------------------------------------------------------------------
class FunctionTool(FunctionDef):
    """A Responses function tool: chat's function definition, flat, with its ``type``."""

    type: Literal["function"]

    def echo(self) -> dict:
        """The tool as the response echoes it (OpenAI's ``FunctionTool``)."""
        return {"type": "function", "name": self.name, "description": self.description,
                "parameters": self.parameters, "strict": self.strict}


class FunctionChoice(RequestBody):
    type: Literal["function"]
    name: str


class TextFormatText(RequestBody):
    type: Literal["text"]


class TextFormatJSONObject(RequestBody):
    type: Literal["json_object"]


class TextFormatJSONSchema(RequestBody):
    type: Literal["json_schema"]
    name: str
    schema_: dict = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


TextFormat = Annotated[Union[TextFormatText, TextFormatJSONObject, TextFormatJSONSchema], Field(discriminator="type")]


class TextConfig(RequestBody):
    format: TextFormat = TextFormatText(type="text")
    verbosity: Any = None

    @field_validator("verbosity", mode="before")
    @classmethod
    def _refuse_verbosity(cls, v):
        if v is not None:
            raise ValueError("verbosity controls are not supported; leave text.verbosity out of the request")
        return v


class StreamOptions(RequestBody):
    include_obfuscation: bool = True  # accepted: kvforge pads no event, whatever it says


#: ``include`` values: each names output data of an item kind (OpenAI's ``ResponseIncludable``)
Includable = Literal["reasoning.encrypted_content", "message.output_text.logprobs", "file_search_call.results",
                     "web_search_call.results", "web_search_call.action.sources", "message.input_image.image_url",
                     "computer_call_output.output.image_url", "code_interpreter_call.outputs"]
#: ``include`` values kvforge cannot give: a 400 saying why
INCLUDE_REFUSED = {"message.output_text.logprobs": "log probabilities are not returned by the Responses API yet: "
                                                   "use /v1/chat/completions"}


# -- the request --------------------------------------------------------------------------------------
class ResponsesRequest(RequestBody):
    model: str | None = None
    input: list[InputItem] | str  # the list first: its errors are the ones reported
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[StrictStr, StrictStr] | None = None
    user: str | None = None  # written in the server's log line, as with chat
    safety_identifier: str | None = None  # OpenAI's successor of user: logged the same way
    prompt_cache_key: str | None = None  # accepted without effect: the prefix cache needs no routing hint
    service_tier: str | None = None  # accepted without effect: kvforge has one tier
    prompt_cache_retention: str | None = None  # accepted without effect, as prompt_cache_key
    prompt_cache_options: dict[str, Any] | None = None  # accepted without effect, as prompt_cache_key
    # vLLM's sampling extras that benchmark clients (guidellm) send here too: honoured
    stop: StrictStr | list[StrictStr] | None = None
    ignore_eos: bool = False
    reasoning: dict[str, Any] | None = None  # accepted only without settings (all values null)
    include: list[Includable] | None = None
    # the refused Responses fields (see RESPONSES_REFUSED): declared so that each one's 400 names it
    background: Any = None
    background_options: Any = None
    conversation: Any = None
    context_management: Any = None
    max_tool_calls: Any = None
    prompt: Any = None
    top_logprobs: Any = None
    truncation: Any = None
    moderation: Any = None
    image: Any = None
    access_programs: Any = None

    @field_validator(*RESPONSES_REFUSED, mode="before")
    @classmethod
    def _refuse(cls, v, info):
        reason, neutral = RESPONSES_REFUSED[info.field_name]
        if v is None or v == neutral:
            return None
        raise ValueError(f"{reason}; leave {info.field_name} out of the request")

    @field_validator("include")
    @classmethod
    def _include(cls, v):
        for value in v or []:
            if value in INCLUDE_REFUSED:
                raise ValueError(f"{value}: {INCLUDE_REFUSED[value]}; leave it out of include")
        return v

    @field_validator("reasoning", mode="before")
    @classmethod
    def _reasoning(cls, v):
        if isinstance(v, dict) and any(x is not None for x in v.values()):
            raise ValueError(f"reasoning controls ({', '.join(k for k, x in v.items() if x is not None)}) are not "
                             "supported: a model reasons as its chat template makes it, and the server's "
                             "--reasoning-parser splits the reasoning out; leave reasoning out of the request")
        return v

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, v):
        for i, tool in enumerate(v or []):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise ValueError(f"tools[{i}] is a {kind!r} tool: kvforge runs no built-in tools (web search, "
                                 "file search, code interpreter, MCP...); only function tools are supported")
        return v

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _choice_kinds(cls, v):
        if isinstance(v, dict) and v.get("type") != "function":
            raise ValueError(f"a {v.get('type')!r} tool choice is not supported: give none, auto, required or "
                             '{"type": "function", "name": ...}')
        return v

    @field_validator("input")
    @classmethod
    def _some_input(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("input must not be an empty list")
        for i, item in enumerate(v if isinstance(v, list) else []):
            size = unrendered_bytes(item)
            if size > MAX_UNRENDERED_ITEM_BYTES:
                raise ValueError(f"item {i} ({item.type}) carries {size} bytes that are not rendered into the prompt "
                                 f"(reasoning, ids, annotations); at most {MAX_UNRENDERED_ITEM_BYTES} are accepted "
                                 "per item")
        return v

    @field_validator("metadata")
    @classmethod
    def _metadata_bounds(cls, v):
        if v is None:
            return v
        if len(v) > MAX_METADATA_KEYS:
            raise ValueError(f"at most {MAX_METADATA_KEYS} keys, got {len(v)}")
        for key, value in v.items():
            if len(key) > MAX_METADATA_KEY_CHARS or len(value) > MAX_METADATA_VALUE_CHARS:
                raise ValueError(f"key {key[:80]!r}: keys may have {MAX_METADATA_KEY_CHARS} characters and values "
                                 f"{MAX_METADATA_VALUE_CHARS}, got {len(key)} and {len(value)}")
        return v

    def items(self) -> list[Any]:
        """``input`` as items (a string is one user message)."""
        if isinstance(self.input, str):
            return [Message(role="user", content=self.input)]
        return list(self.input)

    def text_format(self) -> TextFormat:
        return self.text.format if self.text is not None else TextFormatText(type="text")
