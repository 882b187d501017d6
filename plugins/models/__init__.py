"""Built-in model implementations, registered by Hugging Face architecture name.

Names map to lazy import paths: discovering the plugin imports no model code.
"""
from kvforge.hookspecs import hookimpl

_LLAMA = "kvforge.plugins.models.llama:LlamaForCausalLM"


@hookimpl
def register_models(register):
    # Mistral, Qwen2 and Qwen3 are Llama with config switches (q/k/v bias, q/k norm, head_dim).
    for architecture in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        register(architecture, _LLAMA)
