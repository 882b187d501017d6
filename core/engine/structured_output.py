"""Structured outputs (JSON schema, regex, choice, any JSON) through xgrammar.

Why xgrammar (see docs/structured_outputs.md): it is the fastest of the three candidates at
per-token mask generation (a precomputed adaptive token-mask cache; microseconds per token), compiles
JSON schemas and regexes in milliseconds, is actively maintained, ships CPU and CUDA wheels, and is
vLLM's default backend. llguidance is comparable in speed but adds a Rust toolchain story for its
Lark-style grammars; outlines-core compiles regex-derived indexes that take seconds for large schemas.

Grammars compile on a background thread (cached by constraint, least recently used evicted), so a
request waits in the queue while its grammar compiles and other requests keep running. Each sequence
has its own matcher: the sampler masks the logits with it, and the engine advances it with every
accepted token.

A compilation has a time limit. A thread cannot be stopped, so one that overruns is abandoned: the
constraint is remembered as failed (its next request fails at once), and later constraints compile
on a fresh thread. At most ``MAX_ABANDONED`` overrunning compilations may run at once; past that,
new constraints are refused until one ends.
"""
from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from kvforge.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase
    from xgrammar import CompiledGrammar, GrammarCompiler, GrammarMatcher

    from kvforge.request import Request

logger = logging.getLogger(__name__)


#: overrunning compilations that may still run on abandoned threads before new constraints are refused
MAX_ABANDONED = 4
#: the clock and C++ source location xgrammar puts before its messages: ``[11:13:49] /project/cpp/x.cc:4944: ``
_XGRAMMAR_PREFIX = re.compile(r"\[\d{1,2}:\d{2}:\d{2}\] \S+:\d+: ")
#: keywords whose values are JSON data, not schemas: a ``$ref`` key inside them is not a reference
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
#: keywords whose values map names to schemas (a key there is a name, never a keyword)
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
#: why a constraint that admits no output at all (every token masked, no end) is refused
NO_OUTPUT = ("structured_outputs: the constraint admits no output (a schema that only refers to itself, "
             "or an empty language)")


def xgrammar_message(exc: BaseException) -> str:
    """xgrammar's message without its clock and C++ source location (they tell a client nothing)."""
    return _XGRAMMAR_PREFIX.sub("", str(exc)).strip()


def check_local_refs(schema: object) -> None:
    """``ValueError`` if a ``$ref`` anywhere in ``schema`` is not a pointer into the schema itself (``#`` or
    ``#/...``): xgrammar resolves no other, and compiles such a reference to "any JSON" with only a warning.

    NOTE: iterative, as a schema may nest deeper than Python recurses; the values of data keywords
    (``const``, ``enum``...) are skipped, as a ``$ref`` key there is data.
    """
    # (node, its path as a linked list (parent path, key) built only for the message, is a map of schemas)
    stack: list[tuple[object, tuple | None, bool]] = [(schema, None, False)]
    while stack:
        node, path, is_map = stack.pop()
        if isinstance(node, list):
            stack.extend((v, (path, i), False) for i, v in enumerate(node))
            continue
        if not isinstance(node, dict):
            continue
        ref = None if is_map else node.get("$ref")
        if isinstance(ref, str) and ref != "#" and not ref.startswith("#/"):
            raise ValueError(f"the $ref {ref[:200]!r} at {_pointer(path)[:200]} is not a pointer into the schema "
                             "itself ('#' or '#/...'): external documents and anchors are not resolved")
        for key, value in node.items():
            if is_map or key not in _DATA_KEYWORDS:
                stack.append((value, (path, key), not is_map and key in _SCHEMA_MAPS))


def _pointer(path: tuple | None) -> str:
    """The JSON pointer (RFC 6901) of a linked path from :func:`check_local_refs`."""
    keys = []
    while path is not None:
        path, key = path
        keys.append(str(key).replace("~", "~0").replace("/", "~1"))
    return "/".join(["#", *reversed(keys)])


