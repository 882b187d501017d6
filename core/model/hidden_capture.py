"""Capturing chosen layers' hidden states inside a model's forward, for drafters that read them (EAGLE).

An EAGLE-3 head reads three of the target's intermediate hidden states at every position the target
computes, an EAGLE-1 head its final (normed) ones. The target's forward returns only the final
hidden states, and a decode step is a replayed CUDA graph whose outputs are fixed at capture, so the
states are written where the graph can write them: one static buffer, allocated once for the largest
step, that the forward fills in place. Eager steps, piecewise graphs and full graphs all write the
same buffer, so whoever reads it needs no path of its own; the next forward overwrites it (readers
queue their work on it before the next step is launched, in stream order).

Layer ids follow transformers' ``output_hidden_states`` (and vLLM's ``eagle_aux_hidden_state_layer_ids``):
id 0 is the embeddings, id i in 1..L-1 the output of decoder layer i - 1 (the residual stream entering
layer i), id L the final normed hidden states (what the forward returns).

A model supports capture with an optional method ``capture_hidden_states(capture)`` (the built-in
families inherit it from ``LlamaForCausalLM``; docs/models.md): its forward then calls
:meth:`HiddenStateCapture.record` before each layer and after the final norm.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch


class HiddenStateCapture:
    """The layers to capture and the buffer they are written into.

    ``buffer``: [max_tokens, len(layers) * hidden_size], row r of a forward's tokens holding
    ``layers[j]``'s state in columns ``j * hidden_size .. (j + 1) * hidden_size`` (the concatenation an
    EAGLE-3 head's ``fc`` reads). A layer may be listed more than once (vLLM's default ids repeat for
    shallow models); each of its column blocks gets the state.
    """

    def __init__(self, layers: Sequence[int], *, num_layers: int, hidden_size: int, max_tokens: int,
                 dtype: torch.dtype, device: torch.device | str):
        layers = tuple(int(i) for i in layers)
        if not layers:
            raise ValueError("hidden-state capture: no layer to capture")
        bad = [i for i in layers if not 0 <= i <= num_layers]
        if bad:
            raise ValueError(f"hidden-state capture: layer ids {bad} out of range: the target has {num_layers} "
                             f"layers, ids go from 0 (embeddings) to {num_layers} (final normed states)")
        self.layers, self.num_layers, self.hidden_size = layers, num_layers, hidden_size
        #: layer id -> the column blocks it fills
        self.slots: dict[int, list[int]] = {}
        for j, layer in enumerate(layers):
            self.slots.setdefault(layer, []).append(j)
        self.buffer = torch.zeros(max_tokens, len(layers) * hidden_size, dtype=dtype, device=device)

    @property
    def width(self) -> int:
        return self.buffer.shape[1]

    def record(self, layer: int, hidden: torch.Tensor, residual: torch.Tensor | None = None) -> None:
        """Write layer id ``layer``'s state of the forward's tokens, ``hidden + residual`` (a model that
        carries the residual stream apart) or ``hidden``, if that id is captured. hidden: [T, hidden_size].
        No host sync: a copy (or an add) into the static buffer, captured by CUDA graphs like any kernel."""
        blocks = self.slots.get(layer)
        if blocks is None:
            return
        n, h = hidden.shape[0], self.hidden_size
        if n > self.buffer.shape[0]:
            raise RuntimeError(f"hidden-state capture: a forward of {n} tokens, the buffer holds {self.buffer.shape[0]}")
        for j in blocks:
            dst = self.buffer[:n, j * h:(j + 1) * h]
            if residual is None:
                dst.copy_(hidden)
            else:
                torch.add(hidden, residual, out=dst)

    def record_final(self, hidden: torch.Tensor) -> None:
        """The final normed hidden states (id ``num_layers``)."""
        self.record(self.num_layers, hidden)

    def rows(self, n: int) -> torch.Tensor:
        """The captured states of the last forward's first ``n`` tokens: [n, width] (a view)."""
        return self.buffer[:n]


def supports_capture(model: Any) -> bool:
    """Whether ``model`` (a ``kvforge.model.interface.CausalLM``) has ``capture_hidden_states``."""
    return callable(getattr(model, "capture_hidden_states", None))


def install(model: Any, capture: HiddenStateCapture | None) -> None:
    """Make every later forward of ``model`` write ``capture`` (None: stop). ``ValueError`` for a model
    class without ``capture_hidden_states``."""
    if not supports_capture(model):
        raise ValueError(f"model class {type(model).__name__} cannot return its layers' hidden states "
                         "(it has no capture_hidden_states method; docs/models.md), which an EAGLE head reads")
    model.capture_hidden_states(capture)
