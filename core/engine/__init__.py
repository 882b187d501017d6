"""The engine floor: the engine loop (:class:`~kvforge.engine.llm_engine.LLMEngine`), its front ends
(``LLM``, ``AsyncLLMEngine``, the engine-core process and its client, data parallelism), the typed
messages between them, and what turns a step's results into outputs (docs/architecture.md).

``from kvforge.engine import LLMEngine`` is kept for code written before the floors; it loads on use.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvforge.engine.llm_engine import LLMEngine

__all__ = ["LLMEngine"]


def __getattr__(name: str):
    if name == "LLMEngine":
        from kvforge.engine.llm_engine import LLMEngine
        return LLMEngine
    raise AttributeError(f"module 'kvforge.engine' has no attribute {name!r}")
