"""``LoRARequest``: which adapter a request runs under (vLLM's type and field names)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter, named by the user and identified by a positive integer.

    lora_name: the name clients use (over HTTP, the request's ``model``).
    lora_int_id: a positive id, unique per adapter in one engine; it keys the device slots, the host
        cache and the prefix-cache hashes (two adapters never share KV blocks).
    lora_path: a PEFT directory (``adapter_config.json`` + ``adapter_model.safetensors``).
    base_model_name: the served model it belongs to (``/v1/models`` lists it as ``parent``).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_request.lora_name: a non-empty string is required, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_request.lora_int_id: a positive integer is required, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_request.lora_path: a PEFT adapter directory is required, got {self.lora_path!r}")

    # vLLM's older spellings, which user code still reads
    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path
