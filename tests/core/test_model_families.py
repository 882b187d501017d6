"""Model families own their config (kvforge.model.families): a registered model class reads its own
config.json and GGUF fields into its own config class, declares its model types, GGUF architectures and
presets, and core's config module knows no family by name."""
from __future__ import annotations

import pathlib
import types
from dataclasses import dataclass

import gguf
import pytest

import kvforge
from kvforge.model.config import PRESETS, ConfigFields, GGUFArchitecture, GGUFMetadata, HFConfig, ModelConfig
from kvforge.model.interface import ModelFamily, family_of
from kvforge.plugin_manager import get_plugin_manager, reset_plugin_manager
from kvforge.plugins.models.llama import LlamaForCausalLM

_SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2)


@dataclass
class FooConfig(ModelConfig):
    foo_scale: float = 1.0

    @property
    def attention_scale(self) -> float:
        return self.foo_scale


class FooForCausalLM(LlamaForCausalLM):
    """A family kvforge does not ship: Llama's computation, its own config field, model type, GGUF files
    and preset."""

    config_class = FooConfig
    family = ModelFamily(
        model_types={"foo": "FooForCausalLM"},
        refused_model_types={"foo_vision": "FooVisionForConditionalGeneration (text and images); kvforge serves the "
                                           "text-only 'foo' checkpoints"},
        gguf_architectures={"foo": GGUFArchitecture("foo", block_names={"ffn_norm": "pre_mlp_norm"})},
        presets={"foo-tiny": FooConfig(architecture="FooForCausalLM", model_type="foo", head_dim=8, foo_scale=0.5,
                                       **_SHAPE)})

    @classmethod
    def config_from_hf(cls, fields: ConfigFields, hf: HFConfig) -> FooConfig:
        return FooConfig(**fields, foo_scale=float(hf.get("foo_scale", 1.0)))

    @classmethod
    def config_from_gguf(cls, fields: ConfigFields, gguf: GGUFMetadata) -> FooConfig:
        return FooConfig(**fields, foo_scale=float(gguf.get("foo_scale")))


@pytest.fixture
def foo_registered():
    reset_plugin_manager()
    pm = get_plugin_manager()
    plugin = types.ModuleType("foo_plugin")
    plugin.register_models = kvforge.hookimpl(lambda register: register("FooForCausalLM", FooForCausalLM))
    pm.register(plugin, "foo")
    yield pm
    reset_plugin_manager()


def test_a_family_reads_its_own_config_json(foo_registered):
    c = ModelConfig.from_hf_dict({**_SHAPE, "model_type": "foo", "foo_scale": 0.25})  # no "architectures"
    assert type(c) is FooConfig and (c.architecture, c.foo_scale, c.attention_scale) == ("FooForCausalLM", 0.25, 0.25)
    assert c.head_dim == 8  # the general fields are core's
    c = ModelConfig.from_hf_dict({**_SHAPE, "model_type": "whatever", "architectures": ["FooForCausalLM"]})
    assert type(c) is FooConfig and c.foo_scale == 1.0
    with pytest.raises(ValueError, match="'model_type' is 'bar' and it names no 'architectures'.*foo.*llama"):
        ModelConfig.from_hf_dict({**_SHAPE, "model_type": "bar"})


def test_a_family_declares_its_presets(foo_registered):
    assert "foo-tiny" in PRESETS and "tiny" in PRESETS
    c = ModelConfig.from_preset("foo-tiny")
    assert type(c) is FooConfig and c.foo_scale == 0.5
    assert c is not PRESETS["foo-tiny"] and c.eos_token_ids is not PRESETS["foo-tiny"].eos_token_ids
    foo_registered.unregister("foo")
    assert "foo-tiny" not in PRESETS


