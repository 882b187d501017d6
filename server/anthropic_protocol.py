"""The request bodies of ``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` (Anthropic's
Messages API), and their messages as the chat template's.

Every field of Anthropic's ``MessageCreateParams`` is honoured, accepted without effect
(``ANTHROPIC_WITHOUT_EFFECT``) or refused with a 400 naming it (``ANTHROPIC_REFUSED``); docs/server.md
lists them, and a test holds the lists to these models. Content blocks are text, ``tool_use`` and
``tool_result`` (rendered), and ``thinking`` / ``redacted_thinking`` echoed back on assistant turns
(accepted, not rendered: chat templates drop earlier turns' reasoning). An image or document block is a
400 saying the model takes none; any other block (server tools' blocks, search results...) is a 400.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from kvforge.sampling_params import MAX_STOP, MAX_STOP_CHARS
from kvforge.server.request_fields import RequestBody

#: request fields kvforge cannot honour: a 400 naming the field whenever one is set (to anything but null)
ANTHROPIC_REFUSED: dict[str, str] = {
    "container": "code execution containers are not supported: kvforge runs no server tools",
    "mcp_servers": "MCP connectors are not supported: kvforge calls no MCP server; give its tools as custom tools",
    "diagnostics": "prompt cache diagnostics are not supported: kvforge keeps no earlier messages to compare with",
}
#: request fields that cannot change this server's output: accepted (any value of their type), else ignored
ANTHROPIC_WITHOUT_EFFECT: dict[str, str] = {
    "cache_control": "kvforge's prefix cache is automatic: every prompt's blocks are cached while memory allows "
    "(on content blocks, system blocks and tools too)",
    "metadata": "metadata.user_id is written in the server's request log line, as chat's user is",
    "service_tier": "kvforge has one service tier",
    "inference_geo": "kvforge runs where it is deployed",
    "speed": "kvforge has one speed: as fast as it goes",
    "user_profile_id": "kvforge has no user profiles",
    "workspace_id": "kvforge has no workspaces",
}
#: tool names (Anthropic's rule)
TOOL_NAME = r"^[a-zA-Z0-9_-]{1,64}$"
#: block types a model served here cannot take, and what the 400 calls them
MEDIA_BLOCKS = {"image": "images", "document": "documents"}


def _refuse_media(v: Any) -> Any:
    """A ``mode="before"`` check of a tool result's blocks: an image or document block is a 400 saying why."""
    for i, block in enumerate(v if isinstance(v, list) else ()):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind in MEDIA_BLOCKS:
            raise ValueError(f"block {i} is an {kind} block: kvforge takes no {MEDIA_BLOCKS[kind]} in a tool result")
    return v


def _refuse_documents(v: Any) -> Any:
    """A ``mode="before"`` check of a message's blocks: a document block is a 400 saying why (an image
    block goes to a model that takes images)."""
    for i, block in enumerate(v if isinstance(v, list) else ()):
        if isinstance(block, dict) and block.get("type") == "document":
            raise ValueError("block {i} is a document block: kvforge's Messages API takes no documents".format(i=i))
    return v


def _template_content(parts: list) -> str | list[dict]:
    """A user turn's text, or with images, ``{"type": "text"}`` and ``{"type": "image"}`` parts in order
    (as chat's image messages reach the template)."""
    if not any(isinstance(p, ImageBlock) for p in parts):
        return "".join(p.text for p in parts)
    return [{"type": "image"} if isinstance(p, ImageBlock) else {"type": "text", "text": p.text} for p in parts]


# -- content blocks ---------------------------------------------------------------------------------
class CacheControl(RequestBody):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(RequestBody):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[dict[str, Any]] | None = None  # an assistant turn sent back; not rendered


class ToolUseBlock(RequestBody):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(RequestBody):
    type: Literal["tool_result"]
    tool_use_id: str
    content: list[TextBlock] | str = ""  # the list first: its errors are the ones reported
    is_error: bool | None = None  # accepted: a chat template's tool message has no error flag
    cache_control: CacheControl | None = None

    _media = field_validator("content", mode="before")(_refuse_media)

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)


class ImageSource(RequestBody):
    type: Literal["base64", "url"]
    media_type: str | None = None  # base64: image/jpeg, image/png, image/gif or image/webp
    data: str | None = None
    url: str | None = None

    def image_url(self) -> str | None:
        """The image as a URL ``kvforge.multimodal.media.load_image`` reads (a base64 source as a data URL)."""
        if self.type == "url":
            return self.url
        if self.data is None or self.media_type is None:
            return None
        return f"data:{self.media_type};base64,{self.data}"


class ImageBlock(RequestBody):
    """An image in a user message, for a model that takes images (``server/chat_media.py``)."""

    type: Literal["image"]
    source: ImageSource
    cache_control: CacheControl | None = None


