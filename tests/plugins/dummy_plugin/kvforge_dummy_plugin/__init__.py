"""A third-party plugin: registers an attention backend, a scheduler, a logits processor, a drafter, a KV connector,
an executor,
a quantization method, two model architectures (Granite, and a LLaVA with a SigLIP tower that takes images)
and a tool-call parser."""
import kvforge


@kvforge.hookimpl
def register_attention_backends(register):
    register("dummy_attn", "kvforge_dummy_plugin.components:CountingAttention")


@kvforge.hookimpl
def register_schedulers(register):
    register("dummy_sched", "kvforge_dummy_plugin.components:CountingScheduler")


@kvforge.hookimpl
def register_logits_processors(register):
    register("fault", "kvforge_dummy_plugin.components:FaultInjector")
    register("dummy_ban", "kvforge_dummy_plugin.components:TokenBan")
    register("dummy_script", "kvforge_dummy_plugin.components:Script")


@kvforge.hookimpl
def register_kv_connectors(register):
    register("dummy_tier", "kvforge_dummy_plugin.components:CountingTier")


@kvforge.hookimpl
def register_drafters(register):
    register("dummy_repeat", "kvforge_dummy_plugin.components:RepeatDrafter")


@kvforge.hookimpl
def register_quantization_methods(register):
    register("dummy_int8", "kvforge_dummy_plugin.components:Int8WeightOnly")


@kvforge.hookimpl
def register_executors(register):
    register("dummy_counting", "kvforge_dummy_plugin.components:CountingExecutor")


@kvforge.hookimpl
def register_models(register):
    register("GraniteForCausalLM", "kvforge_dummy_plugin.granite:GraniteForCausalLM")
    register("SiglipLlavaForConditionalGeneration",
             "kvforge_dummy_plugin.siglip_llava:SiglipLlavaForConditionalGeneration")


@kvforge.hookimpl
def register_tool_parsers(register):
    register("dummy_xml", "kvforge_dummy_plugin.tool_parser:DummyXmlToolParser")
