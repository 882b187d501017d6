"""The architecture of a decoder-only model, read from a Hugging Face ``config.json``, GGUF metadata or a
named dummy preset.

:class:`ModelConfig` is what model implementations (``register_models`` plugins) are built from; it
holds only what changes the computation, never runtime options (those live in the engine config).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

#: HF ``model_type`` -> ``architectures[0]`` for the families the built-in models implement.
ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

#: GGUF ``general.architecture`` values we can read (llama.cpp stores Mistral as ``llama``).
GGUF_ARCHITECTURES: tuple[str, ...] = ("llama", "qwen2", "qwen3")


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
    # config.json's quantization_config (a pre-quantized checkpoint; kvforge.quantization.resolve picks
    # the method that loads it); None: unquantized
    quantization_config: dict[str, Any] | None = None

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

    # -- constructors ------------------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from the contents of a Hugging Face ``config.json`` (transformers 4.x or 5.x format)."""
        model_type = d.get("model_type")
        if model_type not in ARCHITECTURES:
            raise ValueError(f"config.json field 'model_type' is {model_type!r}; supported: {', '.join(ARCHITECTURES)}")
        architecture = (d.get("architectures") or [ARCHITECTURES[model_type]])[0]
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json field 'hidden_act' is {d['hidden_act']!r}; only 'silu' is supported")
        if d.get("mlp_bias"):
            raise ValueError("config.json field 'mlp_bias' is true; MLP biases are not supported")
        quant = d.get("quantization_config")
        if quant is not None and not (isinstance(quant, dict) and isinstance(quant.get("quant_method"), str)):
            raise ValueError("config.json field 'quantization_config' must be an object with a 'quant_method' string")
        # transformers 5 moved rope_theta and rope_scaling into one "rope_parameters" dict.
        rope_params = dict(d.get("rope_parameters") or {})
        rope_theta = d.get("rope_theta", rope_params.pop("rope_theta", 10000.0))
        rope_scaling = d.get("rope_scaling") or rope_params or None
        if rope_scaling is not None:
            rope_scaling = {k: v for k, v in rope_scaling.items() if k not in ("rope_theta", "partial_rotary_factor")}
        heads = d["num_attention_heads"]
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
            attention_bias=True if model_type == "qwen2" else bias,
            attention_out_bias=False if model_type in ("qwen2", "mistral") else bias,
            qk_norm=model_type == "qwen3",
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
            torch_dtype=d.get("torch_dtype") or d.get("dtype"),
            sliding_window=_sliding_window(d, model_type),
            quantization_config=dict(quant) if quant is not None else None,
        )

    @classmethod
    def from_gguf(cls, reader: Any) -> ModelConfig:
        """Build from a ``gguf.GGUFReader`` (or a path to a ``.gguf`` file) using its metadata and tensor names."""
        if isinstance(reader, str):
            import gguf

            reader = gguf.GGUFReader(reader)
        arch = _gguf_field(reader, "general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise ValueError(f"GGUF general.architecture is {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}")

        def get(key: str, default: Any = None) -> Any:
            return _gguf_field(reader, f"{arch}.{key}", default)

        tensors = {t.name: t for t in reader.tensors}
        hidden = int(get("embedding_length"))
        heads = int(get("attention.head_count"))
        head_dim = int(get("attention.key_length") or get("rope.dimension_count") or hidden // heads)
        vocab = get("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
        rope_scaling = None
        if get("rope.scaling.type") == "linear":
            rope_scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
        if "rope_freqs.weight" in tensors:  # llama.cpp's form of Llama-3.1 rope scaling: per-frequency divisors
            rope_scaling = {"rope_type": "freq_factors",
                            "factors": [float(x) for x in tensors["rope_freqs.weight"].data.reshape(-1)]}
        eos = [_gguf_field(reader, k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
        eos_ids = list(dict.fromkeys(int(e) for e in eos if e is not None))
        bos = _gguf_field(reader, "tokenizer.ggml.bos_token_id")
        return cls(
            architecture=ARCHITECTURES[arch],
            model_type=arch,
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
            eos_token_ids=eos_ids,
            torch_dtype=None,  # dequantized to float32; the engine picks the compute dtype
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
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else (self.eos_token_ids or None),
        }
        if self.model_type in ("llama", "qwen3"):
            d["attention_bias"] = self.attention_bias
        if self.model_type == "mistral" or self.sliding_window is not None:
            d["sliding_window"] = self.sliding_window
            if self.model_type in ("qwen2", "qwen3"):
                d["use_sliding_window"] = self.sliding_window is not None
        if self.torch_dtype is not None:
            d["torch_dtype"] = self.torch_dtype
        if self.quantization_config is not None:
            d["quantization_config"] = dict(self.quantization_config)
        return d

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _sliding_window(d: dict[str, Any], model_type: str) -> int | None:
    """The window a checkpoint's attention really uses: Qwen configs carry one that is off unless
    ``use_sliding_window`` is set."""
    window = d.get("sliding_window")
    if model_type in ("qwen2", "qwen3") and not d.get("use_sliding_window", False):
        return None
    return int(window) if isinstance(window, int) and not isinstance(window, bool) and window > 0 else None


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
    "tiny": dict(
        architecture="LlamaForCausalLM", model_type="llama", vocab_size=49152, hidden_size=64,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=2048,
        tie_word_embeddings=True, bos_token_id=1, eos_token_ids=[2], torch_dtype="float32"),
}
