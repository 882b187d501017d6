"""Fuzz the HTTP API from the server's own OpenAPI schema against a real `kvforge serve` on loopback.

schemathesis turns ``/openapi.json`` into hypothesis strategies for schema-valid and schema-invalid
bodies of the four POST routes that do work; on top of those, some fields are replaced with hostile
values (huge integers, NaN-like strings and raw ``NaN`` tokens, odd unicode, deep nesting, huge
``n`` / ``logprobs`` / ``max_tokens``). A request that could run is kept cheap (``max_tokens`` at most
``MAX_TOKENS``). The promise: no 5xx, every 4xx OpenAI-shaped, every streamed 200 ends with
``[DONE]``, and afterwards the engine is alive and holds nothing (no block, nothing running or waiting).

Bounded and reproducible: ``EXAMPLES`` derandomized examples, sent within ``BUDGET_S`` seconds.
"""
from __future__ import annotations

import json
import math
import re
import time
from typing import Any

import httpx
import pytest

pytest.importorskip("schemathesis", reason="the test extra installs it: pip install -e '.[test]'")

import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis.core import NOT_SET
from schemathesis.generation.modes import GenerationMode

from conftest import API_KEY, MAX_MODEL_LEN, ServerProcess, wait_idle
from kvforge.server.protocol import REFUSED

ROUTES = ("/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize")
GENERATES = ROUTES[:2]
#: examples hypothesis generates (derandomized: the same ones on every run)
EXAMPLES = 300
#: seconds in which requests are sent; examples left after it are generated but not sent
BUDGET_S = 60.0
#: the most tokens a fuzzed request that could run may ask for, so each one is cheap
MAX_TOKENS = 8
AUTH = {"Authorization": f"Bearer {API_KEY}"}
NESTED_DEPTH = 200  # deeper than the server's MAX_JSON_DEPTH (64)


def nested(depth: int, leaf: Any = 1) -> Any:
    value = leaf
    for i in range(depth):
        value = [value] if i % 2 else {"a": value}
    return value


HUGE_INTS = st.one_of(st.integers(min_value=2 ** 63 - 2, max_value=2 ** 63 + 2),
                      st.sampled_from([2 ** 64, 2 ** 64 - 1, -(2 ** 63) - 1, 10 ** 30, -(10 ** 30), 10 ** 400]),
                      st.integers(min_value=MAX_MODEL_LEN, max_value=10 ** 12))
ODD_FLOATS = st.sampled_from([math.nan, math.inf, -math.inf, 1e-300, -1e-300, 5e-324, 1e308, -1e308, -0.0])
NAN_LIKE = st.sampled_from(["NaN", "nan", "Infinity", "-Infinity", "inf", "1e309", "0x10", "", " ", "null"])
ODD_TEXT = st.one_of(
    st.sampled_from(["\ud800", "a\udfffb", "\x00", "\u202e\u202d", "\ufeff", "\U0010ffff", "💥" * 300,
                     "<|im_start|>system", "{{ 7 * 7 }}", "{% for i in range(10) %}x{% endfor %}"]),
    st.text(st.characters(codec="utf-8"), max_size=40),
    st.text(st.characters(categories=["Cs", "Co", "Cn", "Mn", "Zl", "Zp"]), max_size=20))
DEEP = st.one_of(st.integers(min_value=1, max_value=NESTED_DEPTH).map(nested),
                 st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                              lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner,
                                                                                          max_size=3),
                              max_leaves=30))
#: JSON-like tokens json.dumps cannot write: planted as a marker string, swapped in after serializing
RAW_TOKENS = st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999", "-1e999", "9" * 5000, "-" + "1" * 4301])
RAW_MARK = "@@raw@@"
HOSTILE = st.one_of(HUGE_INTS, ODD_FLOATS, NAN_LIKE, ODD_TEXT, DEEP, RAW_TOKENS.map(lambda t: RAW_MARK + t))
#: floats that overflow or underflow float32 (the sampler's dtype), or nearly so
EXTREME_FLOATS = st.one_of(ODD_FLOATS, st.floats(min_value=5e-324, max_value=1e-30),
                           st.floats(min_value=1e30, max_value=1e308))
#: fields planted more often with the values most likely to hurt them
FOCUSED = {**{name: HUGE_INTS for name in ("n", "best_of", "logprobs", "top_logprobs", "prompt_logprobs", "max_tokens",
                                           "max_completion_tokens", "min_tokens", "seed", "top_k", "priority", "stop",
                                           "logit_bias", "bad_words", "allowed_token_ids")},
           **{name: EXTREME_FLOATS for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                                                "presence_penalty", "frequency_penalty")}}


def cheap(value: Any) -> Any:
    """A token count the server would accept, capped at ``MAX_TOKENS``; anything else (refused) as is."""
    if isinstance(value, bool):
        return value
    number = value
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            return value
    if isinstance(number, (int, float)) and 1 <= number <= MAX_MODEL_LEN:  # False for NaN and inf
        return type(value)(MAX_TOKENS) if number > MAX_TOKENS else value
    return value


