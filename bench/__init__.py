"""``kvforge bench``: throughput, latency and serving benchmarks, with vLLM and transformers as peers.

Modules: ``workloads`` (seeded random-token requests), ``metrics`` (percentiles, roofline),
``ceilings`` (the roofline's ceilings for the GPU in use: a table, or measured), ``report`` (table, JSON,
plot), ``peers`` (transformers ``generate`` and continuous batching), ``vllm_peer`` and ``vllm_worker``
(vLLM in a subprocess of its own), ``throughput``, ``latency`` and ``serve`` (one per subcommand; serve's
``servers``, ``sweep`` (rates x concurrencies x runs, medians and spreads) and ``vllm_client``
(``vllm bench serve`` as a second client)) and ``cli`` (the argparse entry point, registered in the
``kvforge.cli`` group). docs/benchmarks.md describes the commands and columns.
"""

#: ``--dataset`` choices (kvforge.bench.workloads) and ``--vs`` choices (kvforge.bench.peers); here so
#: that building the ``kvforge`` parser imports no torch
DATASETS = ("fixed", "uniform", "shared-prefix", "edit")
PEERS = ("hf-generate", "hf-continuous", "vllm")
