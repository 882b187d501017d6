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