def body_strategy(schema: Any, route: str) -> st.SearchStrategy:
    """(route, content bytes or None, with the API key?) for one request: a schemathesis case, maybe
    sanitized towards a request that runs, maybe with hostile values planted in it."""
    op = schema[route]["POST"]
    ref = schema.raw_schema["paths"][route]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    model = schema.raw_schema["components"]["schemas"][ref.rsplit("/", 1)[1]]
    props, required = list(model["properties"]), set(model.get("required", ()))
    cases = st.one_of(op.as_strategy(GenerationMode.POSITIVE), op.as_strategy(GenerationMode.NEGATIVE))

    @st.composite
    def build(draw: Any) -> tuple[str, bytes | None, bool]:
        case = draw(cases)
        body = case.body
        if isinstance(body, dict):
            body = dict(body)
            keep = draw(st.sampled_from(["few", "accepted", "all"]))
            if keep == "few":  # the required fields and a few others: most such requests reach the engine
                few = set(draw(st.lists(st.sampled_from(sorted(body)), max_size=3))) if body else set()
                body = {k: v for k, v in body.items() if k in required or k in few}
            if keep != "all":  # no refused field, so that more requests reach the engine
                for name in [*REFUSED, "chat_template", "model"]:
                    body.pop(name, None)
            for _ in range(draw(st.integers(0, 3))):  # hostile values planted in known or unknown fields
                key = draw(st.sampled_from(props + list(FOCUSED) + ["unknown_field", "\ud800", "__proto__"]))
                body[key] = draw(FOCUSED[key] if key in FOCUSED and draw(st.booleans()) else HOSTILE)
            if route in GENERATES:
                for name in ("max_tokens", "max_completion_tokens") if route == ROUTES[0] else ("max_tokens",):
                    body[name] = cheap(body[name]) if name in body else draw(st.integers(1, MAX_TOKENS))
                if draw(st.integers(0, 3)):
                    body["stream"] = draw(st.booleans())
        elif isinstance(body, list) and draw(st.booleans()):
            body = nested(draw(st.integers(1, NESTED_DEPTH)), body)
        if body is NOT_SET:
            content = None
        elif isinstance(body, bytes):
            content = body
        else:  # allow_nan: a planted NaN goes out as the raw token `NaN`, which is not JSON
            text = json.dumps(body, allow_nan=True)
            content = re.sub(f'"{RAW_MARK}([^"]*)"', r"\1", text).encode()
        return route, content, draw(st.integers(0, 9)) != 9  # one in ten without the API key

    return build()


@pytest.fixture(scope="module")
def fuzz_server():
    server = ServerProcess("--api-key", API_KEY, "--max-num-seqs", "4")
    yield server
    server.stop()


def check(response: httpx.Response, text: str) -> str | None:
    """What is wrong with one answer, or None."""
    status = response.status_code
    if status >= 500:
        return f"status {status}"
    if 400 <= status < 500:
        try:
            err = json.loads(text)["error"]
        except (ValueError, KeyError, TypeError):
            return f"status {status} without an OpenAI error body"
        if not isinstance(err, dict) or set(err) != {"message", "type", "param", "code"} or not err["message"]:
            return f"status {status} with a malformed error {err!r}"
        return None
    if status != 200:
        return f"unexpected status {status}"
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        if not events or events[-1] != "[DONE]":
            return "a streamed 200 that does not end with data: [DONE]"
        try:
            errors = [json.loads(event).get("error") for event in events[:-1]]
        except ValueError:
            return "a streamed 200 with an event that is not JSON"
        for err in errors:
            if err is not None and err.get("type") != "invalid_request_error":
                return f"a streamed 200 with a server-side error event {err!r}"
        return None
    try:
        json.loads(text)
    except ValueError:
        return "a 200 whose body is not JSON"
    return None


def test_fuzz_from_openapi_schema(fuzz_server):
    schema = schemathesis.openapi.from_url(f"{fuzz_server.url}/openapi.json")
    assert set(ROUTES) <= set(schema.raw_schema["paths"])
    requests = st.one_of([body_strategy(schema, route) for route in ROUTES])
    failures: list[str] = []
    statuses: dict[int, int] = {}
    deadline = time.monotonic() + BUDGET_S
    client = httpx.Client(base_url=fuzz_server.url, timeout=60)

    @settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(requests)
    def one(request: tuple[str, bytes | None, bool]) -> None:
        if time.monotonic() > deadline:
            return
        route, content, with_key = request
        headers = {"Content-Type": "application/json", **(AUTH if with_key else {})}
        try:
            with client.stream("POST", route, content=content, headers=headers) as response:
                text = response.read().decode("utf-8", "replace")
        except httpx.HTTPError as exc:
            failures.append(f"POST {route} {(content or b'')[:300]!r}: no answer: {exc!r}")
            return
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        problem = check(response, text)
        if problem is not None:
            failures.append(f"POST {route} {(content or b'')[:300]!r} -> {problem}: {text[:300]}")

    try:
        one()
    finally:
        client.close()
    log = "".join(list(fuzz_server.log)[-60:])
    assert not failures, "\n".join(failures[:20]) + f"\n\nserver log:\n{log}"
    assert sum(statuses.values()) >= 50, statuses  # enough requests went out within the budget
    assert statuses.get(200, 0) >= 10, statuses  # some requests did reach the engine

    # the engine lives and holds nothing
    assert httpx.get(f"{fuzz_server.url}/health").status_code == 200
    r = httpx.post(f"{fuzz_server.url}/v1/completions", headers=AUTH, timeout=60,
                   json={"prompt": "hi", "max_tokens": 4, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    held = wait_idle(fuzz_server)  # the engine holds nothing once the last request is done
    assert not any(held.values()), held
