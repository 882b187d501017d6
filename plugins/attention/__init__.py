"""Built-in attention backends. Names map to lazy import paths so discovery imports no CUDA code."""
from kvforge.hookspecs import hookimpl


@hookimpl
def register_attention_backends(register):
    register("torch", "kvforge.plugins.attention.torch_backend:TorchAttentionBackend")
    register("triton", "kvforge.plugins.attention.triton_backend:TritonAttentionBackend")
    register("flashinfer", "kvforge.plugins.attention.flashinfer_backend:FlashInferAttentionBackend")
    register("flash_attn", "kvforge.plugins.attention.flash_attn_backend:FlashAttnBackend")
