"""examples/kvforge.toml runs as is, and means what the same settings given as keyword arguments mean."""
import gc
import re
import sys
from pathlib import Path

import pytest

from kvforge import LLM, SamplingParams
from kvforge.config import EngineConfig

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "kvforge.toml"


def example_settings() -> dict:
    """The file's settings read with plain tomllib, apart from kvforge's loader."""
    with open(EXAMPLE, "rb") as f:
        return tomllib.load(f)


def test_example_config_is_valid_and_uses_the_default_model():
    config = EngineConfig.create(EXAMPLE)
    assert config == EngineConfig(**example_settings())
    assert config.model is None  # the default model: nothing to download or point at
    assert config.plugins["fcfs"]["long_prefill_token_threshold"] > 0


def test_configuration_md_shows_the_example():
    """docs/configuration.md's TOML block is the example's settings, so the doc's file runs as is too."""
    text = (ROOT / "docs" / "configuration.md").read_text()
    block = re.search(r"```toml\n(.*?)```", text, re.S).group(1)
    assert tomllib.loads(block) == example_settings()


@pytest.mark.slow
def test_example_config_generates_the_tokens_of_the_same_keyword_arguments():
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    # the second prompt is longer than the file's long_prefill_token_threshold: its prefill is chunked
    prompts = ["The capital of France is", "Once upon a time, " * 60]

    llm = LLM(config=EXAMPLE, device="cpu")
    threshold = llm.llm_engine.scheduler.long_prefill_token_threshold
    assert threshold == example_settings()["plugins"]["fcfs"]["long_prefill_token_threshold"]
    assert len(llm.get_tokenizer().encode(prompts[1])) > threshold
    from_file = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    del llm
    gc.collect()

    llm = LLM(**{**example_settings(), "device": "cpu"})
    from_kwargs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    assert [len(t) for t in from_file] == [8, 8]
    assert from_file == from_kwargs
