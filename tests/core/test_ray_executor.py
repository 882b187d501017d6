"""The ``ray`` executor on a real local Ray cluster of two "nodes" (``ray.cluster_utils.Cluster``, one
CPU each, so the two ranks must land on different nodes): the default model with two ranks gives the
tokens of one rank; with a cluster running, ``ray`` is the default backend."""
from __future__ import annotations

import pytest

from kvforge import LLM, SamplingParams

ray = pytest.importorskip("ray")

ENGINE = dict(device="cpu", max_model_len=256, num_gpu_blocks_override=32, enable_prefix_caching=True)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Hello, my name is", "1, 2, 3, 4, 5,",
           "The quick brown fox", "Once upon a time, in a small village by the sea,",
           "Water boils at", "The best way to learn a language is"]


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    c.add_node(num_cpus=1)
    ray.init(address=c.address, include_dashboard=False, logging_level="ERROR")
    yield c
    ray.shutdown()
    c.shutdown()


def test_ray_tp2_on_two_nodes_equals_one_rank(cluster):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in LLM(**ENGINE).generate(PROMPTS, params, use_tqdm=False)]
    llm = LLM(tensor_parallel_size=2, **ENGINE)  # a running Ray cluster makes "ray" the default
    try:
        executor = llm.llm_engine.executor
        assert executor.name == "ray"
        # one bundle per node (one CPU each); rank 1's actor runs on its bundle's node. (The driver's
        # bundle is pinned by node IP, which both simulated nodes share, so it may be either node.)
        bundles = ray.util.placement_group_table(executor.pg)["bundles_to_node_id"]
        assert len(set(bundles.values())) == 2 and executor.node_ids[1] == bundles[1]
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        assert got == ref
        assert executor.collective_rpc("batch_state") == [{"requests": 0, "blocks": 0}] * 2
    finally:
        llm.shutdown()
    assert not executor.actors or all(_dead(a) for a in executor.actors.values())


def _dead(actor) -> bool:
    try:
        ray.get(actor.ping.remote(), timeout=10)
    except Exception:
        return True
    return False


def test_ray_cluster_too_small_says_so(cluster):
    from kvforge.rank.executor import WorkerFailure

    # 9 query heads over 3 KV heads split over 3 ranks; the cluster has 2 CPUs
    with pytest.raises(WorkerFailure, match="cannot be placed: the Ray cluster has no room for 3 bundles of one "
                                            r"CPU \(it has 2 CPU in all"):
        LLM(tensor_parallel_size=3, distributed_executor_backend="ray", **ENGINE)
