"""Request bodies of the OpenAI-compatible API (pydantic), with OpenAI's field names and ranges.

Every field of the OpenAI types is honoured, accepted without effect (``WITHOUT_EFFECT``), or refused
with a 400 naming it (``REFUSED``); docs/server.md lists them, and a test holds the lists to these models.
A field outside the API is ``server/request_fields.py``'s: a warning and a count, or a 400 when strict.
"""
from __future__ import annotations

import json
from typing import Any, Literal, NamedTuple, Union

from pydantic import Field, StrictBool, StrictInt, StrictStr, field_validator, model_validator

from kvforge.sampling_params import SEED_MAX, SEED_MIN, SamplingParams, StructuredOutputsParams
from kvforge.server.request_fields import RequestBody
from kvforge.server.tools import ChatTool, NamedToolChoice

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
#: a vllm_xargs value: vLLM's types (a string, a number, or a list of them), booleans too
XArg = Union[StrictBool, StrictInt, float, StrictStr, list[Union[StrictBool, StrictInt, float, StrictStr]]]
#: prompts one /v1/completions request may carry (each becomes an engine request)
MAX_PROMPTS = 256

#: OpenAI request fields kvforge does not implement: a 400 whenever one is set to anything but
#: its neutral value (``None`` always; the value given here too).
REFUSED: dict[str, tuple[str, Any]] = {
    "functions": ("the deprecated functions API is not supported: use tools", []),
    "function_call": ("the deprecated functions API is not supported: use tool_choice", "none"),
    "extra_args": ("per-request plugin arguments go in vllm_xargs", {}),
    "audio": ("audio output is not supported", None),
    "modalities": ("only text output is supported", ["text"]),
    "prediction": ("predicted outputs are not supported", None),
    "web_search_options": ("web search is not supported", None),
    "reasoning_effort": ("reasoning controls are not supported", None),
    "moderation": ("moderation of input and output is not supported", None),
    "suffix": ("suffix (insertion) is not supported", None),
}


class Constraint(NamedTuple):
    """A request's structured-output constraint and the field that asked for it (named in its 400s)."""

    params: StructuredOutputsParams
    field: str


#: OpenAI's JSON mode (``response_format`` / Responses ``text.format`` of type ``json_object``): a JSON
#: object, as OpenAI returns (vLLM's ``structured_outputs.json_object`` admits any JSON value)
JSON_MODE_SCHEMA: dict[str, Any] = {"type": "object"}

#: fields of the OpenAI request types that cannot change this server's output: accepted (any value of
#: their type) and otherwise ignored; docs/server.md lists them with these reasons
WITHOUT_EFFECT: dict[str, str] = {
    "safety_identifier": "an end-user id for OpenAI's abuse monitoring; kvforge has none",
    "prompt_cache_key": "a routing hint for OpenAI's prompt cache; kvforge's prefix cache needs none",
    "metadata": "tags of a stored completion; kvforge stores none",
    "store": "asks OpenAI to store the completion for its dashboards; kvforge stores none",
    "service_tier": "OpenAI's processing tier; kvforge has one",
    "prompt_cache_options": "OpenAI's cache breakpoints and lifetime; kvforge's prefix cache keeps every block "
                            "while memory allows",
    "prompt_cache_retention": "OpenAI's cache lifetime (deprecated there); the same",
}


class StreamOptions(RequestBody):
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries the usage so far
    continuous_usage_stats: bool = False
    # OpenAI pads stream chunks with random characters against length side channels; a local server
    # sends none (accepted without effect)
    include_obfuscation: bool | None = None


class JSONSchemaFormat(RequestBody):
    name: str | None = None
    description: str | None = None
    schema_: dict = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestBody):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(RequestBody):
    """vLLM's extra field: exactly one of json (schema), regex, choice, json_object."""

    json_: dict | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    json_object: bool = False


