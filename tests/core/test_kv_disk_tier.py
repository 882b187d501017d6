"""The ``disk`` KV tier (issue 40, ``kv_offload_dir``): prefix-cached blocks in files, one per block and
rank, kept across restarts of the engine. A restarted engine gets its prefixes from disk with exactly the
tokens, and the log-probabilities, of a run without any prefix caching; behind the CPU tier it takes the CPU
tier's evictions; a file killed mid-write, torn, truncated or corrupt is never loaded; the byte bound holds; a
load waits for its read ahead. A tiny random model, so that every engine starts in a fraction of a second.

NOTE: the tiny model's greedy tokens barely depend on the context (zeroed keys and values for the shared
prompt leave them unchanged), so every run is compared on the log-probabilities of its tokens too (``close``):
within 1e-4 of a run that computes every block, where a prefill that starts at another block moves them by
1e-6 at most (its sums run in another order) and a wrong block by 1e-2 and more."""
from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Callable

import pytest

from kvforge import LLM, SamplingParams
from kvforge.kv_cache import hash_block
from kvforge.plugins.kv_cache import disk_index
from kvforge.plugins.kv_cache.disk_files import (
    BadBlockFile,
    block_name,
    hash_of,
    header_size,
    pack_header,
    read_block,
    write_block,
)
from kvforge.plugins.kv_cache.disk_index import DiskIndex

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)
BLOCK = 16
ENGINE = dict(device="cpu", max_model_len=256, num_gpu_blocks_override=24, block_size=BLOCK)
GiB = 1 << 30
rng = random.Random(0)
SYSTEM = [rng.randrange(100, 20000) for _ in range(96)]  # 6 blocks every session shares
SESSIONS = [[rng.randrange(100, 20000) for _ in range(64)] for _ in range(8)]  # 4 blocks of its own each


def prompt(session: int, turn: int) -> list[int]:
    return SYSTEM + SESSIONS[session] + [7] * turn


def hashes(tokens: list[int]) -> list[int]:
    """The chained hashes of the prompt's full blocks (a text request without adapter or salt)."""
    out: list[int] = []
    for i in range(len(tokens) // BLOCK):
        out.append(hash_block(out[-1] if out else None, tokens[i * BLOCK:(i + 1) * BLOCK]))
    return out


Output = tuple[list[int], list[float]]  # a request's tokens and their log-probabilities


def output(out: Any) -> Output:
    return list(out.token_ids), [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)]


def run(turns: list[int], after_each: Callable[[], None] | None = None,
        **engine_args: Any) -> tuple[list[Output], list[int], Any, dict]:
    """Each session's prompt of each turn, one request at a time, through a pool of 24 blocks (the 8 sessions
    need 38 distinct blocks), ``after_each()`` after each. Returns the tokens and log-probabilities, the tier's
    hits (tokens) of each request, the KV manager's stats and the engine's; every request ended, no block is
    held."""
    llm = LLM("dummy:tiny", **{**ENGINE, **engine_args})
    try:
        kv, outs, hits = llm.llm_engine.kv_cache, [], []
        for turn in turns:
            for s in range(len(SESSIONS)):
                before = kv.tier_hits
                outs.append(output(llm.generate([prompt(s, turn)], GREEDY, use_tqdm=False)[0].outputs[0]))
                hits.append(kv.tier_hits - before)
                if after_each is not None:
                    after_each()
        stats = kv.stats()
        assert stats.num_used_blocks == 0
        return outs, hits, stats, dict(llm.llm_engine.get_stats())
    finally:
        llm.shutdown()


def close(got: list[Output], want: list[Output], tol: float = 1e-4) -> bool:
    """The same tokens, and log-probabilities within ``tol`` (the module's NOTE)."""
    return [t for t, _ in got] == [t for t, _ in want] and all(
        abs(a - b) <= tol for (_, x), (_, y) in zip(got, want) for a, b in zip(x, y))


def block_files(root: Path) -> list[Path]:
    return sorted(root.glob("*/rank0/*.kv"))


@pytest.fixture(scope="module")
def reference() -> list[Output]:
    return run([0, 1], enable_prefix_caching=False)[0]


