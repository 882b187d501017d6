"""The architecture of a decoder-only model: what every model family has, read from a Hugging Face
``config.json``, GGUF metadata or a named dummy preset.

:class:`ModelConfig` holds the general part (shapes, RoPE as data, norms, windows, token ids) and only
what changes the computation, never runtime options (those live in the engine config). A family's own
fields and rules belong to its model class (``kvforge.model.interface.ModelFamily``): the class
registered for a config's architecture reads it, starting from the general fields parsed here
(:func:`hf_fields`, :func:`gguf_fields`), and may return a dataclass subclass of :class:`ModelConfig`
holding its extras (``config_class``). ``ModelConfig.from_hf_dict`` / ``from_gguf`` / ``from_preset``
find that class through the model registry (:mod:`kvforge.model.families`).
"""
from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator, Mapping, Protocol, Sequence, TypedDict

#: layer_types values (transformers' names)
SLIDING, FULL = "sliding_attention", "full_attention"

#: a parsed ``config.json`` (its values are whatever JSON holds)
HFConfig = dict[str, Any]


class _RequiredFields(TypedDict):
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int


class ConfigFields(_RequiredFields, total=False):
    """:class:`ModelConfig`'s constructor arguments, as the general parsers return them and a family's
    hook adjusts them before building its config (``config_class(**fields, ...)``)."""

    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    bos_token_id: int | None
    eos_token_ids: list[int]
    torch_dtype: str | None
    attention_out_bias: bool
    sliding_window: int | None
    quantization_config: dict[str, Any] | None
    layer_types: list[str] | None
    partial_rotary_factor: float
    hf_config: HFConfig


