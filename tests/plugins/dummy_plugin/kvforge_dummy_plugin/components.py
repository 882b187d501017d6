"""Components that do what the built-ins do and count their calls, so tests can see them used."""
from dataclasses import dataclass

from kvforge.plugins.attention.torch_backend import TorchAttentionBackend
from kvforge.plugins.scheduling.fcfs import FCFSScheduler


class CountingAttention(TorchAttentionBackend):
    name = "dummy_attn"
    forward_calls = 0

    def forward(self, q, k, v, kv_cache, meta):
        type(self).forward_calls += 1
        return super().forward(q, k, v, kv_cache, meta)


@dataclass
class CountingOptions:
    label: str = "none"


class CountingScheduler(FCFSScheduler):
    name = "dummy_sched"
    Options = CountingOptions
    schedule_calls = 0
    last_label = None

    def __init__(self, *, label: str = "none", **kwargs):
        super().__init__(**kwargs)
        type(self).last_label = label

    def schedule(self):
        type(self).schedule_calls += 1
        return super().schedule()