def test_a_restarted_engine_gets_its_prefixes_from_disk_with_the_same_tokens(reference, tmp_path):
    first, first_hits, first_stats, _ = run([0], kv_offload_dir=str(tmp_path))
    assert close(first, reference[:8]) and sum(first_hits) == 0  # nothing to load yet: only the GPU cache hits
    # on disk: the shared prompt (written when the GPU cache first hit it) and the blocks the pool reused
    names = {p.name for p in block_files(tmp_path)}
    assert {block_name(h) for h in hashes(prompt(0, 0))} <= names and len(names) == first_stats.tier_held_blocks
    again, hits, stats, engine_stats = run([1], kv_offload_dir=str(tmp_path))  # a fresh engine, the same directory
    assert close(again, reference[8:])
    assert hits[0] == 10 * BLOCK  # the first request's whole prefix came from disk
    assert stats.tier_hits == sum(hits) == stats.tier_hits_by_tier["disk"] > hits[0]
    assert stats.prefix_cache_hits > stats.tier_hits  # the rest came from the GPU cache
    pytest.importorskip("prometheus_client")
    from kvforge.server.metrics import ServerMetrics

    text = ServerMetrics(lambda: engine_stats, "m").render().decode()
    assert f'kvforge:prefix_cache_tier_hits_by_tier_total{{model_name="m",tier="disk"}} {float(sum(hits))}' in text
    assert f'kvforge:prefix_cache_tier_hits_total{{model_name="m"}} {float(sum(hits))}' in text
    assert f'kvforge:kv_tier_blocks{{model_name="m",tier="disk"}} {float(stats.tier_held_blocks)}' in text


def test_a_prefix_hit_in_the_step_that_computes_it_goes_to_disk_only_once_computed(reference, tmp_path):
    """Sessions 0-2 in one batch: 1 and 2 hit the shared prompt's blocks in the step that computes them, whose
    copies (at its start) would read them unwritten; session 3, alone after them, hits them computed."""
    def first_engine(**engine_args: Any) -> list[Output]:
        with LLM("dummy:tiny", **ENGINE, **engine_args) as llm:
            batch = llm.generate([prompt(s, 0) for s in range(3)], GREEDY, use_tqdm=False)
            alone = llm.generate([prompt(3, 0)], GREEDY, use_tqdm=False)
            return [output(o.outputs[0]) for o in [*batch, *alone]]

    assert close(first_engine(kv_offload_dir=str(tmp_path)), first_engine(enable_prefix_caching=False))
    again, hits, _, _ = run([1], kv_offload_dir=str(tmp_path))
    assert close(again, reference[8:]) and hits[0] >= 6 * BLOCK  # the shared prompt, from disk, computed


def test_the_cpu_tiers_evictions_go_to_disk_behind_it(reference, tmp_path):
    """A CPU tier of 12 slots in front (16 blocks leave the pool in the first turn): the blocks it drops move
    down to disk, and lookups continue there."""
    cpu_gib = 12.5 * 8192 / GiB  # dummy:tiny: 8 KiB a block (2 layers of [2, 16, 2 heads, 32] float32)
    outs, hits, stats, _ = run([0, 1], kv_offload_cpu_gib=cpu_gib, kv_offload_dir=str(tmp_path),
                               async_scheduling=True)
    assert close(outs, reference)
    assert stats.tier_held_by_tier == {"cpu": 12, "disk": len(block_files(tmp_path))}
    assert stats.tier_hits_by_tier["cpu"] > 0 and stats.tier_hits_by_tier["disk"] > 0
    assert stats.tier_hits == sum(hits) == stats.tier_hits_by_tier["cpu"] + stats.tier_hits_by_tier["disk"]
    again, hits, stats, _ = run([1], kv_offload_cpu_gib=cpu_gib, kv_offload_dir=str(tmp_path))  # restarted
    assert close(again, reference[8:]) and hits[0] == 10 * BLOCK and stats.tier_hits_by_tier["cpu"] < stats.tier_hits


