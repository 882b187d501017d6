"""``cpu``: prefix-cached KV blocks kept in pinned host memory, ``kv_offload_cpu_gib`` per rank
(``--kv-offload-cpu-gib``); the first tier of the chain, before ``disk``."""
from __future__ import annotations

from kvforge.attention import AttentionBackend
from kvforge.kv_connector import KVConnector
from kvforge.rank.swap import CPUSwapSpace

GiB = 1 << 30


class CPUConnector(KVConnector):
    name = "cpu"
    medium = "CPU"

    def slots(self, bytes_per_block: int) -> int:
        return int(self.config.kv_offload_cpu_gib * GiB) // bytes_per_block

    def store(self, attn: AttentionBackend, num_layers: int, slots: int, rank: int) -> CPUSwapSpace:
        return CPUSwapSpace(attn, num_layers, slots)  # pinned on CUDA, allocated on first use
