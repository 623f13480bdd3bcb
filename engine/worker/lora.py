"""LoRA adapters in PEFT's format (engine/lora_adapter.py), many served at once over one
base model: a row x of an adapted request gets `x @ A.T @ B.T * scaling` added to a target
product's output. The base weights are never changed, so rows of different adapters and of
the base run in one step.

`LoRAManager` replaces each target product by a `LoRALinear` holding `max_loras` slots of
stacked, zero-padded A and B (scaling folded into B), filled as adapters become active; it
loads and checks adapters (a CPU cache of `max_cpu_loras`), gives each adapter of a step a
slot, and hands the layers each token's slot (`LoRABatch`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch
from safetensors.torch import load_file
from torch import nn

from octavo.engine.config import EngineConfig
from octavo.engine.errors import ParameterError
from octavo.engine.lora_adapter import ADAPTER_WEIGHTS, TARGETS, read_adapter, target_shape
from octavo.engine.lora_request import LoRARequest
from octavo.engine.worker.models.configs import GPT2Config
from octavo.engine.worker.models.gpt2 import GPT2LMHeadModel
from octavo.kernels import cpu_ops
from octavo.kernels import lora as triton_lora

AddLoRA = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
# The CPU operator reads the factors' ranks sixteen at a time (one AVX-512 register).
RANK_MULTIPLE = 16


@dataclass
class LoRAAdapter:
    """A loaded adapter: per adapted module ("h.{layer}.{target}"), A [rank, in] and
    B [out, rank] with the scaling folded in."""

    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


def load_adapter(request: LoRARequest, config: GPT2Config, max_rank: int) -> LoRAAdapter:
    """The adapter's factors, after lora_adapter.read_adapter's checks (ParameterError
    naming lora_path, as for a weights file its header did not show broken)."""
    spec = read_adapter(request.lora_name, request.lora_path, config, max_rank)
    try:
        tensors = load_file(spec.path / ADAPTER_WEIGHTS)
    except Exception as exc:  # noqa: BLE001 -- safetensors' own error type: a broken file
        raise ParameterError(
            "lora_path", f"LoRA adapter {request.lora_name!r}: {ADAPTER_WEIGHTS}: {exc}"
        ) from exc
    weights = {
        module: (tensors[a].float(), tensors[b].float() * spec.scaling)
        for module, (a, b) in spec.modules.items()
    }
    return LoRAAdapter(weights)


def add_lora_ref(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
) -> None:
    """cpu_ops.add_lora_ in torch: out[t] += (x[t] @ lora_a[s]) @ lora_b[s] for s =
    token_slots[t] >= 0, one slot's rows at a time."""
    for slot in token_slots.unique().tolist():
        if slot >= 0:
            rows = (token_slots == slot).nonzero().squeeze(1)
            out.index_add_(0, rows, x[rows] @ lora_a[slot] @ lora_b[slot])


@dataclass
class LoRABatch:
    """A step's adapters, shared by every LoRALinear (set by `LoRAManager.prepare`):
    `token_slots` [T], each token's adapter slot (-1: the base), or None when no token of
    the step has an adapter."""

    token_slots: torch.Tensor | None = None