class ThinkingBlock(RequestBody):
    type: Literal["thinking"]
    thinking: str
    signature: str = ""


class RedactedThinkingBlock(RequestBody):
    type: Literal["redacted_thinking"]
    data: str


_BLOCK_TYPES = ("text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking")


def _block_type(v: Any) -> str | None:
    kind = v.get("type") if isinstance(v, dict) else getattr(v, "type", None)
    return kind if kind in _BLOCK_TYPES else None


ContentBlock = Annotated[
    Union[
        Annotated[TextBlock, Tag("text")],
        Annotated[ImageBlock, Tag("image")],
        Annotated[ToolUseBlock, Tag("tool_use")],
        Annotated[ToolResultBlock, Tag("tool_result")],
        Annotated[ThinkingBlock, Tag("thinking")],
        Annotated[RedactedThinkingBlock, Tag("redacted_thinking")],
    ],
    Discriminator(
        _block_type,
        custom_error_type="block_type",
        custom_error_message=(
            "a content block must be text, image, tool_use, tool_result, thinking or redacted_thinking (kvforge runs no "
            "server tools, so none of their blocks can come back)"
        ),
    ),
]
#: the blocks each role may hold
_ROLE_BLOCKS = {
    "user": ("text", "image", "tool_result"),
    "assistant": ("text", "tool_use", "thinking", "redacted_thinking"),
    "system": ("text",),
}


class Message(RequestBody):
    role: Literal["user", "assistant", "system"]
    content: list[ContentBlock] | str  # the list first: its errors are the ones reported

    _media = field_validator("content", mode="before")(_refuse_documents)

    @model_validator(mode="after")
    def _blocks_fit_the_role(self):
        kinds = {b.type for b in self.content} if isinstance(self.content, list) else set()
        wrong = sorted(kinds - set(_ROLE_BLOCKS[self.role]))
        if wrong:
            raise ValueError(
                f"{self.role} messages take {', '.join(_ROLE_BLOCKS[self.role])} blocks, not {', '.join(wrong)}"
            )
        return self

    def text(self) -> str:
        """The text blocks, concatenated with no separator (as chat's text parts are)."""
        if isinstance(self.content, str):
            return self.content
        return "".join(b.text for b in self.content if isinstance(b, TextBlock))


# -- tools ------------------------------------------------------------------------------------------
class Tool(RequestBody):
    """A custom (client) tool. ``type`` first: a server tool's 400 names ``tools.N.type``."""

    type: Literal["custom"] | None = None
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: CacheControl | None = None
    strict: bool | None = None  # accepted: any and tool choices are always held to the schema
    eager_input_streaming: bool | None = None  # accepted: input is streamed as it is generated anyway

    @field_validator("type", mode="before")
    @classmethod
    def _custom_only(cls, v):
        if v not in (None, "custom"):
            raise ValueError(
                f"{v!r} is a server tool: kvforge runs no server tools (web search, web fetch, code "
                "execution, bash, text editor, computer use, memory, tool search...); only custom tools "
                "{name, description, input_schema} are supported"
            )
        return v

    @field_validator("input_schema")
    @classmethod
    def _an_object(cls, v):
        if v.get("type") != "object":
            raise ValueError('must be the JSON schema of an object ({"type": "object", ...})')
        return v


class ToolChoiceAuto(RequestBody):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAny(RequestBody):
    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceTool(RequestBody):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(RequestBody):
    type: Literal["none"]


ToolChoice = Annotated[
    Union[ToolChoiceAuto, ToolChoiceAny, ToolChoiceTool, ToolChoiceNone], Field(discriminator="type")
]


# -- thinking and output ----------------------------------------------------------------------------
class Thinking(RequestBody):
    """``{"type": "enabled", "budget_tokens"}``, ``{"type": "adaptive"}`` or ``{"type": "disabled"}``."""

    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: int | None = Field(default=None, ge=1024)  # Anthropic's minimum; not enforced (docs/server.md)
    display: Literal["summarized", "omitted"] | None = None

    @model_validator(mode="after")
    def _fields_fit_the_type(self):
        if self.type == "enabled" and self.budget_tokens is None:
            raise ValueError("enabled thinking needs budget_tokens")
        if self.type != "enabled" and self.budget_tokens is not None:
            raise ValueError(f"budget_tokens belongs to enabled thinking, not {self.type}")
        if self.type == "disabled" and self.display is not None:
            raise ValueError("display belongs to enabled or adaptive thinking")
        return self


