"""The pieces of the OpenAI-shaped answers that chat and completions share: server-sent events, usage,
and log-probabilities in vLLM's shapes."""
from __future__ import annotations

import json

from kvforge.server.protocol import ChatCompletionRequest, CompletionRequest


def sse(obj: object) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def top_dict(entry: dict, top: int) -> dict:
    return {(v.decoded_token or ""): v.logprob for _, v in sorted(entry.items(), key=lambda kv: kv[1].rank or 0)[:top]}


def prompt_logprobs_json(entries: list | None) -> list | None:
    """vLLM's shape: one entry per prompt token (the first ``None``), token id -> logprob, rank, text."""
    if entries is None:
        return None
    return [None if e is None else {str(t): {"logprob": v.logprob, "rank": v.rank, "decoded_token": v.decoded_token}
                                    for t, v in e.items()} for e in entries]


def usage_mode(req: ChatCompletionRequest | CompletionRequest) -> tuple[bool, bool]:
    """(a usage chunk at the end, the usage so far on every chunk too): ``stream_options``'
    ``include_usage`` and vLLM's ``continuous_usage_stats`` (which needs ``include_usage``, as in vLLM)."""
    so = req.stream_options
    include = bool(so and so.include_usage)
    return include, include and bool(so and so.continuous_usage_stats)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_logprobs(tok, ids, lps, top, echo_out, prompt) -> dict:
    """A completion choice's ``logprobs`` (``tokens``, ``token_logprobs``, ``top_logprobs``,
    ``text_offset``): with ``echo_out`` (an echo's first output), the prompt's tokens first."""
    tokens, token_lps, tops = [], [], []
    if echo_out is not None and echo_out.prompt_logprobs is not None:
        for pos, t in enumerate(prompt["prompt_token_ids"]):
            entry = echo_out.prompt_logprobs[pos] if pos < len(echo_out.prompt_logprobs) else None
            tokens.append(tok.decode([t]) if tok is not None else "")
            token_lps.append(entry[t].logprob if entry else None)
            tops.append(top_dict(entry, top) if entry else None)
    for t, entry in zip(ids, lps):
        tokens.append(entry[t].decoded_token or "")
        token_lps.append(entry[t].logprob)
        tops.append(top_dict(entry, top))
    offsets, pos = [], 0
    for s in tokens:
        offsets.append(pos)
        pos += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}
