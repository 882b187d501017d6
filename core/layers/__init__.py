"""Model layers that own their weights: each parameter carries a ``weight_loader`` that knows which
part of a checkpoint tensor this rank keeps, so model files compose layers and never branch on
tensor parallelism, quantization (``kvforge.model.quantization``: packed and grouped layouts through
``LinearBase.make_param``; docs/quantization.md) and later LoRA themselves (docs/distributed.md#layers)."""
from kvforge.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from kvforge.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from kvforge.layers.weights import default_weight_loader, load_full

__all__ = ["ColumnParallelLinear", "MergedColumnParallelLinear", "QKVParallelLinear", "RowParallelLinear",
           "VocabParallelEmbedding", "ParallelLMHead", "default_weight_loader", "load_full"]
