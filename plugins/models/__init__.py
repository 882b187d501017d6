"""Built-in model implementations, registered by Hugging Face architecture name.

Names map to lazy import paths: discovering the plugin imports no model code.
"""
from kvforge.hookspecs import hookimpl

_LLAMA = "kvforge.plugins.models.llama:LlamaForCausalLM"
#: architecture -> "module:Class" of the other built-in families
MODELS = {
    "Gemma2ForCausalLM": "kvforge.plugins.models.gemma:GemmaForCausalLM",
    "Gemma3ForCausalLM": "kvforge.plugins.models.gemma:GemmaForCausalLM",
    "Gemma3ForConditionalGeneration": "kvforge.plugins.models.gemma3_mm:Gemma3ForConditionalGeneration",
    "Phi3ForCausalLM": "kvforge.plugins.models.phi3:Phi3ForCausalLM",
    "GptOssForCausalLM": "kvforge.plugins.models.gpt_oss:GptOssForCausalLM",
    "MixtralForCausalLM": "kvforge.plugins.models.mixtral:MixtralForCausalLM",
    "Qwen2MoeForCausalLM": "kvforge.plugins.models.mixtral:Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM": "kvforge.plugins.models.mixtral:Qwen2MoeForCausalLM",
    "LlavaForConditionalGeneration": "kvforge.plugins.models.llava:LlavaForConditionalGeneration",
    "LlavaNextForConditionalGeneration": "kvforge.plugins.models.llava_next:LlavaNextForConditionalGeneration",
    "Qwen2VLForConditionalGeneration": "kvforge.plugins.models.qwen2_vl:Qwen2VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration": "kvforge.plugins.models.qwen2_vl:Qwen2_5_VLForConditionalGeneration",
}


@hookimpl
def register_models(register):
    # Mistral, Qwen2 and Qwen3 are Llama with config switches (q/k/v bias, q/k norm, head_dim).
    for architecture in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        register(architecture, _LLAMA)
    for architecture, target in MODELS.items():
        register(architecture, target)