class GrammarState:
    """One sequence's constraint: the compiled grammar (maybe still compiling) and its matcher."""

    def __init__(self, future: Future[CompiledGrammar], expire: Callable[[], None] | None = None,
                 deadline: float = float("inf")):
        self.future = future
        self._expire = expire  # called once the deadline passed with the compilation still running
        self.deadline = deadline  # time.monotonic() by which the compilation must be done
        self._matcher: GrammarMatcher | None = None
        self.num_accepted = 0  # output tokens the matcher has accepted (the engine advances it)

    @property
    def ready(self) -> bool:
        """Compiled, failed, or past its deadline (then it has failed: see :attr:`error`)."""
        if not self.future.done() and time.monotonic() > self.deadline and self._expire is not None:
            self._expire()
        return self.future.done()

    @property
    def usable(self) -> bool:
        """Compiled without error: the sequence may be scheduled."""
        return self.future.done() and self.future.exception() is None

    @property
    def error(self) -> str | None:
        if not self.future.done() or self.future.exception() is None:
            return None
        return str(self.future.exception())

    @property
    def matcher(self) -> GrammarMatcher:
        if self._matcher is None:
            import xgrammar as xgr
            self._matcher = xgr.GrammarMatcher(self.future.result())
        return self._matcher

    def accept(self, token: int) -> bool:
        """Advance by one sampled token; False if the grammar rejects it."""
        return self.matcher.accept_token(token)

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` (drafts) the grammar accepts in a row from here; the state is left
        unchanged."""
        m, n = self.matcher, 0
        for t in tokens:
            if m.is_terminated() or not m.accept_token(t):
                break
            n += 1
        if n:
            m.rollback(n)
        return n

    def fill_bitmask(self, bitmask: torch.Tensor, row: int, prefix: Sequence[int] = ()) -> None:
        """Row ``row`` of ``bitmask``: the tokens allowed next, after ``prefix`` (drafts the grammar
        accepts, see :meth:`valid_prefix`); the state is left unchanged."""
        m = self.matcher
        for t in prefix:
            m.accept_token(t)
        m.fill_next_token_bitmask(bitmask, row)
        if prefix:
            m.rollback(len(prefix))

    @property
    def terminated(self) -> bool:
        return self._matcher is not None and self._matcher.is_terminated()


class StructuredOutputManager:
    """Compiles constraints once (cached) on a background thread and hands out per-sequence states."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_token_ids: Sequence[int], *,
                 timeout: float = 10.0, cache_size: int = 256):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.timeout = timeout
        self.cache_size = cache_size
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple, Future[CompiledGrammar]] = OrderedDict()
        self._abandoned: set[Future[CompiledGrammar]] = set()  # overrunning compilations still running
        self._pool = self._new_pool()

    @staticmethod
    def _new_pool() -> ThreadPoolExecutor:
        return ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvforge-grammar")

    def _get_compiler(self) -> GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                try:
                    import xgrammar as xgr
                except ImportError as exc:
                    raise ValueError("structured_outputs: needs xgrammar (pip install xgrammar)") from exc
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids or None)
                self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=True)
            return self._compiler

    def _compile(self, so: StructuredOutputsParams) -> CompiledGrammar:
        compiler = self._get_compiler()
        try:
            if so.json is not None:
                schema = so.json if isinstance(so.json, str) else json.dumps(so.json)
                check_local_refs(json.loads(schema))
                # compact JSON: free whitespace lets a weak model loop on spaces forever
                return compiler.compile_json_schema(schema, any_whitespace=False)
            if so.json_object:
                return compiler.compile_builtin_json_grammar()
            if so.regex is not None:
                return compiler.compile_regex(so.regex)
            if so.choice is None:  # StructuredOutputsParams holds exactly one constraint
                raise ValueError("no constraint is set")
            alternatives = " | ".join(json.dumps(c) for c in so.choice)
            return compiler.compile_grammar(f"root ::= {alternatives}")
        except Exception as exc:
            message = xgrammar_message(exc)
            if "circular $ref" in message.lower():  # xgrammar >= 0.2.9 finds {"$ref": "#"} while compiling
                raise ValueError(NO_OUTPUT) from exc
            raise ValueError(f"structured_outputs: invalid constraint: {message}") from exc

    def _compile_checked(self, so: StructuredOutputsParams) -> CompiledGrammar:
        """Compile, then refuse a constraint that admits no output at all (e.g. ``{"$ref": "#"}``, a
        schema that only refers to itself): every token would be masked and the request could not end."""
        import xgrammar as xgr

        grammar = self._compile(so)
        matcher = xgr.GrammarMatcher(grammar)
        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        matcher.fill_next_token_bitmask(bitmask, 0)
        if not bool(bitmask.any()) and not matcher.is_terminated():
            raise ValueError(NO_OUTPUT)
        return grammar

    def submit(self, so: StructuredOutputsParams) -> tuple[Future[CompiledGrammar], float]:
        """The (cached) compilation of a constraint and its deadline; compiles in the background on
        first sight. ``ValueError`` when too many overrunning compilations are still running."""
        key = so.key()
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                return fut, getattr(fut, "deadline", float("inf"))
            self._abandoned = {f for f in self._abandoned if not f.done()}
            if len(self._abandoned) >= MAX_ABANDONED:
                raise ValueError(f"structured_outputs: {len(self._abandoned)} constraints are still compiling past "
                                 f"their {self.timeout} s limit; try again later")
            fut = self._pool.submit(self._compile_checked, so)
            fut.deadline = time.monotonic() + self.timeout  # type: ignore[attr-defined]
            self._cache[key] = fut
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return fut, fut.deadline  # type: ignore[attr-defined]

    def _expire(self, key: tuple, fut: Future[CompiledGrammar]) -> None:
        """A compilation overran its deadline: abandon its thread, remember the constraint as failed."""
        with self._lock:
            if fut.done() or self._cache.get(key) is not fut:
                return
            failed: Future[CompiledGrammar] = Future()
            failed.set_exception(ValueError(f"structured_outputs: compiling the constraint took longer than "
                                            f"{self.timeout} s; simplify it"))
            failed.deadline = float("inf")  # type: ignore[attr-defined]
            self._cache[key] = failed
            self._abandoned.add(fut)
            old, self._pool = self._pool, self._new_pool()
        old.shutdown(wait=False, cancel_futures=False)  # queued compilations still run there
        logger.warning("structured outputs: a compilation overran %.1f s; its thread is abandoned", self.timeout)

    def _current(self, key: tuple, fut: Future[CompiledGrammar]) -> Future[CompiledGrammar]:
        with self._lock:
            return self._cache.get(key, fut)

    def state(self, so: StructuredOutputsParams) -> GrammarState:
        key = so.key()
        fut, deadline = self.submit(so)

        def expire() -> None:
            self._expire(key, fut)
            state.future = self._current(key, fut)

        state = GrammarState(fut, expire, deadline)
        return state

    def check(self, so: StructuredOutputsParams) -> None:
        """Compile now (blocking the caller only, at most the time limit) and raise ``ValueError`` if the
        constraint is invalid or takes too long."""
        key = so.key()
        fut, deadline = self.submit(so)
        try:
            fut.result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            self._expire(key, fut)
            self._current(key, fut).result()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def grammar_bitmask_applier(requests: Sequence[Request], vocab_size: int,
                            device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    """Fill the constrained rows' token bitmasks now; return ``f(logits) -> masked logits``."""
    import xgrammar as xgr

    rows = [i for i, r in enumerate(requests) if r.grammar is not None]
    bitmask = xgr.allocate_token_bitmask(len(rows), vocab_size)
    for j, i in enumerate(rows):  # a DraftRow view: the bitmask after its drafts
        requests[i].grammar.fill_bitmask(bitmask, j, getattr(requests[i], "draft_prefix", ()))
    bitmask = bitmask.to(device)

    def apply(logits: torch.Tensor) -> torch.Tensor:
        sub = logits[rows].contiguous()
        xgr.apply_token_bitmask_inplace(sub, bitmask, vocab_size=vocab_size)
        out = logits.clone()
        out[rows] = sub
        return out

    return apply
