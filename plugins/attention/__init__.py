"""Built-in attention backends. Names map to lazy import paths so discovery imports no CUDA code."""
from kvforge.hookspecs import hookimpl


@hookimpl
def register_attention_backends(register):
    register("torch", "kvforge.plugins.attention.torch_backend:TorchAttentionBackend")
