"""LoRA adapters: many fine-tunes of one base model served together in one batch (docs/lora.md).

``request`` names an adapter (``LoRARequest``); ``adapter`` reads a PEFT directory; ``layers`` wraps the
model's linear layers; ``slots`` keeps adapters resident on the device (least recently used go back to
host memory); ``ops`` is the batched matmul (rows grouped by adapter; its Triton kernels are
``kvforge.kernels.lora``).
"""