def test_a_file_killed_mid_write_torn_truncated_or_corrupt_is_never_loaded(reference, tmp_path):
    run([0], kv_offload_dir=str(tmp_path))
    files = {p.name: p for p in block_files(tmp_path)}
    # sessions 0-2's blocks are all on disk (the pool reused them), the later ones' not: the GPU held them
    own = [files[block_name(hashes(prompt(s, 1))[6])] for s in range(3)]  # each one's first block of its own
    own[0].write_bytes(own[0].read_bytes()[:-100])  # truncated
    data = bytearray(own[1].read_bytes())
    data[-1] ^= 0xFF  # a payload byte flipped: the checksum fails
    own[1].write_bytes(bytes(data))
    own[2].rename(own[2].with_name(own[2].name + ".tmp"))  # killed before the rename: only the temporary file
    torn = files[block_name(hashes(prompt(2, 1))[7])]
    torn.write_bytes(b"KVFB" + bytes(200))  # torn in its header
    stray = own[0].with_name("0123456789abcdef.kv.tmp")
    stray.write_bytes(b"half a block")
    again, hits, stats, _ = run([1], kv_offload_dir=str(tmp_path))
    assert close(again, reference[8:])
    # undamaged, sessions 0-2 load 10, 4 and 4 blocks from disk (the first test); here session 0 loads the
    # shared prompt and stops at its damaged block, 1 and 2 find the prompt on the GPU and stop at theirs
    assert hits == [6 * BLOCK] + [0] * 7 and stats.tier_hits == 6 * BLOCK
    # the damaged files went (the corrupt one once its read failed); a block computed again was saved anew
    for path in block_files(tmp_path):
        read_block(path, hash_of(path.name), BLOCK)  # raises for a damaged one
    assert not stray.exists() and not list(tmp_path.glob("*/rank0/*.tmp"))  # temporary files go at start


def test_the_byte_bound_holds_and_a_restart_with_a_smaller_one_keeps_the_newest(reference, tmp_path):
    per_file = 8192 + header_size(BLOCK)
    sizes = []

    def measure() -> None:  # (the writes run behind the steps: a deletion goes before the writes of its step)
        sizes.append(sum(f.stat().st_size for f in tmp_path.glob("*/rank0/*")))

    outs, _, stats, _ = run([0, 1], measure, kv_offload_dir=str(tmp_path), kv_offload_disk_gib=12.5 * per_file / GiB)
    assert close(outs, reference) and stats.tier_slots == 12 and stats.tier_stored_blocks > 12  # some went
    files = block_files(tmp_path)
    assert len(files) == stats.tier_held_blocks == 12
    assert max(sizes) <= 12 * per_file == sum(f.stat().st_size for f in files)  # (the bound: 12.5 files)
    newest = {p.name for p in sorted(files, key=lambda p: (p.stat().st_mtime_ns, p.name))[-4:]}
    llm = LLM("dummy:tiny", **ENGINE, kv_offload_dir=str(tmp_path), kv_offload_disk_gib=4.5 * per_file / GiB)
    try:
        assert llm.llm_engine.kv_cache.stats().tier_held_blocks == 4
        assert {p.name for p in block_files(tmp_path)} == newest  # the least recently used went at start
    finally:
        llm.shutdown()


