"""``/v1/chat/completions`` and ``/v1/completions``: requests in, engine streams merged, OpenAI JSON out."""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse

from kvforge.async_engine import AsyncLLMEngine
from kvforge.server.errors import APIError, bad_request_from_value_error
from kvforge.server.metrics import ServerMetrics
from kvforge.server.protocol import ChatCompletionRequest, CompletionRequest


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class OpenAIServing:
    def __init__(self, engine: AsyncLLMEngine, served_names: list[str], metrics: ServerMetrics,
                 chat_template: str | None = None):
        self.engine = engine
        self.served_names = served_names
        self.metrics = metrics
        self.chat_template = chat_template

    # -- checks shared by both endpoints ------------------------------------------------------------
    def model_name(self, requested: str | None) -> str:
        if requested is None:
            return self.served_names[0]
        if requested not in self.served_names:
            raise APIError(404, f"The model `{requested}` does not exist.", "model", code="model_not_found")
        return requested

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

    def tokenizer(self) -> Any:
        tok = self.engine.tokenizer
        if tok is None:
            raise APIError(400, "this model has no tokenizer: send token ids to /v1/completions", "model")
        return tok

    def render_chat(self, messages: list, add_generation_prompt: bool, chat_template: str | None) -> str:
        tok = self.tokenizer()
        conv = [{"role": m.role, "content": m.text()} for m in messages]
        try:
            return tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=add_generation_prompt,
                                           chat_template=chat_template or self.chat_template)
        except Exception as exc:  # a template error is the request's fault (or the template's)
            raise APIError(400, f"messages: the chat template could not render them: {exc}", "messages")

    # -- streams ----------------------------------------------------------------------------------
    def start(self, prompts: list[dict], params: list, request_id: str, priority: int) -> list[tuple[str, Any]]:
        """Queue one engine request per prompt; on a bad one, abort those already queued."""
        started = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                started.append((rid, self.engine.add_request(prompt, p, rid, priority)))
        except ValueError as exc:
            for rid, _ in started:
                self.engine.abort(rid)
            raise bad_request_from_value_error(exc)
        return started

    async def merged(self, started: list[tuple[str, Any]]) -> AsyncIterator[tuple[int, Any]]:
        """(prompt index, output delta) from every stream as they come; aborts all if left early."""
        q: asyncio.Queue = asyncio.Queue()
        last_times: dict[int, float | None] = {}

        async def pump(i: int, stream: Any) -> None:
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
                await stream.aclose()

    # -- chat -------------------------------------------------------------------------------------
    async def chat(self, req: ChatCompletionRequest) -> JSONResponse | StreamingResponse:
        model = self.model_name(req.model)
        text = self.render_chat(req.messages, req.add_generation_prompt, req.chat_template)
        ids = self.tokenizer().encode(text, add_special_tokens=False)
        requested = req.max_completion_tokens or req.max_tokens
        max_tokens = self.max_tokens(len(ids), requested, "messages")
        top = req.top_logprobs or 0
        if top and not req.logprobs:
            raise APIError(400, "top_logprobs: requires logprobs to be true", "top_logprobs")
        params = self._params(req, max_tokens, top if req.logprobs else None)
        await self.check_constraint(req)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        started = self.start([{"prompt": text, "prompt_token_ids": ids}], [params], rid, req.priority)
        created = int(time.time())
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(self._guarded(self._chat_stream(started, rid, created, model, req.n, top,
                                                                     len(ids), include_usage, req.logprobs),
                                                   started), media_type="text/event-stream")
        finals: dict[int, dict] = {}
        n_gen = 0
        async for _, out in self.merged(started):
            for c in out.outputs:
                f = finals.setdefault(c.index, {"text": "", "finish": None, "logprobs": []})
                f["text"] += c.text
                f["finish"] = c.finish_reason or f["finish"]
                n_gen += len(c.token_ids)
                if req.logprobs and c.logprobs:
                    f["logprobs"] += [self._chat_logprob(c.token_ids[j], lp, top) for j, lp in enumerate(c.logprobs)]
        choices = [{"index": i, "message": {"role": "assistant", "content": f["text"]},
                    "logprobs": {"content": f["logprobs"]} if req.logprobs else None,
                    "finish_reason": f["finish"]} for i, f in sorted(finals.items())]
        return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": model,
                             "choices": choices, "usage": _usage(len(ids), n_gen)})

    async def _chat_stream(self, started, rid, created, model, n, top, prompt_len, include_usage,
                           want_logprobs) -> AsyncIterator[str]:
        head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
        for i in range(n):
            yield sse(head | {"choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                           "logprobs": None, "finish_reason": None}]})
        n_gen = 0
        async for _, out in self.merged(started):
            choices = []
            for c in out.outputs:
                n_gen += len(c.token_ids)
                delta = {"content": c.text} if c.text or not c.finish_reason else {}
                lp = None
                if want_logprobs and c.logprobs:
                    lp = {"content": [self._chat_logprob(c.token_ids[j], x, top) for j, x in enumerate(c.logprobs)]}
                choices.append({"index": c.index, "delta": delta, "logprobs": lp, "finish_reason": c.finish_reason})
            if choices:
                yield sse(head | {"choices": choices})
        if include_usage:
            yield sse(head | {"choices": [], "usage": _usage(prompt_len, n_gen)})
        yield "data: [DONE]\n\n"

    def _chat_logprob(self, token_id: int, lps: dict, top: int) -> dict:
        chosen = lps[token_id]
        tops = sorted(lps.items(), key=lambda kv: kv[1].rank or 0)[:top]
        return {"token": chosen.decoded_token or "", "logprob": chosen.logprob,
                "bytes": list((chosen.decoded_token or "").encode()),
                "top_logprobs": [{"token": v.decoded_token or "", "logprob": v.logprob,
                                  "bytes": list((v.decoded_token or "").encode())} for _, v in tops]}

    def _params(self, req: Any, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None):
        try:
            return req.sampling_params(max_tokens, logprobs, prompt_logprobs)
        except ValueError as exc:
            raise bad_request_from_value_error(exc)

    async def check_constraint(self, req: Any) -> None:
        """Compile a structured-output constraint off the event loop (cached for the engine): 400 if invalid."""
        try:
            so, field = req.structured()
        except ValueError as exc:
            raise bad_request_from_value_error(exc)
        if so is None:
            return
        try:
            await asyncio.get_running_loop().run_in_executor(None, self.engine.check_structured_outputs, so)
        except ValueError as exc:
            raise APIError(400, f"{field}: {exc}", field)

    # -- completions ------------------------------------------------------------------------------
    async def completions(self, req: CompletionRequest) -> JSONResponse | StreamingResponse:
        model = self.model_name(req.model)
        prompts, params, texts = [], [], []
        for p in req.prompts():
            if isinstance(p, str):
                ids = self.tokenizer().encode(p, add_special_tokens=True)
                text = p
            else:
                ids = p
                vocab = self.engine.vocab_size
                if min(ids) < 0 or max(ids) >= vocab:
                    raise APIError(400, f"prompt: token ids must be in [0, {vocab})", "prompt")
                text = self.engine.tokenizer.decode(p) if self.engine.tokenizer is not None else ""
            max_tokens = self.max_tokens(len(ids), req.max_tokens, "prompt")
            lp = req.logprobs
            prompts.append({"prompt": text, "prompt_token_ids": ids})
            params.append(self._params(req, max_tokens, lp, lp if (req.echo and lp is not None) else None))
            texts.append(text)
        await self.check_constraint(req)
        rid = f"cmpl-{uuid.uuid4().hex}"
        started = self.start(prompts, params, rid, req.priority)
        created = int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created, "model": model}
        prompt_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(self._guarded(self._completion_stream(started, head, req, texts, prompts,
                                                                           prompt_tokens, include_usage), started),
                                     media_type="text/event-stream")
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
                lp = self._completion_logprobs(f["ids"], f["lps"], req.logprobs,
                                               f["out"] if req.echo else None, prompts[idx // req.n])
            choices.append({"index": idx, "text": f["text"], "logprobs": lp, "finish_reason": f["finish"]})
        return JSONResponse(head | {"choices": choices, "usage": _usage(prompt_tokens, n_gen)})

    async def _guarded(self, gen: AsyncIterator[str], started: list) -> AsyncIterator[str]:
        """Abort every request of a stream that ends early, even before it reached the engine's output."""
        try:
            async for chunk in gen:
                yield chunk
        finally:
            await gen.aclose()
            for rid, _ in started:
                self.engine.abort(rid)

    async def _completion_stream(self, started, head, req, texts, prompts, prompt_tokens,
                                 include_usage) -> AsyncIterator[str]:
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
                    lp = self._completion_logprobs(c.token_ids, c.logprobs or [], req.logprobs,
                                                   out if first_echo else None, prompts[i])
                    base = offsets.get(idx, 0)
                    lp["text_offset"] = [base + o for o in lp["text_offset"]]
                    offsets[idx] = base + sum(len(t) for t in lp["tokens"])
                choices.append({"index": idx, "text": text, "logprobs": lp, "finish_reason": c.finish_reason})
            if choices:
                yield sse(head | {"choices": choices})
        if include_usage:
            yield sse(head | {"choices": [], "usage": _usage(prompt_tokens, n_gen)})
        yield "data: [DONE]\n\n"

    def _completion_logprobs(self, ids, lps, top, echo_out, prompt) -> dict:
        tok = self.engine.tokenizer
        tokens, token_lps, tops = [], [], []
        if echo_out is not None and echo_out.prompt_logprobs is not None:
            for pos, t in enumerate(prompt["prompt_token_ids"]):
                entry = echo_out.prompt_logprobs[pos] if pos < len(echo_out.prompt_logprobs) else None
                tokens.append(tok.decode([t]) if tok is not None else "")
                token_lps.append(entry[t].logprob if entry else None)
                tops.append(_top_dict(entry, top) if entry else None)
        for t, entry in zip(ids, lps):
            tokens.append(entry[t].decoded_token or "")
            token_lps.append(entry[t].logprob)
            tops.append(_top_dict(entry, top))
        offsets, pos = [], 0
        for s in tokens:
            offsets.append(pos)
            pos += len(s)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _top_dict(entry: dict, top: int) -> dict:
    return {(v.decoded_token or ""): v.logprob for _, v in sorted(entry.items(), key=lambda kv: kv[1].rank or 0)[:top]}


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
