"""The architecture of a decoder-only model, read from a Hugging Face ``config.json``, GGUF metadata or a
named dummy preset.

:class:`ModelConfig` is what model implementations (``register_models`` plugins) are built from; it
holds only what changes the computation, never runtime options (those live in the engine config).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

#: HF ``model_type`` -> ``architectures[0]`` for the families the built-in models implement (a
#: config.json with another model_type loads when its ``architectures`` names a registered model plugin)
ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}
#: model types whose MLP is silu(gate) * up: any other ``hidden_act`` is refused
SILU_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "mixtral", "qwen2_moe", "qwen3_moe")
#: layer_types values (transformers' names)
SLIDING, FULL = "sliding_attention", "full_attention"

#: GGUF ``general.architecture`` values we can read (llama.cpp stores Mistral as ``llama``).
GGUF_ARCHITECTURES: tuple[str, ...] = ("llama", "qwen2", "qwen3", "gemma3")
#: GGUF architecture -> HF ``model_type`` where they differ (a gemma3 GGUF holds the text model only)
GGUF_MODEL_TYPES: dict[str, str] = {"gemma3": "gemma3_text"}
#: the end-of-turn token llama.cpp finds by its text when a file has no ``tokenizer.ggml.eot_token_id``
#: (Gemma files name only ``<eos>``, but a chat turn ends with ``<end_of_turn>``)
GGUF_END_OF_TURN: dict[str, str] = {"gemma3": "<end_of_turn>"}
#: Gemma 3 values llama.cpp hard-codes instead of writing them (llama-model.cpp, LLM_ARCH_GEMMA3): every
#: 6th layer global, the sliding layers' RoPE base, and the 27B (62 layers) scaling queries by
#: hidden_size / heads instead of head_dim; transformers' Gemma3TextConfig has the same defaults.
GEMMA3_SLIDING_WINDOW_PATTERN = 6
GEMMA3_LOCAL_ROPE_BASE = 10000.0
GEMMA3_27B_LAYERS = 62


@dataclass
class ModelConfig:
    """Shapes and numerics of a Llama-family causal LM. Field names follow Hugging Face's config."""

    architecture: str  # HF class name, e.g. "LlamaForCausalLM"; selects the model plugin
    model_type: str  # "llama", "mistral", "qwen2", "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # HF's rope scaling dict with a "rope_type" key ("linear", "llama3", ...); None means plain RoPE.
    # GGUF files with a rope_freqs tensor give {"rope_type": "freq_factors", "factors": [head_dim // 2]}.
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2)
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE (Qwen3)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    torch_dtype: str | None = None  # checkpoint dtype, e.g. "bfloat16"; None if unknown or quantized
    attention_out_bias: bool = False  # bias on o_proj (Llama/Qwen3 with attention_bias; never Qwen2)
    # tokens each position attends back to (Mistral; Qwen2 with use_sliding_window); None = global attention
    sliding_window: int | None = None
    # config.json's quantization_config (a pre-quantized checkpoint; kvforge.model.quantization.resolve picks
    # the method that loads it); None: unquantized
    quantization_config: dict[str, Any] | None = None
    # per layer "sliding_attention" (uses sliding_window) or "full_attention"; None: every layer uses
    # sliding_window (None too: global attention everywhere)
    layer_types: list[str] | None = None
    query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power (Gemma); None: head_dim's
    attn_logit_softcapping: float | None = None  # scores -> cap * tanh(score / cap) (Gemma 2)
    attention_sinks: bool = False  # a learned sink logit per head in every softmax (gpt-oss)
    partial_rotary_factor: float = 1.0  # RoPE rotates the first head_dim * factor dims (Phi-4-mini)
    # the whole config.json (or a preset's extra fields): architecture-specific fields model plugins
    # read themselves (expert counts, norms, activations...)
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

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
        return None if None in windows else max(windows)

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def attention_features(self) -> frozenset[str]:
        """What the layers need of an attention backend (``kvforge.attention.ATTENTION_FEATURES``)."""
        needs = {"sliding_window": any(self.window_of(i) for i in range(self.num_hidden_layers)),
                 "logits_soft_cap": self.attn_logit_softcapping is not None,
                 "attention_sinks": self.attention_sinks}
        return frozenset(f for f, on in needs.items() if on)

    # -- constructors ------------------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from the contents of a Hugging Face ``config.json`` (transformers 4.x or 5.x format)."""
        model_type = d.get("model_type")
        if model_type not in ARCHITECTURES and not d.get("architectures"):
            raise ValueError(f"config.json field 'model_type' is {model_type!r} and it names no 'architectures'; "
                             f"built-in model types: {', '.join(ARCHITECTURES)}")
        if model_type == "gemma3":
            raise ValueError("config.json field 'model_type' is 'gemma3' (Gemma3ForConditionalGeneration, text and "
                             "vision); kvforge serves the text-only 'gemma3_text' checkpoints (Gemma 3 270M, 1B)")
        architecture = (d.get("architectures") or [ARCHITECTURES[model_type]])[0]
        if model_type in SILU_MODEL_TYPES and d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json field 'hidden_act' is {d['hidden_act']!r}; only 'silu' is supported")
        if d.get("mlp_bias"):
            raise ValueError("config.json field 'mlp_bias' is true; MLP biases are not supported")
        quant = d.get("quantization_config")
        if quant is not None and not (isinstance(quant, dict) and isinstance(quant.get("quant_method"), str)):
            raise ValueError("config.json field 'quantization_config' must be an object with a 'quant_method' string")
        # transformers 5 moved rope_theta and rope_scaling into one "rope_parameters" dict.
        # Per-layer-type parameters ({"full_attention": {...}, "sliding_attention": {...}}, Gemma 3): the
        # global layers' go here, the model plugin reads the others from hf_config.
        rope_params = dict(d.get("rope_parameters") or {})
        if isinstance(rope_params.get(FULL), dict):
            rope_params = dict(rope_params[FULL])
        partial = float(rope_params.pop("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)) or 1.0)
        rope_theta = d.get("rope_theta", rope_params.pop("rope_theta", 10000.0))
        rope_scaling = d.get("rope_scaling") or rope_params or None
        if rope_scaling is not None:
            rope_scaling = {k: v for k, v in rope_scaling.items() if k not in ("rope_theta", "partial_rotary_factor")}
        heads = d["num_attention_heads"]
        window = _sliding_window(d, model_type)
        eos = d.get("eos_token_id")
        bias = bool(d.get("attention_bias", False))
        return cls(
            architecture=architecture,
            model_type=model_type,
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
            attention_bias=True if model_type in ("qwen2", "qwen2_moe") else bias,
            attention_out_bias=False if model_type in ("qwen2", "mistral", "qwen2_moe") else bias,
            qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
            torch_dtype=d.get("torch_dtype") or d.get("dtype"),
            sliding_window=window,
            quantization_config=dict(quant) if quant is not None else None,
            layer_types=_layer_types(d, model_type, window),
            query_pre_attn_scalar=d.get("query_pre_attn_scalar"),
            attn_logit_softcapping=d.get("attn_logit_softcapping"),
            attention_sinks=model_type == "gpt_oss",
            partial_rotary_factor=partial,
            hf_config=dict(d),
        )

    @classmethod
    def from_gguf(cls, reader: Any) -> ModelConfig:
        """Build from a ``gguf.GGUFReader`` or ``kvforge.model.loader.GGUFFile`` (or a path to a ``.gguf`` file)
        using its metadata and tensor names.

        Keys are ``{arch}.*`` as llama.cpp's ``convert_hf_to_gguf.py`` writes them: ``embedding_length``,
        ``feed_forward_length``, ``block_count``, ``context_length``, ``attention.head_count(_kv)``,
        ``attention.key_length`` (head_dim), ``attention.layer_norm_rms_epsilon``, ``rope.freq_base``
        (Gemma 3: the global layers'), ``rope.scaling.type/factor``; ``tokenizer.ggml.*`` ids for BOS/EOS.
        Gemma 3 (``gemma3`` -> ``gemma3_text``) adds ``attention.sliding_window``; what its files leave out
        comes from :func:`_gemma3_gguf_fields`. EOS ids: ``eos_token_id``, ``eot_token_id``, else the
        :data:`GGUF_END_OF_TURN` token found by its text, as llama.cpp does.
        """
        if isinstance(reader, str):
            import gguf

            reader = gguf.GGUFReader(reader)
        arch = _gguf_field(reader, "general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise ValueError(f"GGUF general.architecture is {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}")
        model_type = GGUF_MODEL_TYPES.get(arch, arch)

        def get(key: str, default: Any = None) -> Any:
            return _gguf_field(reader, f"{arch}.{key}", default)

        tensors = {t.name: t for t in reader.tensors}
        hidden = int(get("embedding_length"))
        heads = int(get("attention.head_count"))
        blocks = int(get("block_count"))
        head_dim = int(get("attention.key_length") or get("rope.dimension_count") or hidden // heads)
        tokens = _gguf_field(reader, "tokenizer.ggml.tokens", [])
        vocab = get("vocab_size") or len(tokens)
        rope_scaling = None
        if get("rope.scaling.type") == "linear":  # Gemma 3 4B+: the global layers' only, as in transformers
            rope_scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
        if "rope_freqs.weight" in tensors:  # llama.cpp's form of Llama-3.1 rope scaling: per-frequency divisors
            rope_scaling = {"rope_type": "freq_factors",
                            "factors": [float(x) for x in tensors["rope_freqs.weight"].data.reshape(-1)]}
        eos = [_gguf_field(reader, k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
        if eos[1] is None and arch in GGUF_END_OF_TURN:
            eos.append(tokens.index(GGUF_END_OF_TURN[arch]) if GGUF_END_OF_TURN[arch] in tokens else None)
        eos_ids = list(dict.fromkeys(int(e) for e in eos if e is not None))
        bos = _gguf_field(reader, "tokenizer.ggml.bos_token_id")
        family = _gemma3_gguf_fields(get, blocks, hidden // heads, head_dim) if arch == "gemma3" else {}
        return cls(
            architecture=ARCHITECTURES[model_type],
            model_type=model_type,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_hidden_layers=blocks,
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
            eos_token_ids=eos_ids,
            torch_dtype=None,  # dequantized to float32; the engine picks the compute dtype
            **family,
        )

    @classmethod
    def from_preset(cls, name: str) -> ModelConfig:
        """A named architecture for ``dummy`` (random-weight) runs; ``ValueError`` listing presets if unknown."""
        preset = PRESETS.get(name)
        if preset is None:
            raise ValueError(f"unknown model preset {name!r}; valid presets: {', '.join(PRESETS)}")
        return cls(**{**preset, "eos_token_ids": list(preset.get("eos_token_ids", []))})

    # -- export ------------------------------------------------------------------------------------
    def to_hf_dict(self) -> dict[str, Any]:
        """A ``config.json``-style dict that ``transformers.AutoConfig.for_model(**d)`` accepts."""
        d: dict[str, Any] = {
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
        }
        if self.model_type in SILU_MODEL_TYPES or "hidden_act" not in d:
            d.setdefault("hidden_act", "silu")
        if self.model_type in ("llama", "qwen3", "qwen3_moe", "gpt_oss", "phi3", "gemma2", "gemma3_text"):
            d["attention_bias"] = self.attention_bias
        if self.sliding_window is not None or self.model_type not in ("llama", "qwen2", "qwen3"):
            d["sliding_window"] = self.sliding_window
        if self.model_type in QWEN_MODEL_TYPES:
            d["use_sliding_window"] = self.sliding_window is not None
        if self.layer_types is not None:
            d["layer_types"] = list(self.layer_types)
        elif self.sliding_window is not None and self.model_type in QWEN_MODEL_TYPES:
            d["layer_types"] = [SLIDING] * self.num_hidden_layers  # not transformers' default rule
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping"):
            if getattr(self, name) is not None:
                d[name] = getattr(self, name)
        if self.partial_rotary_factor != 1.0:
            d["partial_rotary_factor"] = self.partial_rotary_factor
        if self.torch_dtype is not None:
            d["torch_dtype"] = self.torch_dtype
        if self.quantization_config is not None:
            d["quantization_config"] = dict(self.quantization_config)
        return d

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


QWEN_MODEL_TYPES = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")


def _sliding_window(d: dict[str, Any], model_type: str) -> int | None:
    """The window a checkpoint's attention really uses: Qwen configs carry one that is off unless
    ``use_sliding_window`` is set."""
    window = d.get("sliding_window")
    if model_type in QWEN_MODEL_TYPES and not d.get("use_sliding_window", False):
        return None
    return int(window) if isinstance(window, int) and not isinstance(window, bool) and window > 0 else None


def _layer_types(d: dict[str, Any], model_type: str, window: int | None) -> list[str] | None:
    """Which layers use the window: config.json's ``layer_types`` (transformers >= 4.54 writes it), else
    each family's rule as transformers applies it; None when every layer uses it (or none has one)."""
    if window is None:
        return None
    n = d["num_hidden_layers"]
    if d.get("layer_types"):
        types = list(d["layer_types"])
    elif model_type in ("qwen2", "qwen3"):  # the layers from max_window_layers on
        types = [SLIDING if i >= d.get("max_window_layers", 28) else FULL for i in range(n)]
    elif model_type == "qwen2_moe":  # even layers below max_window_layers
        types = [SLIDING if i % 2 == 0 and i < d.get("max_window_layers", 28) else FULL for i in range(n)]
    elif model_type in ("gemma2", "gpt_oss"):  # alternating, sliding first
        types = [SLIDING if i % 2 == 0 else FULL for i in range(n)]
    elif model_type == "gemma3_text":  # every sliding_window_pattern-th layer is global
        pattern = d.get("sliding_window_pattern", d.get("_sliding_window_pattern", 6))
        types = [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(n)]
    else:
        return None
    return None if all(t == SLIDING for t in types) else types


def _gguf_field(reader: Any, key: str, default: Any = None) -> Any:
    """One metadata value of a ``GGUFReader`` as a Python value (str, int, float, bool or list)."""
    f = reader.fields.get(key)
    if f is None:
        return default
    if hasattr(f, "contents"):  # gguf >= 0.11
        return f.contents()
    values = [f.parts[i] for i in f.data]
    if f.types and f.types[-1].name == "STRING":
        values = [bytes(v).decode("utf-8") for v in values]
    else:
        values = [v.tolist()[0] if len(v) == 1 else v.tolist() for v in values]
    return values if f.types[0].name == "ARRAY" else values[0]


def _gemma3_gguf_fields(get: Any, blocks: int, hidden_per_head: int, head_dim: int) -> dict[str, Any]:
    """The Gemma 3 fields of :meth:`ModelConfig.from_gguf`: ``attention.sliding_window`` from the file; the
    layer pattern, the local RoPE base (``rope.freq_base_swa`` where a file has it) and the query scale as
    llama.cpp hard-codes them (:data:`GEMMA3_SLIDING_WINDOW_PATTERN`...); GELU-tanh as llama.cpp computes it."""
    window = get("attention.sliding_window")
    window = int(window) if window else None
    scalar = hidden_per_head if blocks == GEMMA3_27B_LAYERS else head_dim
    hf_config = {
        "model_type": "gemma3_text",
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window_pattern": GEMMA3_SLIDING_WINDOW_PATTERN,
        "rope_local_base_freq": float(get("rope.freq_base_swa", GEMMA3_LOCAL_ROPE_BASE)),
        "query_pre_attn_scalar": scalar,
        "final_logit_softcapping": get("final_logit_softcapping"),
        "attn_logit_softcapping": get("attn_logit_softcapping"),
    }
    return {"sliding_window": window, "query_pre_attn_scalar": scalar,
            "attn_logit_softcapping": hf_config["attn_logit_softcapping"],
            "layer_types": _layer_types({"num_hidden_layers": blocks, **hf_config}, "gemma3_text", window),
            "hf_config": hf_config}


_LLAMA3_VOCAB = {"vocab_size": 128256, "bos_token_id": 128000, "eos_token_ids": [128001]}

#: Named dummy architectures (``dummy:<name>`` or ``load_format="dummy"``), matching the real checkpoints.
PRESETS: dict[str, dict[str, Any]] = {
    "llama-3-8b": dict(
        architecture="LlamaForCausalLM", model_type="llama", **_LLAMA3_VOCAB, hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192,
        tie_word_embeddings=False, torch_dtype="bfloat16"),
    "llama-3-70b": dict(
        architecture="LlamaForCausalLM", model_type="llama", **_LLAMA3_VOCAB, hidden_size=8192,
        intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
        head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192,
        tie_word_embeddings=False, torch_dtype="bfloat16"),
    "llama-3.2-1b": dict(
        architecture="LlamaForCausalLM", model_type="llama", **_LLAMA3_VOCAB, hidden_size=2048,
        intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
        tie_word_embeddings=True, torch_dtype="bfloat16"),
    "smollm2-135m": dict(
        architecture="LlamaForCausalLM", model_type="llama", vocab_size=49152, hidden_size=576,
        intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192,
        tie_word_embeddings=True, bos_token_id=1, eos_token_ids=[2], torch_dtype="bfloat16"),
    # mixture-of-experts and Gemma shapes (docs/models.md; the MoE fields in hf_config as config.json has them)
    "qwen3-30b-a3b": dict(
        architecture="Qwen3MoeForCausalLM", model_type="qwen3_moe", vocab_size=151936, hidden_size=2048,
        intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=False,
        qk_norm=True, bos_token_id=151643, eos_token_ids=[151645], torch_dtype="bfloat16",
        hf_config={"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                   "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}),
    "gpt-oss-20b": dict(
        architecture="GptOssForCausalLM", model_type="gpt_oss", vocab_size=201088, hidden_size=2880,
        intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
        rms_norm_eps=1e-5, rope_theta=150000.0, max_position_embeddings=131072, tie_word_embeddings=False,
        rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                      "original_max_position_embeddings": 4096},
        attention_bias=True, attention_out_bias=True, sliding_window=128, layer_types=["sliding_attention",
                                                                                        "full_attention"] * 12,
        attention_sinks=True, bos_token_id=199998, eos_token_ids=[200002], torch_dtype="bfloat16",
        hf_config={"num_local_experts": 32, "num_experts_per_tok": 4, "swiglu_limit": 7.0}),
    "gemma-3-27b": dict(
        architecture="Gemma3ForCausalLM", model_type="gemma3_text", vocab_size=262208, hidden_size=5376,
        intermediate_size=21504, num_hidden_layers=62, num_attention_heads=32, num_key_value_heads=16, head_dim=128,
        rms_norm_eps=1e-6, rope_theta=1000000.0, rope_scaling={"rope_type": "linear", "factor": 8.0},
        max_position_embeddings=131072, tie_word_embeddings=True, qk_norm=True, query_pre_attn_scalar=168,
        sliding_window=1024, layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                          for i in range(62)],
        bos_token_id=2, eos_token_ids=[1, 106], torch_dtype="bfloat16",
        hf_config={"rope_local_base_freq": 10000.0, "hidden_activation": "gelu_pytorch_tanh",
                   "final_logit_softcapping": None}),
    "tiny": dict(
        architecture="LlamaForCausalLM", model_type="llama", vocab_size=49152, hidden_size=64,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=2048,
        tie_word_embeddings=True, bos_token_id=1, eos_token_ids=[2], torch_dtype="float32"),
}
