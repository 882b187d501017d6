"""Shared fixtures: the default model, a tiny random Llama, and the installed dummy plugin package."""
import importlib.metadata as md
import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(__file__)
DUMMY_PLUGIN_DIR = os.path.join(HERE, "plugins", "dummy_plugin")

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run on the GPU machine with -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def default_model_path():
    from kvforge.model_loader import default_model_path
    return default_model_path()


@pytest.fixture(scope="session")
def hf_base(default_model_path):
    """The default model in transformers (dequantized from its GGUF, float32): the base of the LoRA tests' adapters."""
    from lora_adapters import load_hf_base
    return load_hf_base(default_model_path)


@pytest.fixture(scope="session")
def dummy_plugin_installed():
    """The third-party dummy plugin package, installed into this environment (once)."""
    try:
        md.distribution("kvforge-dummy-plugin")
    except md.PackageNotFoundError:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                        "-e", DUMMY_PLUGIN_DIR], check=True)
        import importlib
        import site
        import sysconfig
        # pick up the new editable install's .pth in this already-running interpreter
        site.addsitedir(sysconfig.get_paths()["purelib"])
        importlib.invalidate_caches()
    from kvforge.plugin_manager import reset_plugin_manager
    reset_plugin_manager()
    yield
    reset_plugin_manager()


@pytest.fixture(scope="session")
def tiny_llm():
    """A tiny random Llama (2 layers, hidden 64) with the default model's tokenizer."""
    from kvforge import LLM
    return LLM("dummy:tiny", max_model_len=512, num_gpu_blocks_override=256, device="cpu")


def assert_no_blocks_held(engine):
    stats = engine.kv_cache.stats()
    assert stats.num_used_blocks == 0, stats
    assert stats.num_free_cpu_blocks == stats.num_cpu_blocks, stats  # nothing left in the swap pool
    blocks = getattr(engine.kv_cache, "blocks", [])
    assert all(b.ref_count == 0 for b in blocks)


@pytest.fixture
def check_no_blocks():
    return assert_no_blocks_held


@pytest.fixture
def run_in_triton_interpreter():
    """Re-run a test file in a fresh Python with TRITON_INTERPRET=1 (the interpreter must be on before
    triton is first imported, and off for every other test) and check that it passed."""
    def run(path: str) -> None:
        env = dict(os.environ, TRITON_INTERPRET="1")
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path],
                              env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-4000:]
        assert " passed" in proc.stdout and " skipped" in proc.stdout  # and the parent-only test skipped
    return run


@pytest.fixture(autouse=True)
def collect_engines_after_slow_tests():
    """Engines hold reference cycles (threads, callbacks), so one a test drops lives on until a full
    collection, with its KV pool: over the suite that grew the process past 20 GB (CI has 24). A test
    that ran long enough to have built one gets a full collection after it."""
    import gc
    import time

    start = time.perf_counter()
    yield
    if time.perf_counter() - start > 0.5:
        gc.collect()
