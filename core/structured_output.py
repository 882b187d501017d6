"""Structured outputs (JSON schema, regex, choice, any JSON) through xgrammar.

Why xgrammar (see docs/structured_outputs.md): it is the fastest of the three candidates at
per-token mask generation (a precomputed adaptive token-mask cache; microseconds per token), compiles
JSON schemas and regexes in milliseconds, is actively maintained, ships CPU and CUDA wheels, and is
vLLM's default backend. llguidance is comparable in speed but adds a Rust toolchain story for its
Lark-style grammars; outlines-core compiles regex-derived indexes that take seconds for large schemas.

Grammars compile on a background thread (cached by constraint), so a request waits in the queue
while its grammar compiles and other requests keep running. Each sequence has its own matcher: the
sampler masks the logits with it, and the engine advances it with every accepted token.
"""
from __future__ import annotations

import json
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Sequence

import torch

from kvforge.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)


class GrammarState:
    """One sequence's constraint: the compiled grammar (maybe still compiling) and its matcher."""

    def __init__(self, future: Future):
        self.future = future
        self._matcher: Any = None

    @property
    def ready(self) -> bool:
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
    def matcher(self) -> Any:
        if self._matcher is None:
            import xgrammar as xgr
            self._matcher = xgr.GrammarMatcher(self.future.result())
        return self._matcher

    def accept(self, token: int) -> bool:
        """Advance by one sampled token; False if the grammar rejects it."""
        return self.matcher.accept_token(token)

    @property
    def terminated(self) -> bool:
        return self._matcher is not None and self._matcher.is_terminated()


class StructuredOutputManager:
    """Compiles constraints once (cached) on a background thread and hands out per-sequence states."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._compiler: Any = None
        self._lock = threading.Lock()
        self._cache: dict[tuple, Future] = {}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvforge-grammar")

    def _get_compiler(self) -> Any:
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

    def _compile(self, so: StructuredOutputsParams) -> Any:
        compiler = self._get_compiler()
        try:
            if so.json is not None:
                schema = so.json if isinstance(so.json, str) else json.dumps(so.json)
                json.loads(schema)
                # compact JSON: free whitespace lets a weak model loop on spaces forever
                return compiler.compile_json_schema(schema, any_whitespace=False)
            if so.json_object:
                return compiler.compile_builtin_json_grammar()
            if so.regex is not None:
                return compiler.compile_regex(so.regex)
            alternatives = " | ".join(json.dumps(c) for c in so.choice)
            return compiler.compile_grammar(f"root ::= {alternatives}")
        except Exception as exc:
            raise ValueError(f"structured_outputs: invalid constraint: {exc}") from exc

    def submit(self, so: StructuredOutputsParams) -> Future:
        """The (cached) compilation of a constraint; compiles in the background on first sight."""
        key = so.key()
        with self._lock:
            fut = self._cache.get(key)
            if fut is None:
                fut = self._pool.submit(self._compile, so)
                self._cache[key] = fut
        return fut

    def state(self, so: StructuredOutputsParams) -> GrammarState:
        return GrammarState(self.submit(so))

    def check(self, so: StructuredOutputsParams) -> None:
        """Compile now (blocking the caller only) and raise ``ValueError`` if the constraint is invalid."""
        self.submit(so).result()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def grammar_bitmask_applier(requests: Sequence[Any], vocab_size: int, device: torch.device):
    """Fill the constrained rows' token bitmasks now; return ``f(logits) -> masked logits``."""
    import xgrammar as xgr

    rows = [i for i, r in enumerate(requests) if r.grammar is not None]
    bitmask = xgr.allocate_token_bitmask(len(rows), vocab_size)
    for j, i in enumerate(rows):
        requests[i].grammar.matcher.fill_next_token_bitmask(bitmask, j)
    bitmask = bitmask.to(device)

    def apply(logits: torch.Tensor) -> torch.Tensor:
        sub = logits[rows].contiguous()
        xgr.apply_token_bitmask_inplace(sub, bitmask, vocab_size=vocab_size)
        out = logits.clone()
        out[rows] = sub
        return out

    return apply
