"""Request bodies of the OpenAI-compatible API (pydantic), with OpenAI's field names and ranges."""
from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, field_validator

from kvforge.sampling_params import SamplingParams, StructuredOutputsParams


class _Body(BaseModel):
    # Unknown fields are ignored, as vLLM does (clients send `user`, `metadata`, ...).
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class JSONSchemaFormat(_Body):
    name: str | None = None
    schema_: dict = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(_Body):
    """vLLM's extra field: exactly one of json (schema), regex, choice, json_object."""

    json_: dict | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    json_object: bool = False


class _Sampling(_Body):
    """Sampling fields shared by chat and completions."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = None
    n: int = Field(default=1, ge=1, le=128)
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: int = 0
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    logit_bias: dict[str, float] | None = None
    min_tokens: int = Field(default=0, ge=0)
    allowed_token_ids: list[StrictInt] | None = None
    bad_words: list[StrictStr] | None = None
    spaces_between_special_tokens: bool = True
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    logits_processors: list[str] | None = None

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, v):
        items = [v] if isinstance(v, str) else (v or [])
        if any(s == "" for s in items):
            raise ValueError("stop strings must not be empty")
        return v

    def structured(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """The output constraint, if any, and the field that asked for it."""
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            return StructuredOutputsParams(json_object=True), "response_format"
        if rf is not None and rf.type == "json_schema":
            if rf.json_schema is None:
                raise ValueError("response_format: json_schema is required when type is json_schema")
            return StructuredOutputsParams(json=rf.json_schema.schema_), "response_format"
        so = self.structured_outputs
        if so is not None:
            return StructuredOutputsParams(json=so.json_, regex=so.regex, choice=so.choice,
                                           json_object=so.json_object), "structured_outputs"
        for name, kw in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice")):
            if getattr(self, name) is not None:
                return StructuredOutputsParams(**{kw: getattr(self, name)}), name
        return None, None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        so, _ = self.structured()
        return SamplingParams(
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, logit_bias=self.logit_bias, min_tokens=self.min_tokens,
            allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
            spaces_between_special_tokens=self.spaces_between_special_tokens, structured_outputs=so,
            logits_processors=self.logits_processors,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0, min_p=self.min_p or 0.0, seed=self.seed, max_tokens=max_tokens,
            n=self.n, stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True
    chat_template: str | None = None


Prompt = Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]


class CompletionRequest(_Sampling):
    prompt: Prompt
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    max_tokens: int | None = Field(default=16, ge=1)

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, v):
        if (isinstance(v, (str, list)) and len(v) == 0) or (
                isinstance(v, list) and any(isinstance(p, (str, list)) and len(p) == 0 for p in v)):
            raise ValueError("prompt must not be empty")
        return v

    def prompts(self) -> list[str | list[int]]:
        """One engine prompt per entry: a string, a list of strings, ids, or lists of ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[StrictInt]