class JSONOutputFormat(RequestBody):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(RequestBody):
    format: JSONOutputFormat | None = None
    effort: Any = None

    @field_validator("effort", mode="before")
    @classmethod
    def _refuse_effort(cls, v):
        if v is not None:
            raise ValueError(
                "effort controls are not supported: a model reasons as its chat template makes it; "
                "leave output_config.effort out of the request"
            )
        return v


class Metadata(RequestBody):
    user_id: str | None = None


# -- the requests -----------------------------------------------------------------------------------
class CountTokensRequest(RequestBody):
    """``/v1/messages/count_tokens``: what shapes the prompt (Anthropic's ``MessageCountTokensParams``)."""

    model: str
    messages: list[Message] = Field(min_length=1)
    system: list[TextBlock] | str | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    # accepted without effect (ANTHROPIC_WITHOUT_EFFECT)
    cache_control: CacheControl | None = None
    speed: Literal["standard", "fast"] | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None

    @field_validator("tools")
    @classmethod
    def _names_once(cls, v):
        names = [t.name for t in v or []]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"tool name(s) {twice} given more than once")
        return v

    @field_validator("messages")
    @classmethod
    def _prefill_is_text(cls, v):
        last = v[-1]
        if (
            last.role == "assistant"
            and isinstance(last.content, list)
            and any(b.type == "tool_use" for b in last.content)
        ):
            raise ValueError(
                "a final assistant message is continued as text (prefill), so it cannot hold tool_use "
                "blocks; send their tool_result in a user message after it"
            )
        return v

    def system_text(self) -> str:
        if self.system is None or isinstance(self.system, str):
            return self.system or ""
        return "".join(b.text for b in self.system)

    def conversation(self) -> tuple[list[dict], str | None]:
        """The chat template's messages, and the prefill: the text of a final assistant message, which the
        answer continues (it is left out of the messages). ``system`` is a system message first; an
        assistant's tool_use blocks are its ``tool_calls`` (input as objects, as vLLM passes them);
        tool_result blocks are ``tool`` messages, in their place among the user's text."""
        conv: list[dict] = [{"role": "system", "content": self.system_text()}] if self.system_text() else []
        for m in self.messages:
            if m.role == "assistant":
                calls = (
                    [
                        {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}
                        for b in m.content
                        if isinstance(b, ToolUseBlock)
                    ]
                    if isinstance(m.content, list)
                    else []
                )
                # NOTE: content "" not None: templates such as SmolLM2's read every message's content
                conv.append({"role": "assistant", "content": m.text()} | ({"tool_calls": calls} if calls else {}))
            elif isinstance(m.content, str):
                conv.append({"role": m.role, "content": m.content})
            else:
                parts: list[TextBlock | ImageBlock] = []
                for b in m.content:
                    if isinstance(b, ToolResultBlock):
                        if parts:
                            conv.append({"role": m.role, "content": _template_content(parts)})
                            parts = []
                        conv.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()})
                    elif isinstance(b, (TextBlock, ImageBlock)):
                        parts.append(b)
                if parts or not m.content:
                    conv.append({"role": m.role, "content": _template_content(parts)})
        if self.messages[-1].role == "assistant":
            return conv[:-1], conv[-1]["content"]
        return conv, None

    def image_urls(self) -> list[tuple[str, str | None]]:
        """``(messages.N.content.M, URL)`` of each image block, in order."""
        return [(f"messages.{i}.content.{j}", b.source.image_url()) for i, m in enumerate(self.messages)
                if isinstance(m.content, list) for j, b in enumerate(m.content) if isinstance(b, ImageBlock)]

    def show_thinking(self) -> bool:
        """Thinking blocks in the answer: with thinking enabled or adaptive, unless displayed as omitted."""
        t = self.thinking
        return t is not None and t.type != "disabled" and t.display != "omitted"


class MessagesRequest(CountTokensRequest):
    """``/v1/messages`` (Anthropic's ``MessageCreateParams``)."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    stream: bool = False
    # accepted without effect (ANTHROPIC_WITHOUT_EFFECT)
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    inference_geo: str | None = None
    # refused (ANTHROPIC_REFUSED): declared so that each one's 400 names it
    container: Any = None
    mcp_servers: Any = None
    diagnostics: Any = None

    @field_validator(*ANTHROPIC_REFUSED, mode="before")
    @classmethod
    def _refuse(cls, v, info):
        if v is not None:
            raise ValueError(f"{ANTHROPIC_REFUSED[info.field_name]}; leave {info.field_name} out of the request")
        return v

    @field_validator("stop_sequences")
    @classmethod
    def _stops(cls, v):
        if v is not None and (not all(v) or len(v) > MAX_STOP or max(map(len, v), default=0) > MAX_STOP_CHARS):
            raise ValueError(f"at most {MAX_STOP} sequences of 1 to {MAX_STOP_CHARS} characters")
        return v
