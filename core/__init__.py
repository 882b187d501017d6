"""kvforge: a high-throughput LLM inference and serving engine built as a plugin framework.

``from kvforge import LLM, SamplingParams`` is the public offline API.
"""
from kvforge.hookspecs import hookimpl
from kvforge.sampling_params import SamplingParams

__version__ = "0.1.0"
from kvforge.sampling_params import StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "BeamSearchParams", "BeamSearchOutput", "hookimpl",
           "RequestOutput", "CompletionOutput", "EngineConfig", "LLMEngine", "LoRARequest"]


def __getattr__(name):  # keep `import kvforge` light: torch-heavy parts load on first use
    if name in ("BeamSearchParams", "BeamSearchOutput"):
        from kvforge.engine import beam_search
        return getattr(beam_search, name)
    if name == "LLM":
        from kvforge.engine.llm import LLM
        return LLM
    if name in ("RequestOutput", "CompletionOutput"):
        from kvforge import outputs
        return getattr(outputs, name)
    if name == "EngineConfig":
        from kvforge.config import EngineConfig
        return EngineConfig
    if name == "LoRARequest":
        from kvforge.lora.request import LoRARequest
        return LoRARequest
    if name == "LLMEngine":
        from kvforge.engine.llm_engine import LLMEngine
        return LLMEngine
    raise AttributeError(f"module 'kvforge' has no attribute {name!r}")
