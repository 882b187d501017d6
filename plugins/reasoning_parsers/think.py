"""Reasoning between ``<think>`` and ``</think>`` (DeepSeek-R1, QwQ, Qwen3).

Two readings of the same tags:

- ``deepseek_r1``: the output starts inside the reasoning (chat templates often put ``<think>`` in the
  prompt; a leading ``<think>``, after optional whitespace, is dropped). Reasoning runs up to the first
  ``</think>``, content is everything after it. With no ``</think>``, everything is reasoning.
- ``qwen3``: reasoning is only what stands between ``<think>`` and the first ``</think>`` after it (to the
  end if that never comes). Text before ``<think>``, and all of an output without one, is content.

As vLLM does, the text on either side of a tag is kept verbatim: the newlines models write after
``</think>`` start the content (a blank part is reported as None, see kvforge.tool_parsing). Tags after
the first ``</think>`` are plain content.
"""
from __future__ import annotations

from kvforge.tool_parsing import ReasoningParser

OPEN, CLOSE = "<think>", "</think>"


class _ThinkTags(ReasoningParser):
    #: where an output starts: "start" (reasoning, after an optional <think>) or "before" (content until <think>)
    initial_state = "before"

    def __init__(self, tokenizer=None):
        super().__init__(tokenizer)
        self._state = self.initial_state  # then "reasoning", then "after" (content) once </think> is seen

    def _consume(self, text: str, final: bool) -> tuple[str, str, int]:
        pos, content = 0, ""
        if self._state == "start":
            head = text.lstrip()
            if not final and OPEN.startswith(head):  # blank so far, or a prefix of <think>: wait
                return "", "", 0
            if head.startswith(OPEN):
                pos = len(text) - len(head) + len(OPEN)
            self._state = "reasoning"
        if self._state == "before":
            at = text.find(OPEN)
            if at < 0:
                end = len(text) if final else len(text) - self._held_back(text, OPEN)
                return "", text[:end], end
            content, pos, self._state = text[:at], at + len(OPEN), "reasoning"
        if self._state == "reasoning":
            at = text.find(CLOSE, pos)
            if at < 0:
                end = len(text) if final else len(text) - self._held_back(text[pos:], CLOSE)
                return text[pos:end], content, end
            reasoning, pos, self._state = text[pos:at], at + len(CLOSE), "after"
            return reasoning, content + text[pos:], len(text)
        return "", content + text[pos:], len(text)


class DeepSeekR1ReasoningParser(_ThinkTags):
    initial_state = "start"


class Qwen3ReasoningParser(_ThinkTags):
    initial_state = "before"