class LoRALinear(nn.Module):
    """A product with `max_loras` adapter slots beside it: base(x), plus for each row of an
    adapter's slot x @ A[slot] @ B[slot] (`add_lora`: cpu_ops.add_lora_, kernels/lora.py's
    on a GPU, or their torch twin).
    A and B are kept transposed ([slots, in, rank], [slots, rank, out]), rank padded with
    zeros to `padded_rank`, as the CPU operator reads them."""

    def __init__(
        self, base: nn.Module, in_features: int, out_features: int, max_loras: int,
        padded_rank: int, batch: LoRABatch, add_lora: AddLoRA, dtype: torch.dtype,
        device: torch.device,
    ):  # fmt: skip
        super().__init__()
        self.base = base
        self.batch = batch
        self.add_lora = add_lora
        # Plain tensors, not buffers: no state dict holds them.
        self.lora_a = torch.zeros((max_loras, in_features, padded_rank), dtype=dtype, device=device)
        self.lora_b = self.lora_a.new_zeros((max_loras, padded_rank, out_features))

    def set_slot(self, slot: int, factors: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Fills `slot` with (A [rank, in], B [out, rank]) zero-padded, or zeros."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        if factors is not None:
            a, b = factors
            rank = a.shape[0]
            self.lora_a[slot, :, :rank].copy_(a.t())
            self.lora_b[slot, :rank].copy_(b.t())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        if self.batch.token_slots is not None:
            self.add_lora(out, x, self.lora_a, self.lora_b, self.batch.token_slots)
        return out


class LoRAManager:
    """The adapters an engine serves: their checked weights (the `max_cpu_loras` most
    recently used kept loaded; others reloaded from their folder when needed), and
    `max_loras` slots in the model's target layers.

    `add` checks an adapter when a request brings it (ParameterError naming lora_path);
    `prepare` gives the step's adapters slots (a step never has more than max_loras: the
    scheduler admits no more) and tells the layers which rows are whose.
    """

    def __init__(self, model: GPT2LMHeadModel, engine_config: EngineConfig):
        self.config = config = model.config
        self.max_rank = engine_config.max_lora_rank
        self.max_cpu_loras = engine_config.max_cpu_loras or engine_config.max_loras
        dtype, device = engine_config.torch_dtype, engine_config.torch_device
        self.batch = LoRABatch()
        padded_rank = -(-self.max_rank // RANK_MULTIPLE) * RANK_MULTIPLE
        add_lora: AddLoRA = add_lora_ref  # a CPU that cannot build its operators
        if device.type == "cuda":
            add_lora = triton_lora.add_lora
        elif cpu_ops.load():
            add_lora = cpu_ops.add_lora_
        self.layers: dict[str, LoRALinear] = {}
        for layer, block in enumerate(cast(nn.ModuleList, model.h)):
            for target in TARGETS:
                owner_name, product = target.split(".")
                owner = getattr(block, owner_name)
                in_features, out_features = target_shape(config, target)
                wrapped = LoRALinear(
                    getattr(owner, product), in_features, out_features, engine_config.max_loras,
                    padded_rank, self.batch, add_lora, dtype, device,
                )  # fmt: skip
                setattr(owner, product, wrapped)
                self.layers[f"h.{layer}.{target}"] = wrapped
        self._requests: dict[int, LoRARequest] = {}
        self._loaded: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self._slot_ids: list[int | None] = [None] * engine_config.max_loras
        self._slot_of: dict[int, int] = {}

    def add(self, request: LoRARequest) -> None:
        """Checks and loads `request`'s adapter. An id names one adapter for the engine's
        life (the prefix cache keys K/V by it): the same id with another name or path is a
        ParameterError naming lora_request."""
        known = self._requests.get(request.lora_int_id)
        if known is not None and known != request:
            raise ParameterError(
                "lora_request",
                f"lora_int_id {request.lora_int_id} is adapter {known.lora_name!r} at "
                f"{known.lora_path!r}; another adapter needs another id",
            )
        if request.lora_int_id in self._loaded:
            self._loaded.move_to_end(request.lora_int_id)
            return
        self._load(request)
        self._requests[request.lora_int_id] = request

    def _load(self, request: LoRARequest) -> LoRAAdapter:
        """Loads an adapter not in the CPU cache into it, most recently used, dropping the
        least recently used beyond max_cpu_loras."""
        adapter = load_adapter(request, self.config, self.max_rank)
        self._loaded[request.lora_int_id] = adapter
        while len(self._loaded) > self.max_cpu_loras:
            self._loaded.popitem(last=False)
        return adapter

    def prepare(self, token_lora_ids: np.ndarray | None, device: torch.device) -> None:
        """The step's `LoRABatch` from each token's adapter id (0: the base)."""
        self.batch.token_slots = None
        if token_lora_ids is None:
            return
        ids = np.unique(token_lora_ids)
        ids = ids[ids != 0]
        if not len(ids):
            return
        token_slots = np.full(len(token_lora_ids), -1, dtype=np.int64)
        for lora_int_id, slot in zip(ids, self._slots_for([int(i) for i in ids]), strict=True):
            token_slots[token_lora_ids == lora_int_id] = slot
        self.batch.token_slots = torch.from_numpy(token_slots).to(device)

    def _slots_for(self, ids: list[int]) -> list[int]:
        """A slot for each adapter of the step (at most max_loras), loading those that have
        none into slots no adapter of the step holds."""
        needed = [i for i in ids if i not in self._slot_of]
        if needed:
            free = [s for s, held in enumerate(self._slot_ids) if held is None or held not in ids]
            assert len(free) >= len(needed), "more adapters in a step than max_loras"
            for lora_int_id, slot in zip(needed, free, strict=False):
                held = self._slot_ids[slot]
                if held is not None:
                    del self._slot_of[held]
                adapter = self._loaded.get(lora_int_id)
                if adapter is None:  # fallen out of the CPU cache: read again
                    adapter = self._load(self._requests[lora_int_id])
                for module, layer in self.layers.items():
                    layer.set_slot(slot, adapter.weights.get(module))
                self._slot_ids[slot] = lora_int_id
                self._slot_of[lora_int_id] = slot
        return [self._slot_of[i] for i in ids]
