"""``WorkerSpec``: everything a rank needs to build its ``Worker`` (``kvforge.rank.worker``).

Executors send it to every rank (pickled to spawned processes and Ray actors); it is its own module so
that what carries it (the executor contract, the rank messages) need not import the worker's model code.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvforge.config import EngineConfig
from kvforge.model.config import ModelConfig
from kvforge.model.loader import ModelSource


@dataclass
class WorkerSpec:
    """Everything a rank needs to build its worker (picklable: sent to spawned processes and actors)."""

    config: EngineConfig
    source: ModelSource
    model_config: ModelConfig
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    init_method: str | None = None  # torch.distributed rendezvous (tcp://host:port) when the world is > 1
    init_timeout_s: float = 120.0  # collectives and the rendezvous give up after this long

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def driver_rank(self) -> int:
        """The first tensor-parallel rank of the last pipeline stage: it runs in the engine process."""
        return (self.pipeline_parallel_size - 1) * self.tensor_parallel_size

    def device_for(self, local_rank: int) -> torch.device:
        """CUDA: the engine's device index plus the rank's place on its node; CPU: the CPU."""
        base = self.config.torch_device
        if base.type != "cuda":
            return base
        return torch.device("cuda", (base.index or 0) + local_rank)
