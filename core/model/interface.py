"""The model interface every registered model class follows (see ``register_models``)."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Iterable, Protocol, runtime_checkable

import torch

from kvforge.attention import AttentionBackend, AttentionMetadata
from kvforge.model.config import ModelConfig


@dataclass(frozen=True)
class ModelCapabilities:
    """What a model plugin supports, as data (``kvforge models`` lists it; docs/models.md)."""

    sliding_window: bool = False  # honours config.json's sliding_window / layer_types
    moe: bool = False  # mixture-of-experts layers (kvforge.layers.moe.FusedMoE)
    tensor_parallel: bool = True  # built from kvforge.layers' parallel layers
    pipeline_parallel: bool = True  # builds one stage of its layers (parallel_state.current_stage())
    quantization: bool = True  # its linear layers take a quantization method (MoE experts: see docs)
    notes: str = ""  # anything a user should know (attention sinks, what is refused)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


#: the capabilities of a model class that declares none
DEFAULT_CAPABILITIES = ModelCapabilities(tensor_parallel=False, pipeline_parallel=False, quantization=False)


def attention_features(cls: type, config: ModelConfig) -> frozenset[str]:
    """The per-layer attention variants a model of class ``cls`` built from ``config`` needs: what the
    config says (``ModelConfig.attention_features``: windows, Gemma 2's soft cap, gpt-oss's sinks) and
    what the class adds for configs kvforge does not know, through an optional classmethod
    ``attention_features(config) -> iterable of kvforge.attention.ATTENTION_FEATURES names`` (a
    third-party model with sinks or a soft cap declares them there, so that ``auto`` picks a backend
    that has them)."""
    extra = getattr(cls, "attention_features", None)
    return config.attention_features | frozenset(extra(config) if callable(extra) else ())


def capabilities_of(cls: type) -> ModelCapabilities:
    """``cls.capabilities`` (a :class:`ModelCapabilities`), or the conservative default."""
    caps = getattr(cls, "capabilities", None)
    return caps if isinstance(caps, ModelCapabilities) else DEFAULT_CAPABILITIES


@runtime_checkable
class CausalLM(Protocol):
    """A decoder-only language model over a flattened (varlen) batch, with paged attention.

    Constructed as ``cls(config, attn)`` on the target device under the target default dtype; the
    one attention backend object serves every layer, and each layer declares its attention variant
    (sliding window, soft cap, sinks) with ``attn.layer(index, ...)`` while it is built and passes the
    returned spec to ``attn.forward``. A class may set ``capabilities`` (:class:`ModelCapabilities`).
    """

    def __init__(self, config: ModelConfig, attn: AttentionBackend) -> None: ...

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_meta: AttentionMetadata, intermediate: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """input_ids, positions: [num_tokens] int64 -> hidden states [num_tokens, hidden_size].
        ``kv_caches[i]`` is the cache tensor of the model's i-th layer (shape from ``attn.kv_cache_shape``).

        Pipeline parallelism: a model built inside ``parallel_state.building(group, stage)`` holds only
        ``stage.layers(num_layers)`` and ``kv_caches`` only theirs. The first stage embeds; a later
        stage gets ``intermediate`` = (hidden, residual) from the one before; every stage but the
        last returns (hidden, residual) instead of hidden states. A model that supports only one
        stage may ignore ``intermediate`` and raise ``ValueError`` when built for more."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden_size] -> float32 logits [n, vocab_size]."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Fill parameters from Hugging Face-named tensors; ``ValueError`` on unknown or missing names."""
