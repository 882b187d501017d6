"""Plugin discovery, registration, selection by config, and the third-party dummy plugin package."""
import importlib.metadata as md
import json
import logging
import subprocess
import sys
import types

import pytest

import kvforge
from kvforge import LLM, SamplingParams
from kvforge.plugin_manager import KINDS, PluginManager, get_plugin_manager, reset_plugin_manager


@pytest.fixture
def pm():
    reset_plugin_manager()
    manager = get_plugin_manager()
    yield manager
    reset_plugin_manager()


def fake_plugin(**hooks):
    mod = types.ModuleType("fake_plugin")
    for name, fn in hooks.items():
        setattr(mod, name, kvforge.hookimpl(fn))
    return mod


def test_builtins_are_discovered_through_entry_points(pm):
    assert "torch" in pm.names("attention_backend")
    assert "fcfs" in pm.names("scheduler")
    assert "default" in pm.names("sampler")
    assert "paged" in pm.names("kv_cache_manager")
    assert {"cpu", "disk"} <= set(pm.names("kv_connector"))
    assert {"uni", "mp"} <= set(pm.names("executor"))
    assert {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"} <= set(pm.names("model"))
    assert pm.plugins["attention"].distribution == "kvforge"


def test_loading_is_idempotent(pm):
    assert get_plugin_manager() is pm
    before = {k: pm.names(k) for k in pm.registries}
    pm.load_entry_points()
    assert {k: pm.names(k) for k in pm.registries} == before


def test_every_registration_hook(pm):
    class FakeSampler:  # a class target (not a lazy string)
        pass

    plugin = fake_plugin(
        register_samplers=lambda register: register("fake_sampler", FakeSampler),
        register_kv_cache_managers=lambda register: register("fake_kv", "kvforge.plugins.kv_cache.paged:PagedKVCacheManager"),
        register_kv_connectors=lambda register: register("fake_tier", "kvforge.plugins.kv_cache.cpu_tier:CPUConnector"),
        register_drafters=lambda register: register("fake_drafter", "kvforge.spec_decode.drafter:Drafter"),
        register_models=lambda register: register("FakeForCausalLM", "kvforge.plugins.models.llama:LlamaForCausalLM"),
        register_attention_backends=lambda register: register("fake_attn", "kvforge.plugins.attention.torch_backend:TorchAttentionBackend"),
        register_schedulers=lambda register: register("fake_sched", "kvforge.plugins.scheduling.fcfs:FCFSScheduler"),
        register_logits_processors=lambda register: register("fake_lp", "kvforge.sampler:LogitsProcessor"),
        register_executors=lambda register: register("fake_exec", "kvforge.rank.executor:UniExecutor"),
        register_quantization_methods=lambda register: register(
            "fake_quant", "kvforge.plugins.quantization.fp8:Fp8Quantization"),
        register_tool_parsers=lambda register: register("fake_tools", "kvforge.tool_parsing:ToolParser"),
        register_reasoning_parsers=lambda register: register("fake_reasoning", "kvforge.tool_parsing:ReasoningParser"),
    )
    pm.register(plugin, "fake")
    try:
        assert set(pm.plugins["fake"].registers) == set(KINDS)  # every kind's hook, none left out
        assert pm.get("sampler", "fake_sampler") is FakeSampler
        assert pm.get("kv_cache_manager", "fake_kv").__name__ == "PagedKVCacheManager"
        assert pm.get("drafter", "fake_drafter").__name__ == "Drafter"
        assert pm.get("model", "FakeForCausalLM").__name__ == "LlamaForCausalLM"
        assert pm.get("attention_backend", "fake_attn").name == "torch"
        assert pm.get("scheduler", "fake_sched").name == "fcfs"
        assert pm.get("quantization_method", "fake_quant").__name__ == "Fp8Quantization"
        assert pm.get("logits_processor", "fake_lp").__name__ == "LogitsProcessor"
        assert pm.get("executor", "fake_exec").name == "uni"
        assert pm.get("tool_parser", "fake_tools").__name__ == "ToolParser"
        assert pm.get("reasoning_parser", "fake_reasoning").__name__ == "ReasoningParser"
        assert pm.plugins["fake"].registers["sampler"] == ["fake_sampler"]
    finally:
        pm.unregister("fake")
    assert "fake_sampler" not in pm.names("sampler")


def test_engine_created_hook_sees_the_engine(pm):
    seen = []
    pm.register(fake_plugin(engine_created=lambda engine: seen.append(engine)), "observer")
    try:
        llm = LLM("dummy:tiny", device="cpu", num_gpu_blocks_override=16)
        assert seen == [llm.llm_engine]
    finally:
        pm.unregister("observer")


def test_duplicate_name_is_an_error(pm):
    with pytest.raises(ValueError, match="registered twice.*attention.*dup"):
        pm.register(fake_plugin(register_attention_backends=lambda register: register("torch", object)), "dup")


def test_selected_component_that_fails_to_import_fails_loudly(pm):
    pm.register(fake_plugin(register_samplers=lambda register: register("broken", "no_such_module:Thing")), "brk")
    try:
        with pytest.raises(ImportError, match="sampler 'broken' from plugin 'brk'.*no_such_module"):
            pm.get("sampler", "broken")
    finally:
        pm.unregister("brk")


def test_failing_plugin_is_logged_and_skipped(monkeypatch, caplog):
    class BadEP:
        name, value, group = "bad_plugin", "bad_plugin_module", "kvforge"
        dist = None

        def load(self):
            raise RuntimeError("boom")

    real = md.entry_points
    monkeypatch.setattr(md, "entry_points", lambda group: list(real(group=group)) + [BadEP()])
    manager = PluginManager()
    with caplog.at_level(logging.WARNING):
        manager.load_entry_points()
    assert "bad_plugin" in caplog.text and "boom" in caplog.text
    assert "bad_plugin" in manager.failed and "torch" in manager.names("attention_backend")
    with pytest.raises(ValueError, match="bad_plugin: RuntimeError"):
        manager.get("sampler", "whatever")


def test_unknown_component_lists_valid_names(pm):
    with pytest.raises(ValueError, match="unknown scheduler 'nope'; valid names: .*fcfs"):
        pm.get("scheduler", "nope")


def test_third_party_plugin_selected_by_config_file(dummy_plugin_installed, tmp_path, tiny_llm):
    from kvforge_dummy_plugin.components import CountingAttention, CountingScheduler

    cfg = tmp_path / "kvforge.toml"
    cfg.write_text('model = "dummy:tiny"\ndevice = "cpu"\nattention_backend = "dummy_attn"\n'
                   'scheduler = "dummy_sched"\nnum_gpu_blocks_override = 64\n'
                   '[plugins.dummy_sched]\nlabel = "from-config"\n')
    llm = LLM(config=str(cfg))
    assert llm.llm_engine.attn_backend_name == "dummy_attn"
    p = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    out = llm.generate(["plugins are loaded by name"], p, use_tqdm=False)[0].outputs[0].token_ids
    assert CountingAttention.forward_calls > 0 and CountingScheduler.schedule_calls > 0
    assert CountingScheduler.last_label == "from-config"
    ref = tiny_llm.generate(["plugins are loaded by name"], p, use_tqdm=False)[0].outputs[0].token_ids
    assert out == ref
    # engine arguments override the file
    llm2 = LLM(config=str(cfg), scheduler="fcfs", plugins={"dummy_sched": {"label": "x"}})
    assert type(llm2.llm_engine.scheduler).__name__ == "FCFSScheduler"


def test_third_party_drafter_selected_by_config_file(dummy_plugin_installed, tmp_path, tiny_llm):
    from kvforge_dummy_plugin.components import RepeatDrafter

    cfg = tmp_path / "kvforge.toml"
    cfg.write_text('model = "dummy:tiny"\ndevice = "cpu"\nnum_gpu_blocks_override = 64\n'
                   '[speculative]\nmethod = "dummy_repeat"\nnum_speculative_tokens = 3\npolicy = "fixed"\ntimes = 2\n')
    llm = LLM(config=str(cfg))
    assert type(llm.llm_engine.drafter).__name__ == "RepeatDrafter" and llm.llm_engine.drafter.times == 2
    p = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = ["drafters are loaded by name", "a third-party drafter"]
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, p, use_tqdm=False)]
    assert out == [o.outputs[0].token_ids for o in tiny_llm.generate(prompts, p, use_tqdm=False)]
    stats = llm.llm_engine.get_stats()["spec_decode"]
    assert RepeatDrafter.propose_calls > 0 and stats["num_draft_tokens"] > 0
    assert stats["accepted_by_position"][2] == 0  # times = 2: never a third draft