class _Sampling(RequestBody):
    """Sampling fields shared by chat and completions."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=INT64_MAX)
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=INT64_MAX)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    n: int = Field(default=1, ge=1, le=INT64_MAX)  # the engine's max_n bounds it (a 400 naming n)
    best_of: int | None = Field(default=None, ge=1, le=INT64_MAX)
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: int = Field(default=0, ge=INT64_MIN, le=INT64_MAX)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=INT64_MAX)
    user: str | None = None  # accepted for OpenAI compatibility: written in the server's log line
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    logit_bias: dict[str, float] | None = None
    min_tokens: int = Field(default=0, ge=0, le=INT64_MAX)
    allowed_token_ids: list[StrictInt] | None = None
    bad_words: list[StrictStr] | None = None
    spaces_between_special_tokens: bool = True
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    logits_processors: list[StrictStr] | None = None
    # per-request arguments of logits-processor plugins (vLLM's name), SamplingParams.extra_args
    vllm_xargs: dict[str, XArg] | None = None
    # the refused OpenAI fields (see REFUSED): declared so that each one's 400 names it
    functions: Any = None
    function_call: Any = None
    extra_args: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    moderation: Any = None
    # accepted without effect (WITHOUT_EFFECT)
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    prompt_cache_retention: str | None = None

    @field_validator(*(name for name in REFUSED if name != "suffix"), mode="before")
    @classmethod
    def _refuse(cls, v, info):
        return refuse(info.field_name, v)

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, v):
        items = [v] if isinstance(v, str) else (v or [])
        if any(s == "" for s in items):
            raise ValueError("stop strings must not be empty")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, v, info):
        if v is not None and v != info.data.get("n", 1):
            raise ValueError(f"only best_of equal to n ({info.data.get('n', 1)}) is supported, got {v}: "
                             "kvforge returns every sample it generates")
        return v

    def structured(self) -> Constraint | None:
        """The output constraint, if any, and the field that asked for it."""
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            return Constraint(StructuredOutputsParams(json=JSON_MODE_SCHEMA), "response_format")
        if rf is not None and rf.type == "json_schema":
            if rf.json_schema is None:
                raise ValueError("response_format: json_schema is required when type is json_schema")
            return Constraint(StructuredOutputsParams(json=rf.json_schema.schema_), "response_format")
        so = self.structured_outputs
        if so is not None:
            return Constraint(StructuredOutputsParams(json=so.json_, regex=so.regex, choice=so.choice,
                                                      json_object=so.json_object), "structured_outputs")
        for name, kw in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice")):
            if getattr(self, name) is not None:
                try:
                    return Constraint(StructuredOutputsParams(**{kw: getattr(self, name)}), name)
                except ValueError as exc:  # name the field the client sent, not the engine's
                    raise ValueError(str(exc).replace(f"structured_outputs.{kw}", name)) from None
        return None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        constraint = self.structured()
        so = constraint.params if constraint is not None else None
        return SamplingParams(
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, logit_bias=_token_keys(self.logit_bias),
            min_tokens=self.min_tokens,
            allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
            spaces_between_special_tokens=self.spaces_between_special_tokens, structured_outputs=so,
            logits_processors=self.logits_processors,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0, min_p=self.min_p or 0.0, seed=self.seed, max_tokens=max_tokens,
            n=self.n, stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens, logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs if self.prompt_logprobs is not None else prompt_logprobs,
            extra_args=dict(self.vllm_xargs) if self.vllm_xargs else None)


def _token_keys(bias: dict[str, float] | None) -> dict[int, float] | None:
    """``logit_bias`` with its JSON keys (strings) as the token ids they name."""
    if bias is None:
        return None
    try:
        return {int(k): v for k, v in bias.items()}
    except ValueError:  # SamplingParams' own message for a key that is no token id
        raise ValueError("logit_bias must map token ids to numbers") from None


def refuse(name: str, value: Any) -> Any:
    """A refused field passes only when unset or at its neutral value (``REFUSED``)."""
    reason, neutral = REFUSED[name]
    if value is None or value == neutral:
        return None
    raise ValueError(f"{reason}; leave {name} out of the request")


class TextPart(RequestBody):
    type: Literal["text"]
    text: str
    prompt_cache_breakpoint: Any = None  # OpenAI's explicit cache breakpoint: without effect (prompt_cache_options)


class MediaPart(RequestBody):
    """An ``image_url``, ``input_audio`` or ``file`` content part. An image reaches a model that takes
    images (``OpenAIServing.chat_images``); any other (or an image for a text-only model) is a 400
    naming the part's message."""
    type: Literal["image_url", "input_audio", "file"]
    image_url: dict[str, Any] | str | None = None
    input_audio: dict[str, Any] | None = None
    file: dict[str, Any] | None = None
    prompt_cache_breakpoint: Any = None


