"""Building a model for a rank: its attention backend (selection and construction), its quantization
method and its weights.

The engine's worker builds its shard of the target model here, and a drafter that runs a model of its
own (the ``draft_model`` plugin) builds that one with the same calls, so that both pick a backend by the
same rules (``kvforge.builder.select_attention_backend``, fed the model's attention features) and load
weights through ``kvforge.model.loader.load_model``. What differs is passed in, not re-implemented: the
worker's tensor-parallel group and pipeline stage (a draft model is unsharded), its KV cache element
type, the ``[plugins.<name>]`` options of the engine's config.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Protocol, cast

import torch

from kvforge.attention import AttentionBackend, AttentionMetadata
from kvforge.builder import component, select_attention_backend
from kvforge.config import EngineConfig, build_options
from kvforge.model import quantization
from kvforge.model.config import ModelConfig
from kvforge.model.interface import attention_features
from kvforge.model.loader import ModelSource, load_model
from kvforge.model.quantization import QuantizationMethod
from kvforge.plugin_manager import PluginManager
from kvforge.rank import parallel_state
from kvforge.rank.parallel_state import SINGLE, WHOLE, PPStage, TPGroup


class RankModel(Protocol):
    """What a rank calls on a built model: a ``kvforge.model.interface.CausalLM`` that is a torch module
    (called, so that its hooks run, rather than through ``forward``)."""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                 attn_meta: AttentionMetadata, intermediate: tuple[torch.Tensor, torch.Tensor] | None = None
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Hidden states [num_tokens, hidden_size]; a pipeline stage before the last returns (hidden, residual)."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden_size] -> logits [n, vocab_size]."""
        ...


def hidden_states(out: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The hidden states of a forward that ran the last (or only) pipeline stage."""
    if isinstance(out, tuple):
        raise RuntimeError("the model returned (hidden, residual): it was built for a pipeline stage before the last")
    return out


@dataclass
class BuiltModel:
    """A model on its device, the attention backend every layer of it shares, and its quantization."""

    module: torch.nn.Module  # the loaded model (LoRA wraps its layers; its parameters are the weights)
    attn: AttentionBackend
    attn_name: str  # the backend's registry name (``auto`` resolved)
    attn_cls: type[AttentionBackend]
    quant: QuantizationMethod | None  # None: the model dtype

    @property
    def model(self) -> RankModel:
        # NOTE: load_model builds the class registered for the architecture, a CausalLM module
        return cast(RankModel, self.module)


def select_backend(pm: PluginManager, name: str, mc: ModelConfig, *, device: torch.device, dtype: torch.dtype,
                   block_size: int, kv_cache_dtype: torch.dtype | None = None) -> tuple[str, type[AttentionBackend]]:
    """The attention backend (name, class) for ``name`` (``auto``: the best that accepts this setup and
    the per-layer attention variants the model's class and config need)."""
    features = attention_features(pm.get("model", mc.architecture), mc)
    return select_attention_backend(pm, name, device=device, dtype=dtype, head_size=mc.head_dim,
                                    block_size=block_size, kv_cache_dtype=kv_cache_dtype, features=features)


def checkpoint_quantization(pm: PluginManager, mc: ModelConfig) -> str | None:
    """The registered method that loads the checkpoint's ``quantization_config`` (None: unquantized)."""
    return quantization.resolve(quantization.registered(pm), None, mc)


def quantization_method(pm: PluginManager, name: str | None, mc: ModelConfig,
                        engine_config: EngineConfig | None = None) -> QuantizationMethod | None:
    """The quantization method ``name`` built for ``mc`` (None for None). With ``engine_config`` (the
    engine's own model) it gets that config and its ``[plugins.<name>]`` options; without (a draft
    model), its defaults."""
    if name is None:
        return None
    if engine_config is None:
        return pm.get("quantization_method", name)(model_config=mc)
    return component(pm, "quantization_method", name, engine_config, engine_config=engine_config, model_config=mc)


def build_model(pm: PluginManager, source: ModelSource, mc: ModelConfig, *, attention_backend: str,
                device: torch.device, dtype: torch.dtype, block_size: int, kv_cache_dtype: torch.dtype | None = None,
                quant: QuantizationMethod | None = None, group: TPGroup = SINGLE, stage: PPStage = WHOLE,
                seed: int = 0, plugin_options: Mapping[str, dict] | None = None) -> BuiltModel:
    """Select and construct the attention backend for ``group``'s share of the heads, then build and
    load ``stage``'s layers of the model inside ``group`` (the defaults: one unsharded model).

    ``kv_cache_dtype``: the KV cache's element type (None: the model dtype); ``seed``: dummy weights'
    seed; ``plugin_options``: ``EngineConfig.plugins``, whose table for the backend is validated by
    its ``Options`` and passed to it (None: the backend's defaults)."""
    name, cls = select_backend(pm, attention_backend, mc, device=device, dtype=dtype, block_size=block_size,
                               kv_cache_dtype=kv_cache_dtype)
    options = build_options(cls, name, plugin_options.get(name, {})) if plugin_options is not None else {}
    attn = make_attention(cls, mc, device=device, dtype=dtype, block_size=block_size, kv_cache_dtype=kv_cache_dtype,
                          group=group, options=options)
    with parallel_state.building(group, stage):
        module = load_model(source, mc, attn, dtype, device, seed=seed, quant=quant)
    return BuiltModel(module, attn, name, cls, quant)


def make_attention(cls: type[AttentionBackend], mc: ModelConfig, *, device: torch.device, dtype: torch.dtype,
                   block_size: int, kv_cache_dtype: torch.dtype | None = None, group: TPGroup = SINGLE,
                   options: Mapping[str, Any] | None = None) -> AttentionBackend:
    """The backend ``cls`` for ``group``'s share of ``mc``'s heads (a drafter's head that is no registered
    model builds its own this way, after ``kvforge.builder.select_attention_backend``)."""
    shard = parallel_state.head_shard(mc.num_attention_heads, mc.num_key_value_heads, group.size, group.rank)
    attn_kwargs = {"kv_cache_dtype": kv_cache_dtype} if kv_cache_dtype is not None else {}
    return cls(num_heads=shard.num_heads, num_kv_heads=shard.num_kv_heads, head_size=mc.head_dim,
               scale=mc.attention_scale, block_size=block_size, dtype=dtype, device=device,
               **attn_kwargs, **dict(options or {}))