def test_third_party_executor_selected_by_config_file(dummy_plugin_installed, tmp_path, tiny_llm):
    from kvforge_dummy_plugin.components import CountingExecutor

    cfg = tmp_path / "kvforge.toml"
    cfg.write_text('model = "dummy:tiny"\ndevice = "cpu"\nnum_gpu_blocks_override = 64\n'
                   'distributed_executor_backend = "dummy_counting"\n[plugins.dummy_counting]\nlabel = "from-config"\n')
    llm = LLM(config=str(cfg))
    assert llm.llm_engine.executor.name == "dummy_counting" and CountingExecutor.last_label == "from-config"
    assert {"determine_num_blocks", "initialize_cache", "initialize_swap_space"} <= set(CountingExecutor.rpc_calls)
    p = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    before = CountingExecutor.execute_calls
    out = llm.generate(["executors are loaded by name"], p, use_tqdm=False)[0].outputs[0].token_ids
    assert CountingExecutor.execute_calls - before >= 6  # a prefill step and a decode step per token
    assert out == tiny_llm.generate(["executors are loaded by name"], p, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="'dummy_counting' runs one rank; tensor_parallel_size x pipeline_parallel_size is 2"):
        LLM(config=str(cfg), tensor_parallel_size=2)


def test_config_errors_list_what_is_valid(dummy_plugin_installed, tmp_path):
    bad_name = tmp_path / "a.yaml"
    bad_name.write_text("model: dummy:tiny\ndevice: cpu\nplugins:\n  nosuch: {x: 1}\n")
    with pytest.raises(ValueError, match=r"\[plugins.nosuch\].*valid names: .*dummy_sched.*fcfs"):
        LLM(config=str(bad_name))
    bad_opt = tmp_path / "b.toml"
    bad_opt.write_text('model = "dummy:tiny"\n[plugins.dummy_sched]\ncolour = "red"\n')
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['colour'\] for 'dummy_sched'; valid options: \['label'\]"):
        LLM(config=str(bad_opt))
    bad_opt2 = tmp_path / "c.toml"
    bad_opt2.write_text('model = "dummy:tiny"\n[plugins.fcfs]\nlong_prefill_token_threshold = -2\n')
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        LLM(config=str(bad_opt2))
    with pytest.raises(ValueError, match="does not exist"):
        LLM(config=str(tmp_path / "missing.toml"))


