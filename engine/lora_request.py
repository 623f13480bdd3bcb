"""A request's LoRA adapter (vLLM's LoRARequest)."""

from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, frozen=True, array_like=True):
    """The adapter a request runs with: PEFT's folder at `lora_path`, known to the engine as
    `lora_int_id` (>= 1; one id, one adapter) and to clients as `lora_name`."""

    lora_name: str
    lora_int_id: int
    lora_path: str
