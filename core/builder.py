"""Resolving plugin names into components, once, when an engine is built."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from kvforge.config import EngineConfig, build_options
from kvforge.kv_tier import TierChain
from kvforge.plugin_manager import KINDS, PluginManager

if TYPE_CHECKING:
    from kvforge.rank.executor import Executor

logger = logging.getLogger(__name__)

#: config field naming the selected component of each kind
SELECTING_FIELD = {"attention_backend": "attention_backend", "scheduler": "scheduler", "sampler": "sampler",
                   "kv_cache_manager": "kv_cache_manager"}


def validate_plugin_tables(pm: PluginManager, config: EngineConfig) -> None:
    """Every ``[plugins.<name>]`` table must name a registered component and hold valid options."""
    for name, table in config.plugins.items():
        kinds = [k for k in KINDS if k != "model" and name in pm.registries[k]]
        if not kinds:
            valid = sorted({n for k in KINDS if k != "model" for n in pm.names(k)})
            raise ValueError(f"config [plugins.{name}]: no plugin component is named {name!r}; "
                             f"valid names: {', '.join(valid)}")
        for kind in kinds:
            build_options(pm.get(kind, name), name, table)
    if config.quantization is not None:  # refused before any rank starts, naming what is registered
        pm.get("quantization_method", config.quantization)


def component(pm: PluginManager, kind: str, name: str, config: EngineConfig, **kwargs: Any) -> Any:
    """Instantiate the component ``name`` of ``kind`` with its validated ``[plugins.<name>]`` options."""
    cls = pm.get(kind, name)
    options = build_options(cls, name, config.plugins.get(name, {}))
    return cls(**kwargs, **options)


def kv_connector(pm: PluginManager, name: str, config: EngineConfig) -> Any:
    """The KV connector ``name`` (``kvforge.kv_connector.KVConnector``) as the engine and every rank build
    it: the engine config (it reads its own options there), and its ``[plugins.<name>]`` options."""
    cls = pm.get("kv_connector", name)
    return cls(config=config, **build_options(cls, name, config.plugins.get(name, {})))


def kv_tiers(pm: PluginManager, config: EngineConfig, executor: Executor) -> TierChain | None:
    """The tiers beyond the GPU for prefix-cached blocks (:func:`kv_tier_names`), each rank's stores built
    (``InitializeKVTier``) and the engine's index of each over the smallest rank's slots, chained; None
    without a tier, with prefix caching off, or when no tier keeps a block."""
    from kvforge.rank.messages import InitializeKVTier  # (the rank messages import the step codec)

    names = kv_tier_names(config) if config.enable_prefix_caching else []
    if not names:
        return None
    connectors = [kv_connector(pm, name, config) for name in names]  # (an unknown name fails here, naming the rest)
    slots = [min(per_rank) for per_rank in zip(*executor.call(InitializeKVTier(tuple(names))))]
    return TierChain([c.index(n) for c, n in zip(connectors, slots)]) if any(slots) else None


def kv_tier_names(config: EngineConfig) -> list[str]:
    """The KV tiers' connectors, fastest first: ``kv_connector`` (None: ``cpu`` when ``kv_offload_cpu_gib``
    is set), then ``disk`` behind it when ``kv_offload_dir`` is set (so CPU evictions go to disk)."""
    names = [config.kv_connector or ("cpu" if config.kv_offload_cpu_gib else "")]
    if config.kv_offload_dir is not None:
        names.append("disk")
    return [n for n in dict.fromkeys(names) if n]


def auto_order(pm: PluginManager) -> tuple[list[tuple[str, type]], list[str]]:
    """Every registered attention backend that imports, as (name, class), in ``auto``'s order: highest
    ``capabilities.auto_priority`` first (as declared by the class itself), ties by name (data a third-party backend joins, not a list in
    core). On CUDA the built-ins rank triton > flashinfer > flash_attn > torch: triton's decode is the
    fastest measured (88-101% of the H200's copy bandwidth) and replays in CUDA graphs, and its slower
    prefill (1.5x FA4's attention time) costs little, attention being ~4% of a prefill step
    (docs/benchmarks.md). Also the refusals of those that did not import."""
    loaded, refused = [], []
    for name in pm.names("attention_backend"):
        try:
            loaded.append((name, pm.get("attention_backend", name)))
        except ImportError as exc:
            refused.append(f"{name}: {exc}")
    loaded.sort(key=lambda item: (-_auto_priority(item[1]), item[0]))
    return loaded, refused


def _auto_priority(cls: type) -> int:
    """The backend's ``auto_priority``, if the class declares its capabilities itself: a subclass that
    inherits them unchanged (a wrapper, a test double) does not take its parent's rank, it comes after."""
    return getattr(cls.capabilities, "auto_priority", 0) if "capabilities" in vars(cls) else 0


def select_attention_backend(pm: PluginManager, name: str, *, device: torch.device, dtype: torch.dtype,
                             head_size: int, block_size: int, kv_cache_dtype: torch.dtype | None = None,
                             features: frozenset[str] = frozenset()) -> tuple[str, type]:
    """The backend (name, class) for ``name``; ``auto`` picks the best one that accepts this setup
    (``kv_cache_dtype``: the KV cache's element type, None for the model dtype; ``features``: the
    per-layer attention variants the model needs, ``ModelConfig.attention_features``)."""
    def reasons_of(cls: type) -> list[str]:
        if features:  # only then: a backend's validate written before the argument existed keeps working
            return cls.validate(device=device, dtype=dtype, head_size=head_size, block_size=block_size,
                                kv_cache_dtype=kv_cache_dtype, features=features)
        return cls.validate(device=device, dtype=dtype, head_size=head_size, block_size=block_size,
                            kv_cache_dtype=kv_cache_dtype)

    if name != "auto":
        cls = pm.get("attention_backend", name)
        reasons = reasons_of(cls)
        if reasons:
            raise ValueError(f"attention_backend {name!r} cannot be used: {'; '.join(reasons)}")
        return name, cls
    candidates, refused = auto_order(pm)
    for candidate, cls in candidates:
        reasons = reasons_of(cls)
        if not reasons:
            logger.info("attention backend: %s (auto)%s", candidate,
                        f"; refused: {' | '.join(refused)}" if refused else "")
            return candidate, cls
        refused.append(f"{candidate}: {'; '.join(reasons)}")
    kv = f" kv_cache_dtype={kv_cache_dtype}" if kv_cache_dtype not in (None, dtype) else ""
    needs = f" features={','.join(sorted(features))}" if features else ""
    raise ValueError(f"no attention backend accepts device={device.type} dtype={dtype}{kv} head_size={head_size} "
                     f"block_size={block_size}{needs}: {' | '.join(refused) or 'none registered'}")