def test_a_load_waits_for_its_read_ahead_and_a_bad_file_drops_the_block(tmp_path, monkeypatch):
    ranks = [tmp_path / "rank0", tmp_path / "rank1"]
    payload = memoryview(bytes(range(256)) * 4)
    for h, tokens in ((11, (1,) * BLOCK), (12, (2,) * BLOCK)):
        for d in ranks:
            d.mkdir(exist_ok=True)
            write_block(d / block_name(h), pack_header(h, tokens, 1, "torch.float32", (2, 512), payload), payload)
    (ranks[1] / block_name(12)).write_bytes((ranks[1] / block_name(12)).read_bytes()[:-1] + b"?")  # one rank's is bad
    index = DiskIndex(8, root=tmp_path, world_size=2, block_size=BLOCK)
    try:
        assert set(index.held) == {11, 12} and index.contains(11, (1,) * BLOCK) and not index.contains(11, (2,) * BLOCK)
        assert not index.ready(11) and not index.ready(12)  # read ahead first: the request waits a step
        assert wait_for(lambda: index.ready(11))
        assert wait_for(lambda: not index.ready(12) and 12 not in index.held)  # one rank's file failed its check
        assert index.forgotten == [(12, 12)]  # the chain has the ranks delete what is left of it
        key, _ = index.put(13, (3,) * BLOCK, keep=())  # put moments ago, its files not written yet
        assert not index.ready(13) and not wait_for(lambda: index.ready(13), timeout=0.3) and 13 in index.held
        monkeypatch.setattr(disk_index, "WRITE_WAIT_S", 0.3)  # its write never comes: given up
        assert wait_for(lambda: not index.ready(13) and 13 not in index.held) and index.forgotten[-1] == (13, 13)
        with pytest.raises(ValueError, match="kv_offload_dir='d'.*in use by another engine"):
            DiskIndex(8, root=tmp_path, world_size=2, block_size=BLOCK, option="d")
    finally:
        index.close()
    with pytest.raises(BadBlockFile, match="another block"):
        read_block(ranks[0] / block_name(11), 12, BLOCK)


def wait_for(check, timeout: float = 5.0) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.01)
    return False


def test_bad_disk_options_are_refused_naming_the_field(tmp_path):
    with pytest.raises(ValueError, match="kv_offload_disk_gib must be a number of GiB > 0, got 0"):
        LLM("dummy:tiny", device="cpu", kv_offload_dir=str(tmp_path), kv_offload_disk_gib=0)
    with pytest.raises(ValueError, match="kv_offload_dir must be a directory's path or None, got ''"):
        LLM("dummy:tiny", device="cpu", kv_offload_dir="")
    with pytest.raises(ValueError, match="needs kv_offload_dir"):
        LLM("dummy:tiny", **ENGINE, kv_connector="disk")
    llm = LLM("dummy:tiny", **ENGINE, kv_offload_dir=str(tmp_path))
    try:  # one engine a directory: a second one (a data-parallel replica given the same) is refused
        with pytest.raises(ValueError, match=f"kv_offload_dir={str(tmp_path)!r}.*in use by another engine"):
            LLM("dummy:tiny", **ENGINE, kv_offload_dir=str(tmp_path))
    finally:
        llm.shutdown()


def test_each_rank_keeps_its_own_files_and_a_restart_finds_them_all(reference, tmp_path):
    """tensor_parallel_size=2 (the ``mp`` executor: the second rank writes its files in its own process)."""
    tp2 = dict(tensor_parallel_size=2, kv_offload_dir=str(tmp_path))
    first, _, _, _ = run([0], **tp2)
    ranks = [{p.name for p in tmp_path.glob(f"*/rank{r}/*.kv")} for r in (0, 1)]
    assert close(first, reference[:8]) and ranks[0] == ranks[1] and len(ranks[0]) > 10
    again, hits, stats, _ = run([1], **tp2)
    assert close(again, reference[8:]) and hits[0] == 10 * BLOCK and stats.tier_hits == sum(hits)


@pytest.mark.gpu
def test_on_cuda_the_asynchronous_copies_keep_the_tokens(tmp_path):
    """On the GPU every copy is asynchronous (pinned host buffers, async scheduling, the writer thread waiting
    for the step's copies): behind a CPU tier and across a restart, the tokens of a run without prefix caching
    (float32: batching changes no greedy token)."""
    cuda = dict(device="cuda", dtype="float32", attention_backend="torch")
    reference = run([0, 1], enable_prefix_caching=False, **cuda)[0]
    tiers = dict(kv_offload_cpu_gib=12.5 * 8192 / GiB, kv_offload_dir=str(tmp_path), **cuda)
    outs, _, stats, _ = run([0, 1], **tiers)
    assert close(outs, reference, 1e-3) and stats.tier_hits_by_tier["cpu"] > 0 and stats.tier_hits_by_tier["disk"] > 0
    again, hits, _, _ = run([1], **tiers)
    assert close(again, reference[8:], 1e-3) and hits[0] == 10 * BLOCK