def test_allow_list_filters_third_party_plugins(dummy_plugin_installed, monkeypatch):
    monkeypatch.setenv("KVFORGE_PLUGINS", "something_else")
    manager = PluginManager()
    manager.load_entry_points()
    assert "dummy" not in manager.plugins and "torch" in manager.names("attention_backend")
    monkeypatch.setenv("KVFORGE_PLUGINS", "dummy")
    manager = PluginManager()
    manager.load_entry_points()
    assert "dummy_attn" in manager.names("attention_backend")
    monkeypatch.delenv("KVFORGE_PLUGINS")
    monkeypatch.setenv("KVFORGE_DISABLE_PLUGIN_AUTOLOAD", "1")
    manager = PluginManager()
    manager.load_entry_points()
    assert "dummy" not in manager.plugins and "fcfs" in manager.names("scheduler")


def test_cli_plugins_lists_json(dummy_plugin_installed):
    out = subprocess.run([sys.executable, "-m", "kvforge.cli", "plugins"], capture_output=True, text=True, check=True)
    report = {p["name"]: p for p in json.loads(out.stdout)}
    assert report["dummy"]["version"] == "0.0.1"
    assert report["dummy"]["registers"] == {"attention_backend": ["dummy_attn"], "scheduler": ["dummy_sched"],
                                            "logits_processor": ["fault", "dummy_ban", "dummy_script"], "drafter": ["dummy_repeat"],
                                            "kv_connector": ["dummy_tier"], "executor": ["dummy_counting"],
                                            "quantization_method": ["dummy_int8"], "model": ["GraniteForCausalLM", "SiglipLlavaForConditionalGeneration"],
                                            "tool_parser": ["dummy_xml"]}
    assert "torch" in report["attention"]["registers"]["attention_backend"]
    assert report["quantization"]["registers"] == {
        "quantization_method": ["fp8", "int4", "awq", "gptq", "mxfp4", "compressed-tensors"]}
    assert report["tool_parsers"]["registers"] == {"tool_parser": ["hermes", "llama3_json", "mistral", "pythonic"]}
    assert report["reasoning_parsers"]["registers"] == {"reasoning_parser": ["deepseek_r1", "qwen3"]}