@dataclass
class ModelConfig:
    """Shapes and numerics of a decoder-only causal LM. Field names follow Hugging Face's config."""

    architecture: str  # HF class name, e.g. "LlamaForCausalLM"; selects the model plugin
    model_type: str  # config.json's model_type, e.g. "llama" (the family's rules may depend on it)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # HF's rope scaling dict with a "rope_type" key ("linear", "llama3", ...; kvforge.layers.rotary); None
    # means plain RoPE. GGUF files with a rope_freqs tensor give {"rope_type": "freq_factors", "factors": [...]}.
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on the q/k/v projections
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    torch_dtype: str | None = None  # checkpoint dtype, e.g. "bfloat16"; None if unknown or quantized
    attention_out_bias: bool = False  # bias on o_proj
    # tokens each position attends back to; None = global attention
    sliding_window: int | None = None
    # config.json's quantization_config (a pre-quantized checkpoint; kvforge.model.quantization.resolve picks
    # the method that loads it); None: unquantized
    quantization_config: dict[str, Any] | None = None
    # per layer "sliding_attention" (uses sliding_window) or "full_attention"; None: every layer uses
    # sliding_window (None too: global attention everywhere)
    layer_types: list[str] | None = None
    partial_rotary_factor: float = 1.0  # RoPE rotates the first head_dim * factor dims of each head
    # the whole config.json (or a preset's extra fields): what a family reads beyond the fields above
    hf_config: HFConfig = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"model config field {name!r} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"model config field 'num_attention_heads' ({self.num_attention_heads}) must be a multiple of "
                f"'num_key_value_heads' ({self.num_key_value_heads})")
        if not self.architecture:
            raise ValueError("model config field 'architecture' must be a non-empty string")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
            self.rope_scaling = None if rope_type == "default" else {**self.rope_scaling, "rope_type": rope_type}
        self.eos_token_ids = [int(t) for t in self.eos_token_ids]
        if self.layer_types is not None:
            self.layer_types = list(self.layer_types)
            if len(self.layer_types) != self.num_hidden_layers or set(self.layer_types) - {SLIDING, FULL}:
                raise ValueError(f"model config field 'layer_types' must list {SLIDING!r} or {FULL!r} for each of "
                                 f"the {self.num_hidden_layers} layers, got {self.layer_types!r}")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window < 1):
            raise ValueError(f"model config field 'sliding_window' must be a positive integer or None, "
                             f"got {self.sliding_window!r}")

    # -- attention per layer -----------------------------------------------------------------------
    def window_of(self, layer: int) -> int | None:
        """The sliding window of model layer ``layer``; None: it attends to every earlier token."""
        if self.sliding_window is None or (self.layer_types is not None and self.layer_types[layer] != SLIDING):
            return None
        return self.sliding_window

    @property
    def kv_sliding_window(self) -> int | None:
        """The window every layer attends within (the KV manager frees blocks behind it); None when a
        layer attends globally."""
        windows = [self.window_of(i) for i in range(self.num_hidden_layers)]
        sized = [w for w in windows if w is not None]
        return None if len(sized) < len(windows) else max(sized)

    @property
    def attention_scale(self) -> float:
        """The softmax scale of the attention scores (a family's config may scale otherwise)."""
        return self.head_dim ** -0.5

    @property
    def attention_features(self) -> frozenset[str]:
        """What the layers need of an attention backend (``kvforge.attention.ATTENTION_FEATURES``); a
        family's config adds its own (soft caps, sinks)."""
        windowed = any(self.window_of(i) for i in range(self.num_hidden_layers))
        return frozenset({"sliding_window"} if windowed else ())

    # -- constructors ------------------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: HFConfig) -> ModelConfig:
        """Build from the contents of a Hugging Face ``config.json`` (transformers 4.x or 5.x format): the
        general fields (:func:`hf_fields`), then the family of its architecture (or ``model_type``) adds
        its own (:func:`kvforge.model.families.config_from_hf`)."""
        from kvforge.model import families

        return families.config_from_hf(d)

    @classmethod
    def from_gguf(cls, reader: GGUFReader | str) -> ModelConfig:
        """Build from a ``gguf.GGUFReader`` or ``kvforge.model.loader.GGUFFile`` (or a path to a ``.gguf``
        file): the general fields of its metadata and tensor names (:func:`gguf_fields`), then the family
        that declares its ``general.architecture`` adds its own."""
        from kvforge.model import families

        if isinstance(reader, str):
            import gguf

            reader = gguf.GGUFReader(reader)
        return families.config_from_gguf(GGUFMetadata(reader))

    @classmethod
    def from_preset(cls, name: str) -> ModelConfig:
        """A named architecture for ``dummy`` (random-weight) runs, as its family declares it
        (:data:`PRESETS`); ``ValueError`` listing presets if unknown."""
        preset = PRESETS.get(name)
        if preset is None:
            raise ValueError(f"unknown model preset {name!r}; valid presets: {', '.join(PRESETS)}")
        return copy.deepcopy(preset)

    # -- export ------------------------------------------------------------------------------------
    def to_hf_dict(self) -> HFConfig:
        """A ``config.json``-style dict that ``transformers.AutoConfig.for_model(**d)`` accepts (a family's
        config adds its own fields)."""
        d: HFConfig = {
            **self.hf_config,
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else (self.eos_token_ids or None),
            "attention_bias": self.attention_bias,
            # explicit, None included: transformers' defaults differ between families (some are 4096),
            # and some gate the window behind use_sliding_window
            "sliding_window": self.sliding_window,
            "use_sliding_window": self.sliding_window is not None,
        }
        d.setdefault("hidden_act", "silu")
        if self.layer_types is not None or self.sliding_window is not None:
            # every layer's kind, not a family's default rule
            d["layer_types"] = list(self.layer_types or [SLIDING] * self.num_hidden_layers)
        if self.partial_rotary_factor != 1.0:
            d["partial_rotary_factor"] = self.partial_rotary_factor
        if self.torch_dtype is not None:
            d["torch_dtype"] = self.torch_dtype
        if self.quantization_config is not None:
            d["quantization_config"] = dict(self.quantization_config)
        return d

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# -- config.json ------------------------------------------------------------------------------------
def hf_fields(d: HFConfig, architecture: str) -> ConfigFields:
    """The general fields of a ``config.json`` whose model class is ``architecture``: what
    transformers' configs share. Layers use the window when ``layer_types`` says so (transformers >= 4.54
    writes it), every layer otherwise; a family's hook applies its own rules where a config leaves it out.
    ``ValueError`` naming a field kvforge cannot honour."""
    if isinstance(d.get("text_config"), dict) and "num_attention_heads" not in d:
        # a multimodal checkpoint: the decoder's fields are its text_config's; the family reads the rest
        fields = hf_fields({**d["text_config"], "model_type": d.get("model_type"), "torch_dtype": d.get("torch_dtype")
                            or d["text_config"].get("torch_dtype") or d.get("dtype")}, architecture)
        fields["hf_config"] = dict(d)
        return fields
    if d.get("mlp_bias"):
        raise ValueError("config.json field 'mlp_bias' is true; MLP biases are not supported")
    quant = d.get("quantization_config")
    if quant is not None and not (isinstance(quant, dict) and isinstance(quant.get("quant_method"), str)):
        raise ValueError("config.json field 'quantization_config' must be an object with a 'quant_method' string")
    # transformers 5 moved rope_theta and rope_scaling into one "rope_parameters" dict. Per-layer-type
    # parameters ({"full_attention": {...}, "sliding_attention": {...}}): the global layers' go here, the
    # family reads the others.
    rope_params = dict(d.get("rope_parameters") or {})
    if isinstance(rope_params.get(FULL), dict):
        rope_params = dict(rope_params[FULL])
    partial = float(rope_params.pop("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)) or 1.0)
    rope_theta = d.get("rope_theta", rope_params.pop("rope_theta", 10000.0))
    rope_scaling = d.get("rope_scaling") or rope_params or None
    if rope_scaling is not None:
        rope_scaling = {k: v for k, v in rope_scaling.items() if k not in ("rope_theta", "partial_rotary_factor")}
    heads = int(d["num_attention_heads"])
    window = positive_window(d.get("sliding_window"))
    eos = d.get("eos_token_id")
    bias = bool(d.get("attention_bias", False))
    return ConfigFields(
        architecture=architecture,
        model_type=str(d.get("model_type") or ""),
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"],
        num_hidden_layers=d["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=d.get("num_key_value_heads") or heads,
        head_dim=d.get("head_dim") or d["hidden_size"] // heads,
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        rope_scaling=rope_scaling,
        max_position_embeddings=d.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        attention_bias=bias,
        attention_out_bias=bias,
        qk_norm=False,
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
        torch_dtype=d.get("torch_dtype") or d.get("dtype"),
        sliding_window=window,
        quantization_config=dict(quant) if quant is not None else None,
        layer_types=windowed_layers(d.get("layer_types"), window),
        partial_rotary_factor=partial,
        hf_config=dict(d),
    )


def positive_window(value: object) -> int | None:
    """A ``sliding_window`` value as a window: a positive integer, else None (no window)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def windowed_layers(types: Sequence[str] | None, window: int | None) -> list[str] | None:
    """``layer_types`` as :class:`ModelConfig` holds it: None without a window or when every layer slides."""
    if window is None or not types:
        return None
    return None if all(t == SLIDING for t in types) else list(types)


# -- GGUF -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GGUFArchitecture:
    """How the GGUF files of one llama.cpp architecture (``general.architecture``) map onto a model family:
    data the family's model class declares (``ModelFamily.gguf_architectures``)."""

    model_type: str  # the HF model_type of the files (where llama.cpp's name differs from it)
    #: llama.cpp block tensor name -> HF module inside ``model.layers.N``, over the loader's shared table
    block_names: Mapping[str, str] = field(default_factory=dict)
    #: added to every ``*norm.weight`` by llama.cpp's converter; subtracted again on loading
    norm_shift: float = 0.0
    #: whether llama.cpp's converter permuted the Q/K rows (its LlamaModel; undone on loading)
    permuted_qk: bool = False
    #: the end-of-turn token found by its text when a file has no ``tokenizer.ggml.eot_token_id``
    end_of_turn: str | None = None


class GGUFReader(Protocol):
    """What is read of a ``gguf.GGUFReader`` or ``kvforge.model.loader.GGUFFile``: ``fields`` (key ->
    a field with ``contents()``, or gguf-py's older ``parts``/``data``/``types``) and ``tensors`` (each
    with ``name`` and ``data``). gguf-py's field and tensor classes are its own, hence ``Any``."""

    @property
    def fields(self) -> Mapping[str, Any]: ...

    @property
    def tensors(self) -> Sequence[Any]: ...


class GGUFMetadata:
    """A GGUF file's metadata and tensor names, as the config parsers read them; ``get`` reads the
    ``{architecture}.*`` keys as llama.cpp's ``convert_hf_to_gguf.py`` writes them. Values are Python
    values (str, int, float, bool or a list of them)."""

    def __init__(self, reader: GGUFReader):
        self.reader = reader
        self.architecture = str(self.field("general.architecture") or "")
        self.tensors: dict[str, Any] = {t.name: t for t in reader.tensors}

    def field(self, key: str, default: Any = None) -> Any:
        """The metadata value ``key``, or ``default``."""
        f = self.reader.fields.get(key)
        if f is None:
            return default
        if hasattr(f, "contents"):  # gguf >= 0.11, GGUFFile
            return f.contents()
        values = [f.parts[i] for i in f.data]
        if f.types and f.types[-1].name == "STRING":
            values = [bytes(v).decode("utf-8") for v in values]
        else:
            values = [v.tolist()[0] if len(v) == 1 else v.tolist() for v in values]
        return values if f.types[0].name == "ARRAY" else values[0]

    def get(self, key: str, default: Any = None) -> Any:
        """The value of ``{architecture}.{key}``, or ``default``."""
        return self.field(f"{self.architecture}.{key}", default)


def gguf_fields(meta: GGUFMetadata, layout: GGUFArchitecture, architecture: str) -> ConfigFields:
    """The general fields of a GGUF file whose family reads it as ``layout`` into class ``architecture``.

    Keys: ``embedding_length``, ``feed_forward_length``, ``block_count``, ``context_length``,
    ``attention.head_count(_kv)``, ``attention.key_length`` (head_dim), ``attention.layer_norm_rms_epsilon``,
    ``rope.freq_base``, ``rope.scaling.type/factor``; ``tokenizer.ggml.*`` ids for BOS/EOS. EOS ids:
    ``eos_token_id``, ``eot_token_id``, else the layout's end-of-turn token found by its text, as llama.cpp
    does. Tensor names say what the config leaves out: tied embeddings (no ``output.weight``), q/k/v and
    o biases, q/k norms, and ``rope_freqs`` (Llama 3.1's scaling as llama.cpp stores it)."""
    get, tensors = meta.get, meta.tensors
    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    head_dim = int(get("attention.key_length") or get("rope.dimension_count") or hidden // heads)
    tokens: list[str] = meta.field("tokenizer.ggml.tokens", [])
    vocab = get("vocab_size") or len(tokens)
    rope_scaling = None
    if get("rope.scaling.type") == "linear":  # the global layers' only, as in transformers
        rope_scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    if "rope_freqs.weight" in tensors:  # per-frequency divisors
        rope_scaling = {"rope_type": "freq_factors",
                        "factors": [float(x) for x in tensors["rope_freqs.weight"].data.reshape(-1)]}
    eos = [meta.field(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
    if eos[1] is None and layout.end_of_turn is not None:
        eos.append(tokens.index(layout.end_of_turn) if layout.end_of_turn in tokens else None)
    bos = meta.field("tokenizer.ggml.bos_token_id")
    return ConfigFields(
        architecture=architecture,
        model_type=layout.model_type,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_hidden_layers=int(get("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(get("attention.head_count_kv") or heads),
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(get("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        attention_out_bias="blk.0.attn_output.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=list(dict.fromkeys(int(e) for e in eos if e is not None)),
        torch_dtype=None,  # dequantized to float32; the engine picks the compute dtype
    )


# -- presets ----------------------------------------------------------------------------------------
class _Presets(Mapping[str, ModelConfig]):
    """Named dummy architectures (``dummy:<name>`` or ``load_format="dummy"``), matching real checkpoints:
    the ones every registered model family declares (``ModelFamily.presets``), looked up on use."""

    def _all(self) -> dict[str, ModelConfig]:
        from kvforge.model import families

        return families.presets()

    def __getitem__(self, name: str) -> ModelConfig:
        return self._all()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())


#: preset name -> its config (``ModelConfig.from_preset`` returns a copy)
PRESETS: Mapping[str, ModelConfig] = _Presets()
