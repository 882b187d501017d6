"""``/v1/chat/completions`` and ``/v1/completions``: requests in, engine streams merged, OpenAI JSON out.

Nothing slow runs on the event loop: chat templates render in their own small thread pool with a time
limit, and tokenization runs in worker threads after a cheap length check (a text far too long for
``max_model_len`` is refused before it is tokenized).
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, AsyncGenerator, AsyncIterator, Callable, Union

from fastapi.responses import JSONResponse

from kvforge.engine.client import EngineClient
from kvforge.engine.input_checks import check_extra_args
from kvforge.errors import EngineDeadError, RequestFailedError
from kvforge.multimodal.media import MediaLimits
from kvforge.server.chat_media import chat_images, engine_prompt
from kvforge.server.chat_output import ChoiceOutput
from kvforge.server.disconnect import AbortingStreamingResponse
from kvforge.server.errors import APIError, bad_request_from_value_error, error_body
from kvforge.server.metrics import ModelMetrics
from kvforge.server.protocol import ChatCompletionRequest, CompletionRequest, NamedToolChoice
from kvforge.server.request_id import current_request
from kvforge.server.response_json import completion_logprobs, prompt_logprobs_json, sse, usage, usage_mode
from kvforge.server.tools import ToolOptions, ToolPlan
from kvforge.tool_parsing import get_reasoning_parser

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from kvforge.lora.request import LoRARequest
    from kvforge.outputs import RequestOutput
    from kvforge.sampling_params import SamplingParams, StructuredOutputsParams
    from kvforge.server.models import ServedModel

#: an engine request's id and its output deltas
Started = list[tuple[str, AsyncIterator["RequestOutput"]]]
#: a request of either endpoint (their shared sampling fields and checks)
SamplingRequest = Union[ChatCompletionRequest, CompletionRequest]


#: seconds a chat template may take to render before the request is refused
RENDER_TIMEOUT_S = 10.0
#: a text longer than this many times (longest token in characters x max_model_len) is refused untokenized
_CHARS_SLACK = 4


class OpenAIServing:
    """One engine's endpoints. The app resolves a request's ``model`` (``ServedModels``) and passes the
    ``ServedModel`` it got: its name goes in the response, its ``lora_request`` with the engine requests."""

    def __init__(self, engine: EngineClient, metrics: ModelMetrics, chat_template: str | None = None,
                 trust_request_chat_template: bool = False, tool_options: ToolOptions | None = None,
                 media: MediaLimits | None = None):
        self.engine = engine
        self.media = media or MediaLimits()  # where a request's images may come from, and how large
        self.tool_options = tool_options or ToolOptions()
        self.metrics = metrics
        self.chat_template = chat_template
        self.trust_request_chat_template = trust_request_chat_template
        # its own pool: templates that overrun their time limit cannot starve tokenization
        self._render_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvforge-render")
        self._max_chars: int | None = None

    # -- checks shared by both endpoints ------------------------------------------------------------
    def max_tokens(self, prompt_len: int, requested: int | None, what: str) -> int:
        limit = self.engine.max_model_len
        if requested is None:
            if prompt_len >= limit:
                raise APIError(400, f"This model's maximum context length is {limit} tokens; you requested "
                                    f"{prompt_len + 1} tokens ({prompt_len} in the {what}, 1 for the completion). "
                                    f"Please reduce the length of the {what}.", what)
            return limit - prompt_len
        if prompt_len + requested > limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens; you requested "
                                f"{prompt_len + requested} tokens ({prompt_len} in the {what}, {requested} for the "
                                f"completion). Please reduce the length of the {what} or completion.", what)
        return requested

    def tokenizer(self) -> PreTrainedTokenizerBase:
        tok = self.engine.tokenizer
        if tok is None:
            raise APIError(400, "this model has no tokenizer: send token ids to /v1/completions", "model")
        return tok

    async def render_chat(self, messages: list, add_generation_prompt: bool, chat_template: str | None,
                          tools: list[dict] | None = None) -> str:
        """A chat request's ``messages`` (``ChatMessage`` models) as text: :meth:`render_conversation`."""
        return await self.render_conversation([m.template_dict() for m in messages], add_generation_prompt,
                                              chat_template, tools)

    async def render_conversation(self, conv: list[dict], add_generation_prompt: bool, chat_template: str | None,
                                  tools: list[dict] | None = None) -> str:
        """A conversation (the chat template's message dicts) as text, rendered off the event loop within
        ``RENDER_TIMEOUT_S``; ``tools``: the function tools, as the template's ``tools`` (OpenAI's
        ``{"type": "function", "function": {...}}`` entries)."""
        tok = self.tokenizer()
        if chat_template is not None and not self.trust_request_chat_template:
            raise APIError(400, "chat_template: request-supplied chat templates are refused; the server must run "
                                "with --trust-request-chat-template to accept them", "chat_template")
        template_tools: list[dict | Callable] | None = list(tools) if tools else None

        def render() -> str:
            text = tok.apply_chat_template(conv, tools=template_tools, tokenize=False,
                                           add_generation_prompt=add_generation_prompt,
                                           chat_template=chat_template or self.chat_template)
            if not isinstance(text, str):  # tokenize=False renders text
                raise TypeError(f"the chat template rendered a {type(text).__name__}, not text")
            return text

        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wait_for(loop.run_in_executor(self._render_pool, render), RENDER_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise APIError(400, f"messages: rendering the chat template took longer than {RENDER_TIMEOUT_S} s",
                           "messages") from None
        except Exception as exc:  # a template error is the request's fault (or the template's)
            raise APIError(400, f"messages: the chat template could not render them: {exc}", "messages") from None

    def max_chars(self) -> int:
        """The longest text worth tokenizing: every token covers at most the longest token's characters,
        so a longer text cannot fit in ``max_model_len`` tokens (with slack for normalisers)."""
        if self._max_chars is None:
            tok = self.tokenizer()
            longest = max((len(t) for t in tok.convert_ids_to_tokens(list(range(len(tok)))) if t), default=1)
            self._max_chars = longest * self.engine.max_model_len * _CHARS_SLACK
        return self._max_chars

    async def encode(self, text: str, add_special_tokens: bool, field: str) -> list[int]:
        """Token ids of ``text``, tokenized in a worker thread; a text that cannot fit is refused first."""
        tok = self.tokenizer()
        if len(text) > self.max_chars():
            raise APIError(400, f"{field}: {len(text)} characters cannot fit in max_model_len="
                                f"{self.engine.max_model_len} tokens (the limit is {self.max_chars()} characters)",
                           field)
        return await asyncio.to_thread(tok.encode, text, add_special_tokens=add_special_tokens)

    def check_logprobs(self, name: str, value: int | None) -> None:
        limit = self.engine.config.max_logprobs
        if value is not None and value > limit:
            raise APIError(400, f"{name}: {value} is more than max_logprobs={limit} (--max-logprobs)", name)

    # -- streams ----------------------------------------------------------------------------------
    async def start(self, prompts: list[dict], params: list[SamplingParams], request_id: str, priority: int,
                    lora_request: LoRARequest | None = None) -> Started:
        """Queue one engine request per prompt; on a bad one (or a disconnect), abort those already queued.

        ``request_id``: the answer's id (``chatcmpl-<hex>``); the engine requests' ids start with the HTTP
        request's id (``<X-Request-Id>:chatcmpl-<hex>``), so that the engine's log lines name it too.
        """
        # NOTE: the keyword only when set: an engine without LoRA support takes no such argument
        lora = {"lora_request": lora_request} if lora_request is not None else {}
        http = current_request()
        if http is not None:
            http.response_id = request_id  # for the request line
            request_id = f"{http.request_id}:{request_id}"
        started: Started = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                started.append((rid, await self.engine.add_request(prompt, p, rid, priority, **lora)))
        except BaseException as exc:
            for rid, _ in started:
                self.engine.abort(rid)
            if isinstance(exc, ValueError):
                raise bad_request_from_value_error(exc) from None
            raise
        return started

    def stream(self, gen: AsyncGenerator[str, None], started: Started) -> AbortingStreamingResponse:
        """A server-sent-event response whose requests are aborted however it ends."""
        def abort_all() -> None:
            for rid, _ in started:
                self.engine.abort(rid)  # a no-op for finished requests

        return AbortingStreamingResponse(self._guarded(gen), abort_all, media_type="text/event-stream")

    async def merged(self, started: Started) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        """(prompt index, output delta) from every stream as they come; aborts all if left early."""
        if len(started) == 1:  # one prompt (every chat request): its stream as it is, no task in between
            rid, stream = started[0]
            last = None
            try:
                async for out in stream:
                    last = self.metrics.observe(out, last)
                    yield 0, out
            finally:
                self.engine.abort(rid)  # a no-op for a finished request
                await _close(stream)
            return
        q: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()
        last_times: dict[int, float | None] = {}

        async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
            try:
                async for out in stream:
                    await q.put((i, out))
            except BaseException as exc:  # noqa: BLE001  (forwarded to the consumer)
                await q.put((i, exc))
            finally:
                await q.put((i, None))

        tasks = [asyncio.create_task(pump(i, s)) for i, (_, s) in enumerate(started)]
        done = 0
        try:
            while done < len(tasks):
                i, item = await q.get()
                if item is None:
                    done += 1
                    continue
                if isinstance(item, BaseException):
                    raise item
                last_times[i] = self.metrics.observe(item, last_times.get(i))
                yield i, item
        finally:
            for t in tasks:
                t.cancel()
            # a cancelled pump closes its stream, which aborts an unfinished request
            await asyncio.gather(*tasks, return_exceptions=True)
            for rid, stream in started:
                self.engine.abort(rid)  # covers streams never started; a no-op for finished requests
                await _close(stream)

    # -- chat -------------------------------------------------------------------------------------
    def check_common(self, req: SamplingRequest) -> None:
        """Checks both endpoints share, before anything is rendered or tokenized."""
        self.check_logprobs("prompt_logprobs", req.prompt_logprobs)
        if req.prompt_logprobs is not None and req.stream:
            raise APIError(400, "prompt_logprobs: not available with stream=true", "prompt_logprobs")
        http = current_request()
        if req.user is not None and http is not None:
            http.user = req.user  # written in the request line

    async def chat(self, req: ChatCompletionRequest, served: ServedModel) -> JSONResponse | AbortingStreamingResponse:
        model = served.name
        top = req.top_logprobs or 0
        if top and not req.logprobs:
            raise APIError(400, "top_logprobs: requires logprobs to be true", "top_logprobs")
        self.check_logprobs("top_logprobs", req.top_logprobs)
        self.check_common(req)
        plan = self.tool_plan(req)
        images = await chat_images(req.messages, self.engine, self.media)
        text = await self.render_chat(req.messages, req.add_generation_prompt, req.chat_template,
                                      tools=plan.template_tools())
        ids = await self.encode(text, False, "messages")
        requested = req.max_completion_tokens or req.max_tokens
        max_tokens = self.max_tokens(len(ids), requested, "messages")
        params = self._params(req, max_tokens, top if req.logprobs else None)
        await self.check_constraint(req)
        tools_constraint = plan.constraint()  # a required or named tool choice's
        if tools_constraint is not None:
            params = dataclasses.replace(params, structured_outputs=tools_constraint)
            await self.check_structured(tools_constraint, "tools")
        self.check_xargs(params)
        reasoning = self.tool_options.reasoning_parser
        reasoning_cls = get_reasoning_parser(reasoning) if reasoning else None
        outputs = [ChoiceOutput(plan, reasoning_cls, params.structured_outputs is not None) for _ in range(req.n)]
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        started = await self.start([engine_prompt(text, ids, images)], [params], rid, req.priority,
                                   served.lora_request)
        created = int(time.time())
        if req.stream:
            return self.stream(self._chat_stream(started, rid, created, model, outputs, top, len(ids),
                                                 usage_mode(req), req.logprobs), started)
        finals: dict[int, dict] = {}
        n_gen = 0
        prompt_lps = None
        n_prompt = len(ids)
        async for _, out in self.merged(started):
            n_prompt = len(out.prompt_token_ids) or n_prompt  # the engine's: images' placeholders expanded
            prompt_lps = out.prompt_logprobs if out.finished else prompt_lps
            for c in out.outputs:
                f = finals.setdefault(c.index, {"text": "", "finish": None, "logprobs": []})
                f["text"] += c.text
                f["finish"] = c.finish_reason or f["finish"]
                n_gen += len(c.token_ids)
                if req.logprobs and c.logprobs:
                    f["logprobs"] += [self._chat_logprob(c.token_ids[j], lp, top) for j, lp in enumerate(c.logprobs)]
        choices = []
        for i, f in sorted(finals.items()):
            message = outputs[i].message(f["text"])
            choices.append({"index": i, "message": message, "logprobs": {"content": f["logprobs"]} if req.logprobs
                            else None, "finish_reason": outputs[i].finish_reason(f["finish"])})
        body = {"id": rid, "object": "chat.completion", "created": created, "model": model,
                "choices": choices, "usage": usage(n_prompt, n_gen)}
        if req.prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs_json(prompt_lps)
        return JSONResponse(body)

    def tool_plan(self, req: ChatCompletionRequest) -> ToolPlan:
        choice = req.tool_choice
        if isinstance(choice, NamedToolChoice):
            choice = choice.function.name
        plan = ToolPlan.build([t.function for t in req.tools or []], choice, req.parallel_tool_calls,
                              self.tool_options)
        if plan.constrained:
            constraint = req.structured()
            if constraint is not None:
                raise APIError(400, f"tool_choice: a {plan.mode} tool choice constrains the output itself; it cannot "
                                    f"be combined with {constraint.field}", "tool_choice")
        return plan

    async def _chat_stream(self, started, rid, created, model, outputs, top, prompt_len, usage_flags,
                           want_logprobs) -> AsyncGenerator[str, None]:
        head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
        include_usage, every_chunk = usage_flags
        n_gen = 0

        def chunk(body: dict) -> str:  # with continuous_usage_stats: the usage so far on every chunk
            return sse(head | body | ({"usage": usage(prompt_len, n_gen)} if every_chunk else {}))
        for i in range(len(outputs)):
            yield chunk({"choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None}]})
        async for _, out in self.merged(started):
            prompt_len = len(out.prompt_token_ids) or prompt_len  # the engine's: images' placeholders expanded
            choices = []
            for c in out.outputs:
                n_gen += len(c.token_ids)
                output = outputs[c.index]
                delta = output.delta(c.text, final=c.finish_reason is not None)
                lp = None
                if want_logprobs and c.logprobs:
                    lp = {"content": [self._chat_logprob(c.token_ids[j], x, top) for j, x in enumerate(c.logprobs)]}
                if delta or c.finish_reason or lp:
                    choices.append({"index": c.index, "delta": delta, "logprobs": lp,
                                    "finish_reason": output.finish_reason(c.finish_reason)})
            if choices:
                yield chunk({"choices": choices})
        if include_usage:
            yield sse(head | {"choices": [], "usage": usage(prompt_len, n_gen)})
        yield "data: [DONE]\n\n"

    def _chat_logprob(self, token_id: int, lps: dict, top: int) -> dict:
        chosen = lps[token_id]
        tops = sorted(lps.items(), key=lambda kv: kv[1].rank or 0)[:top]
        return {"token": chosen.decoded_token or "", "logprob": chosen.logprob,
                "bytes": list((chosen.decoded_token or "").encode()),
                "top_logprobs": [{"token": v.decoded_token or "", "logprob": v.logprob,
                                  "bytes": list((v.decoded_token or "").encode())} for _, v in tops]}

    def _params(self, req: SamplingRequest, max_tokens: int, logprobs: int | None,
                prompt_logprobs: int | None = None) -> SamplingParams:
        try:
            return req.sampling_params(max_tokens, logprobs, prompt_logprobs)
        except ValueError as exc:
            raise bad_request_from_value_error(exc) from None

    async def check_constraint(self, req: SamplingRequest) -> None:
        """Compile a structured-output constraint off the event loop (cached for the engine): 400 if invalid."""
        try:
            constraint = req.structured()
        except ValueError as exc:
            raise bad_request_from_value_error(exc) from None
        if constraint is not None:
            await self.check_structured(constraint.params, constraint.field)

    async def check_structured(self, so: StructuredOutputsParams, field: str) -> None:
        try:
            await asyncio.get_running_loop().run_in_executor(None, self.engine.check_structured_outputs, so)
        except ValueError as exc:
            raise APIError(400, f"{field}: {exc}", field) from None

    def check_xargs(self, params: SamplingParams) -> None:
        """``vllm_xargs``: every key taken by a logits processor the request enables, every value valid
        for its options (``kvforge.engine.input_checks.check_extra_args``): else a 400 naming the key."""
        if params.extra_args:
            try:
                check_extra_args(params, field="vllm_xargs")
            except ValueError as exc:
                raise bad_request_from_value_error(exc) from None

    # -- completions ------------------------------------------------------------------------------
    async def completions(self, req: CompletionRequest,
                          served: ServedModel) -> JSONResponse | AbortingStreamingResponse:
        model = served.name
        self.check_logprobs("logprobs", req.logprobs)
        self.check_common(req)
        prompts, params, texts = [], [], []
        for p in req.prompts():
            if isinstance(p, str):
                ids = await self.encode(p, True, "prompt")
                text = p
            else:
                ids = p
                vocab = self.engine.vocab_size
                if min(ids) < 0 or max(ids) >= vocab:
                    raise APIError(400, f"prompt: token ids must be in [0, {vocab})", "prompt")
                text = (await asyncio.to_thread(self.engine.tokenizer.decode, p)
                        if self.engine.tokenizer is not None else "")
            max_tokens = self.max_tokens(len(ids), req.max_tokens, "prompt")
            lp = req.logprobs
            prompts.append({"prompt": text, "prompt_token_ids": ids})
            params.append(self._params(req, max_tokens, lp, lp if (req.echo and lp is not None) else None))
            self.check_xargs(params[-1])
            texts.append(text)
        await self.check_constraint(req)
        rid = f"cmpl-{uuid.uuid4().hex}"
        started = await self.start(prompts, params, rid, req.priority, served.lora_request)
        created = int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created, "model": model}
        prompt_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
        if req.stream:
            return self.stream(self._completion_stream(started, head, req, texts, prompts, prompt_tokens,
                                                       usage_mode(req)), started)
        finals: dict[int, dict] = {}
        n_gen = 0
        async for i, out in self.merged(started):
            for c in out.outputs:
                idx = i * req.n + c.index
                f = finals.setdefault(idx, {"text": texts[i] if req.echo else "", "finish": None, "ids": [],
                                            "lps": [], "out": out})
                f["text"] += c.text
                f["ids"] += c.token_ids
                f["lps"] += c.logprobs or []
                f["finish"] = c.finish_reason or f["finish"]
                f["out"] = out
                n_gen += len(c.token_ids)
        choices = []
        for idx, f in sorted(finals.items()):
            lp = None
            if req.logprobs is not None:
                lp = completion_logprobs(self.engine.tokenizer, f["ids"], f["lps"], req.logprobs,
                                               f["out"] if req.echo else None, prompts[idx // req.n])
            choice = {"index": idx, "text": f["text"], "logprobs": lp, "finish_reason": f["finish"]}
            if req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs_json(f["out"].prompt_logprobs)
            choices.append(choice)
        return JSONResponse(head | {"choices": choices, "usage": usage(prompt_tokens, n_gen)})

    @staticmethod
    async def _guarded(gen: AsyncGenerator[str, None]) -> AsyncGenerator[str, None]:
        """A stream whose request fails (or whose engine dies) ends with an error event and ``[DONE]``."""
        try:
            async for chunk in gen:
                yield chunk
        except RequestFailedError as exc:
            f = exc.failure
            yield sse(error_body(f.status, f.message, f.param))
            yield "data: [DONE]\n\n"
        except EngineDeadError as exc:
            yield sse(error_body(503, str(exc)))
            yield "data: [DONE]\n\n"
        finally:
            await gen.aclose()

    async def _completion_stream(self, started, head, req, texts, prompts, prompt_tokens,
                                 usage_flags) -> AsyncGenerator[str, None]:
        include_usage, every_chunk = usage_flags
        n_gen = 0
        echoed: set[int] = set()
        offsets: dict[int, int] = {}  # text offset reached by each choice
        async for i, out in self.merged(started):
            choices = []
            for c in out.outputs:
                idx = i * req.n + c.index
                text = c.text
                first_echo = req.echo and idx not in echoed
                if first_echo:
                    echoed.add(idx)
                    text = texts[i] + text
                n_gen += len(c.token_ids)
                lp = None
                if req.logprobs is not None:
                    lp = completion_logprobs(self.engine.tokenizer, c.token_ids, c.logprobs or [], req.logprobs,
                                                   out if first_echo else None, prompts[i])
                    base = offsets.get(idx, 0)
                    lp["text_offset"] = [base + o for o in lp["text_offset"]]
                    offsets[idx] = base + sum(len(t) for t in lp["tokens"])
                choices.append({"index": idx, "text": text, "logprobs": lp, "finish_reason": c.finish_reason})
            if choices:
                so_far = {"usage": usage(prompt_tokens, n_gen)} if every_chunk else {}
                yield sse(head | {"choices": choices} | so_far)
        if include_usage:
            yield sse(head | {"choices": [], "usage": usage(prompt_tokens, n_gen)})
        yield "data: [DONE]\n\n"


async def _close(stream: AsyncIterator[RequestOutput]) -> None:
    """Close an engine stream that is an async generator (every front end's is); the contract promises
    only an iterator."""
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()