#: what a media part's 400 says this server's models do not take
MEDIA_KINDS = {"image_url": "images", "input_audio": "audio", "file": "files"}


class ToolCallFunction(RequestBody):
    name: str
    arguments: str  # JSON text of an object


class AssistantToolCall(RequestBody):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(RequestBody):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | MediaPart] | None = None
    name: str | None = None  # passed to the chat template with the message
    tool_calls: list[AssistantToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    reasoning_content: str | None = None  # an assistant's earlier reasoning (templates such as Qwen3's read it)
    # what an SDK's own reply carries when a chat loop sends it back (``message.model_dump()``): accepted
    # on assistant messages without effect; a refusal's text or an audio reply cannot be replayed
    refusal: None = None
    annotations: list[dict[str, Any]] | None = None
    audio: None = None
    function_call: None = None

    @model_validator(mode="after")
    def _tool_fields(self):
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id (the id of the call it answers)")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError(f"tool_call_id belongs to tool messages, not {self.role!r} ones")
        for name in ("tool_calls", "reasoning_content", "annotations"):
            if getattr(self, name) and self.role != "assistant":
                raise ValueError(f"{name} belongs to assistant messages, not {self.role!r} ones")
        for call in self.tool_calls or []:
            try:
                args = json.loads(call.function.arguments)
            except ValueError:
                args = None
            if not isinstance(args, dict):
                raise ValueError(f"tool_calls: the arguments of call {call.id!r} are not the JSON text of an object")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content if isinstance(p, TextPart))

    def media(self) -> list[tuple[int, MediaPart]]:
        """The message's media parts (images...) and their places in ``content``."""
        return [(j, p) for j, p in enumerate(self.content) if isinstance(p, MediaPart)] \
            if isinstance(self.content, list) else []

    def template_dict(self) -> dict[str, object]:
        """The message as the chat template gets it: calls with their arguments as objects (as vLLM
        passes them: templates such as Llama 3.1's and Qwen's serialise them themselves); a message with
        images as parts, ``{"type": "text", "text"}`` and ``{"type": "image"}`` in order (the form the
        templates of vision-language checkpoints read), else its text."""
        content: object = self.text()
        if self.media():
            content = [{"type": "image"} if isinstance(p, MediaPart) else {"type": "text", "text": p.text}
                       for p in (self.content if isinstance(self.content, list) else [])]
        msg: dict[str, object] = {"role": self.role, "content": content}
        if self.name is not None:
            msg["name"] = self.name
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            msg["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": json.loads(c.function.arguments)}} for c in self.tool_calls]
        return msg


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=INT64_MAX)  # the engine's max_logprobs bounds it
    add_generation_prompt: bool = True
    chat_template: str | None = None  # refused unless the server runs with --trust-request-chat-template
    # GPT-5's answer length; accepted without effect (a chat template has no such control)
    verbosity: Literal["low", "medium", "high"] | None = None


Prompt = Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]


class CompletionRequest(_Sampling):
    prompt: Prompt
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=INT64_MAX)  # the engine's max_logprobs bounds it
    max_tokens: int | None = Field(default=16, ge=1, le=INT64_MAX)
    suffix: Any = None

    @field_validator("suffix", mode="before")
    @classmethod
    def _refuse_suffix(cls, v):
        return refuse("suffix", v)

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, v):
        if (isinstance(v, (str, list)) and len(v) == 0) or (
                isinstance(v, list) and any(isinstance(p, (str, list)) and len(p) == 0 for p in v)):
            raise ValueError("prompt must not be empty")
        if isinstance(v, list) and v and isinstance(v[0], (str, list)) and len(v) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(v)}")
        return v

    def prompts(self) -> list[str | list[int]]:
        """One engine prompt per entry: a string, a list of strings, ids, or lists of ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [[x for x in p if isinstance(x, int)]]
        return [x for x in p if not isinstance(x, int)]


class TokenizeRequest(RequestBody):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[StrictInt]