def test_a_family_reads_its_own_gguf_files(foo_registered, tmp_path):
    path = str(tmp_path / "foo.gguf")
    writer = gguf.GGUFWriter(path, "foo")
    for key, value in (("embedding_length", 32), ("feed_forward_length", 64), ("block_count", 2),
                       ("attention.head_count", 4), ("attention.head_count_kv", 2), ("vocab_size", 64)):
        writer.add_uint32(f"foo.{key}", value)
    writer.add_float32("foo.foo_scale", 0.125)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    c = ModelConfig.from_gguf(path)
    assert type(c) is FooConfig and (c.architecture, c.model_type, c.foo_scale) == ("FooForCausalLM", "foo", 0.125)
    assert (c.hidden_size, c.num_key_value_heads, c.head_dim, c.tie_word_embeddings) == (32, 2, 8, True)
    from kvforge.model.loader import gguf_to_hf_name

    layout = family_of(FooForCausalLM).gguf_architectures["foo"]
    assert gguf_to_hf_name("blk.1.ffn_norm.weight", layout.block_names) == "model.layers.1.pre_mlp_norm.weight"
    assert gguf_to_hf_name("blk.1.attn_q.weight", layout.block_names) == "model.layers.1.self_attn.q_proj.weight"


def test_unknown_gguf_architecture_lists_the_families_ones(tmp_path):
    path = str(tmp_path / "bar.gguf")
    writer = gguf.GGUFWriter(path, "bar")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="general.architecture is 'bar'; supported: .*gemma3.*llama.*qwen2"):
        ModelConfig.from_gguf(path)


def test_a_family_refuses_a_model_type_with_its_reason(foo_registered):
    with pytest.raises(ValueError, match="'model_type' is 'foo_vision': .*'foo' checkpoints"):
        ModelConfig.from_hf_dict({**_SHAPE, "model_type": "foo_vision",
                                  "architectures": ["FooVisionForConditionalGeneration"]})


def test_a_subclass_registered_under_another_name_inherits_no_family_data(foo_registered):
    """Granite subclasses Llama: a llama config.json still goes to LlamaForCausalLM, not to it."""
    c = ModelConfig.from_hf_dict({**_SHAPE, "model_type": "llama"})
    assert c.architecture == "LlamaForCausalLM" and type(c) is ModelConfig


def test_core_model_modules_name_no_family():
    """The families' rules live in their model files: no built-in model type (beyond the reference Llama's
    own name) is spelled in core's config, loader, lookup or contract."""
    pm = get_plugin_manager()
    model_types = {t for name in pm.names("model") if name.startswith(("Llama", "Mistral", "Qwen", "Gemma", "Phi",
                                                                      "Mixtral", "GptOss"))
                   for t in family_of(pm.get("model", name)).model_types}
    assert {"gemma2", "gemma3_text", "gpt_oss", "mixtral", "phi3", "qwen2", "qwen3_moe", "mistral"} <= model_types
    core = pathlib.Path(kvforge.__file__).parent / "model"
    for module in ("config.py", "loader.py", "families.py", "interface.py"):
        text = (core / module).read_text().lower()
        assert [t for t in sorted(model_types - {"llama"}) if t in text] == [], module


def test_every_preset_round_trips_through_its_config_json():
    """A family's export (``to_hf_dict``) and its parser agree, its own fields included, and transformers
    reads the export as the same architecture (the benchmarks' reference models are built from it)."""
    import transformers

    for name in PRESETS:
        config = ModelConfig.from_preset(name)
        assert ModelConfig.from_hf_dict(config.to_hf_dict()) == config, name
        d = config.to_hf_dict()
        del d["architectures"]
        hf = transformers.AutoConfig.for_model(d.pop("model_type"), **d)
        assert (hf.num_hidden_layers, hf.sliding_window) == (config.num_hidden_layers, config.sliding_window), name
        if config.sliding_window is not None:
            assert [config.window_of(i) is not None for i in range(config.num_hidden_layers)] == [
                t == "sliding_attention" for t in hf.layer_types], name
