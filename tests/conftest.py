"""Shared fixtures: the default model (its engine and its transformers twin, built once), a tiny random
Llama, and the installed dummy plugin package."""
import importlib.metadata as md
import os
import subprocess
import sys

# NOTE: before torch is first imported (OpenMP reads it once), and inherited by every server, engine-core
# and rank process the tests start. OpenMP's threads otherwise spin between parallel regions: as soon as
# another process wants a core (a server's engine process beside its front end, the test driving it, any
# other job on CI's 2 cores), a step runs 2-3x slower. Sleeping costs a few percent at most when nothing competes.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

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
    from kvforge.model.loader import default_model_path
    return default_model_path()


@pytest.fixture(scope="session")
def hf_base(default_model_path):
    """The default model in transformers (dequantized from its GGUF, float32), loaded once: the reference of
    the parity tests and the base of the LoRA tests' adapters. Tests only read it (adapters work on copies)."""
    from lora_adapters import load_hf_base
    return load_hf_base(default_model_path)


@pytest.fixture(scope="session")
def default_llm():
    """The default model on the CPU with a 0.5 GiB KV pool, shared by the tests that only generate with it.
    A test that uses it leaves it as it found it: nothing running, no block held (prefix-cache contents and
    counters aside: compare counters before and after)."""
    from kvforge import LLM
    return LLM(device="cpu", kv_cache_memory_gib=0.5)  # (not the 4 GiB CPU default: CI memory)


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


#: the process's resident memory after the last full collection (MiB), and the growth that triggers the next
_collected_at = [0]
_COLLECT_GROWTH_MIB = 1024


def _rss_mib() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20
    except (OSError, ValueError):
        return None


@pytest.fixture(autouse=True)
def collect_engines_after_slow_tests():
    """Engines hold reference cycles (threads, callbacks), so one a test drops lives on until a full
    collection, with its KV pool: over the suite that grew the process past 20 GB (CI has 24). After a
    test that ran long enough to have built one, a full collection runs once the process has grown by
    1 GiB since the last (a collection costs a fraction of a second with torch and transformers loaded)."""
    import gc
    import time

    start = time.perf_counter()
    yield
    if time.perf_counter() - start < 0.5:
        return
    rss = _rss_mib()
    if rss is None or rss - _collected_at[0] > _COLLECT_GROWTH_MIB:
        gc.collect()
        _collected_at[0] = _rss_mib() or 0
