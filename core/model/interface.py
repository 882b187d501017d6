"""The model interface every registered model class follows (see ``register_models``), and what a class
declares about the configs it reads (:class:`ModelFamily`)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Mapping, Protocol, cast, runtime_checkable

import torch

from kvforge.attention import AttentionBackend, AttentionMetadata
from kvforge.model.config import GGUFArchitecture, ModelConfig


@dataclass(frozen=True)
class ModelCapabilities:
    """What a model plugin supports, as data (``kvforge models`` lists it; docs/models.md)."""

    sliding_window: bool = False  # honours config.json's sliding_window / layer_types
    moe: bool = False  # mixture-of-experts layers (kvforge.layers.moe.FusedMoE)
    tensor_parallel: bool = True  # built from kvforge.layers' parallel layers
    pipeline_parallel: bool = True  # builds one stage of its layers (parallel_state.current_stage())
    quantization: bool = True  # its linear layers take a quantization method (MoE experts: see docs)
    #: inputs beyond text it takes ("image"; kvforge.multimodal.inputs.MODALITIES): such a class also has
    #: ``processor(config, model_dir)`` and ``embed_multimodal(features)``, and its ``forward`` takes
    #: ``inputs_embeds`` (docs/multimodal.md)
    modalities: tuple[str, ...] = ()
    notes: str = ""  # anything a user should know (attention sinks, what is refused)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


#: the capabilities of a model class that declares none
DEFAULT_CAPABILITIES = ModelCapabilities(tensor_parallel=False, pipeline_parallel=False, quantization=False)


@dataclass(frozen=True)
class ModelFamily:
    """Which configs a model class reads, as data (its ``family`` attribute; :mod:`kvforge.model.families`
    looks through the registered classes). A class is found for a config only under the architecture
    its tables name, so a subclass registered under another name inherits none of it."""

    #: HF ``model_type`` -> the architecture it loads as (for a config.json that names no ``architectures``)
    model_types: Mapping[str, str] = field(default_factory=dict)
    #: GGUF ``general.architecture`` -> how its files map onto the family (the model_type among the above)
    gguf_architectures: Mapping[str, GGUFArchitecture] = field(default_factory=dict)
    #: named dummy architectures (``dummy:<name>``), each a config of the class's ``config_class``
    presets: Mapping[str, ModelConfig] = field(default_factory=dict)
    #: model types it does not load -> why (a config.json of one fails with that reason)
    refused_model_types: Mapping[str, str] = field(default_factory=dict)


#: the family of a model class that declares none: it loads configs that name its architecture
NO_FAMILY = ModelFamily()


def family_of(cls: type) -> ModelFamily:
    """``cls.family`` (a :class:`ModelFamily`), or :data:`NO_FAMILY`."""
    family = getattr(cls, "family", None)
    return family if isinstance(family, ModelFamily) else NO_FAMILY


def config_class_of(cls: type) -> type[ModelConfig]:
    """``cls.config_class``, the dataclass its configs are (:class:`ModelConfig` or a subclass holding the
    family's fields), or :class:`ModelConfig`."""
    config_class = getattr(cls, "config_class", None)
    return config_class if isinstance(config_class, type) and issubclass(config_class, ModelConfig) else ModelConfig


def attention_features(cls: type, config: ModelConfig) -> frozenset[str]:
    """The per-layer attention variants a model of class ``cls`` built from ``config`` needs: what the
    config says (``ModelConfig.attention_features``: windows, and what a family's config adds, e.g.
    Gemma 2's soft cap, gpt-oss's sinks) and what the class adds for configs kvforge does not know,
    through an optional classmethod ``attention_features(config) -> iterable of
    kvforge.attention.ATTENTION_FEATURES names`` (a third-party model with sinks or a soft cap declares
    them there, so that ``auto`` picks a backend that has them)."""
    extra = getattr(cls, "attention_features", None)
    if not callable(extra):
        return config.attention_features
    return config.attention_features | frozenset(cast("Iterable[str]", extra(config)))


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
    returned spec to ``attn.forward``.

    Optional class attributes (each has a default; docs/adding_a_model.md):

    - ``capabilities``: a :class:`ModelCapabilities`.
    - ``family``: a :class:`ModelFamily` (model types, GGUF architectures, presets).
    - ``config_class``: the :class:`ModelConfig` dataclass (or subclass) its configs are.
    - ``config_from_hf(fields, hf_config)`` / ``config_from_gguf(fields, gguf)``: classmethods that turn
      the general fields (``kvforge.model.config.ConfigFields``, parsed by core) and the raw
      ``config.json`` dict / ``kvforge.model.config.GGUFMetadata`` into the family's config; the default
      is ``config_class(**fields)``.
    - ``attention_features(config)``: a classmethod (:func:`attention_features`).
    - ``capture_hidden_states(capture)``: from then on every forward writes the layers of a
      ``kvforge.model.hidden_capture.HiddenStateCapture`` (ids as transformers' ``output_hidden_states``)
      into its static buffer, CUDA graphs included; None stops. EAGLE heads need it (docs/models.md).
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
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden_size] -> float32 logits [n, vocab_size]."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Fill parameters from Hugging Face-named tensors; ``ValueError`` on unknown or missing names
        (``kvforge.layers.weight_map.load_weights`` does it from a class's ``weight_map``)."""
