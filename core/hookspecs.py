"""Hook specifications: the whole surface a kvforge plugin can implement.

A plugin is a module (or object) with functions decorated by ``@kvforge.hookimpl`` whose names
match the specs below, made discoverable through the ``kvforge`` entry-point group::

    # my_plugin.py
    import kvforge

    @kvforge.hookimpl
    def register_attention_backends(register):
        register("my_attn", "my_plugin.backend:MyBackend")

    # pyproject.toml
    [project.entry-points.kvforge]
    my_plugin = "my_plugin"

Registration hooks are called once per process, when the plugin manager is first used (worker
processes call them again). They receive a ``register(name, target)`` callback, where ``target`` is
the class itself or a lazy ``"package.module:Class"`` string that is imported only when the name is
selected, so that discovery never imports CUDA code. Registering a name twice is an error that names
both plugins. No hook is ever called on the hot path: components are resolved once, when an engine is
built, and the engine then calls plain methods on them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import pluggy

if TYPE_CHECKING:
    from fastapi import FastAPI

    from kvforge.engine.llm_engine import LLMEngine

PROJECT_NAME = "kvforge"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

#: ``register(name, target)``: ``target`` is a class or a lazy ``"module:Class"`` path.
Register = Callable[[str, type | str], None]


@hookspec
def register_attention_backends(register: Register) -> None:
    """Register attention backends by name.

    :param register: call ``register(name, target)`` once per backend; ``target`` is a subclass of
        :class:`kvforge.attention.AttentionBackend` or a ``"module:Class"`` string naming one.
    :return: nothing; results are ignored.

    Called once per process when the plugin manager loads. The backend named by the engine's
    ``attention_backend`` option (or picked by ``auto``) is imported and instantiated once per engine.
    """


@hookspec
def register_schedulers(register: Register) -> None:
    """Register schedulers by name.

    :param register: call ``register(name, target)``; ``target`` is a subclass of
        :class:`kvforge.scheduler.Scheduler` or a ``"module:Class"`` string naming one.
    :return: nothing; results are ignored.

    Called once per process when the plugin manager loads; the engine's ``scheduler`` option selects one.
    """


@hookspec
def register_samplers(register: Register) -> None:
    """Register samplers by name.

    :param register: call ``register(name, target)``; ``target`` is a subclass of
        :class:`kvforge.sampler.Sampler` or a ``"module:Class"`` string naming one.
    :return: nothing; results are ignored.

    Called once per process when the plugin manager loads; the engine's ``sampler`` option selects one.
    """


@hookspec
def register_logits_processors(register: Register) -> None:
    """Register logits processors by name; requests enable them with ``SamplingParams.logits_processors``.

    :param register: call ``register(name, target)``; ``target`` is a subclass of
        :class:`kvforge.sampler.LogitsProcessor` or a ``"module:Class"`` string naming one.
    :return: nothing; results are ignored.

    Called once per process when the plugin manager loads. A processor is instantiated once per engine,
    the first time a request names it; an unknown name in a request is a ``ValueError``.
    """


@hookspec
def register_drafters(register: Register) -> None:
    """Register speculative-decoding drafters by name.

    :param register: call ``register(name, target)``; ``target`` is a subclass of
        :class:`kvforge.spec_decode.drafter.Drafter` or a ``"module:Class"`` string naming one.
    :return: nothing; results are ignored.

    Called once per process when the plugin manager loads. Drafters are looked up by name through the
    plugin manager (``get_plugin_manager().get("drafter", name)``).
    """


@hookspec
def register_kv_cache_managers(register: Register) -> None:
    """Register KV-cache managers by name.

    :param register: call ``register(name, target)``; ``target`` is a subclass of
        :class:`kvforge.kv_cache.KVCacheManager` or a ``"module:Class"`` string naming one.
    :return: nothing; results are ignored.

    Called once per process when the plugin manager loads; the engine's ``kv_cache_manager`` option
    selects one.
    """


@hookspec
def register_kv_connectors(register: Register) -> None:
    """Register KV connectors (tiers beyond the GPU for prefix-cached KV blocks) by name.

    :param register: call ``register(name, target)``; ``target`` is a subclass of
        :class:`kvforge.kv_connector.KVConnector` or a ``"module:Class"`` string naming one.
    :return: nothing; results are ignored.

    Called once per process when the plugin manager loads; the engine's ``kv_connector`` option
    selects the first tier (``kv_offload_cpu_gib`` the built-in ``cpu``), ``kv_offload_dir`` adds the
    built-in ``disk`` behind it.
    """


@hookspec
def register_models(register: Register) -> None:
    """Register model implementations by Hugging Face architecture name.

    :param register: call ``register(architecture, target)``, e.g.
        ``register("LlamaForCausalLM", "kvforge.plugins.models.llama:LlamaForCausalLM")``; ``target`` is
        an ``nn.Module`` class following :class:`kvforge.model.interface.CausalLM`.
    :return: nothing; results are ignored.

    Called once per process when the plugin manager loads. The architecture listed in the model's
    ``config.json`` (or derived from GGUF metadata) selects the class.
    """


@hookspec
def register_executors(register: Register) -> None:
    """Register executors (how an engine reaches its ranks) by name.

    :param register: call ``register(name, target)``; ``target`` is a subclass of
        :class:`kvforge.rank.executor.Executor` or a ``"module:Class"`` string naming one.
    :return: nothing; results are ignored.

    Called once per process when the plugin manager loads; the engine's
    ``distributed_executor_backend`` option selects one (built in: ``uni``, ``mp``, ``ray``).
    """


@hookspec
def register_quantization_methods(register: Register) -> None:
    """Register quantization methods (how linear layers store and apply their weights) by name.

    :param register: call ``register(name, target)``; ``target`` is a subclass of
        :class:`kvforge.model.quantization.QuantizationMethod` or a ``"module:Class"`` string naming one.
    :return: nothing; results are ignored.

    Called once per process when the plugin manager loads; the engine's ``quantization`` option
    selects one (built in: ``fp8``). docs/quantization.md gives the contract.
    """


@hookspec
def register_tool_parsers(register: Register) -> None:
    """Register tool-call parsers (model output text -> content and function calls) by name.

    :param register: call ``register(name, target)``; ``target`` is a subclass of
        :class:`kvforge.tool_parsing.ToolParser` or a ``"module:Class"`` string naming one.
    :return: nothing; results are ignored.

    Called once per process when the plugin manager loads. The server looks a parser up by name with
    :func:`kvforge.tool_parsing.get_tool_parser` and builds one instance per request (it keeps streaming
    state). docs/plugins.md gives the contract and its streaming invariant.
    """


@hookspec
def register_reasoning_parsers(register: Register) -> None:
    """Register reasoning parsers (model output text -> reasoning content and content) by name.

    :param register: call ``register(name, target)``; ``target`` is a subclass of
        :class:`kvforge.tool_parsing.ReasoningParser` or a ``"module:Class"`` string naming one.
    :return: nothing; results are ignored.

    Called once per process when the plugin manager loads. The server looks a parser up by name with
    :func:`kvforge.tool_parsing.get_reasoning_parser` and builds one instance per request.
    """


@hookspec
def engine_created(engine: LLMEngine) -> None:
    """Called once when an :class:`kvforge.engine.llm_engine.LLMEngine` has been fully built.

    :param engine: the engine; plugins may read its config and components or attach observers.
    :return: nothing; results are ignored.

    Called in the process that drives the engine, before the first request is added.
    """


@hookspec
def server_app_created(app: FastAPI) -> None:
    """Called once when the OpenAI-compatible server's FastAPI app has been built.

    :param app: the ``fastapi.FastAPI`` instance; a plugin may add routes or middleware.
    :return: nothing; results are ignored.

    Called in the server process, before it starts accepting connections.
    """
