"""LoRA adapters in PEFT's format (engine/lora_adapter.py), many served at once over one
base model: a row x of an adapted request gets `x @ A.T @ B.T * scaling` added to a target
product's output. The base weights are never changed, so rows of different adapters and of
the base run in one step.

`LoRALayers` replaces each target product by a `LoRALinear` holding `max_loras` slots of
stacked, zero-padded A and B (scaling folded into B), filled as adapters become active;
`LoRAManager` loads and checks adapters (a CPU cache of `max_cpu_loras`), gives each
adapter of a step a slot, and hands the layers the step's rows per slot (`LoRABatch`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch
from safetensors.torch import load_file
from torch import nn

from octavo.engine.errors import ParameterError
from octavo.engine.lora_adapter import ADAPTER_WEIGHTS, TARGETS, read_adapter, target_shape
from octavo.engine.lora_request import LoRARequest
from octavo.engine.worker.models.configs import GPT2Config
from octavo.engine.worker.models.gpt2 import GPT2LMHeadModel


@dataclass
class LoRAAdapter:
    """A loaded adapter: per adapted module ("h.{layer}.{target}"), A [rank, in] and
    B [out, rank] with the scaling folded in."""

    lora_int_id: int
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
    return LoRAAdapter(request.lora_int_id, weights)


@dataclass
class LoRABatch:
    """A step's rows by adapter slot, shared by every LoRALinear (set by `LoRAManager.prepare`):
    - `slot`: the one slot of a step whose every row has the same adapter;
    - or, for rows of several adapters (and maybe the base), G groups padded to the largest
      one's L rows: `slots` [G], `padded_rows` [G, L] (each group's rows, padded with row
      0), `valid` [V] (the real entries of the flattened G x L grid; None when no group is
      padded) and `rows` [V] (their rows), so that a product's adapters run as two batched
      products, not two per group;
    - neither: no adapter in the step."""

    slot: int | None = None
    slots: torch.Tensor | None = None
    leading_slots: bool = False  # slots are 0..G-1 in order
    padded_rows: torch.Tensor | None = None
    valid: torch.Tensor | None = None  # None: no group is padded
    rows: torch.Tensor | None = None

    def clear(self) -> None:
        self.slot = self.slots = self.padded_rows = self.valid = self.rows = None
        self.leading_slots = False


class LoRALinear(nn.Module):
    """A product with `max_loras` adapter slots beside it: base(x), plus for the rows of
    each slot of the step x @ A[slot].T @ B[slot].T (an empty slot is zeros). A and B are
    kept transposed ([slots, in, rank], [slots, rank, out]) for the batched products."""

    def __init__(
        self, base: nn.Module, in_features: int, out_features: int, max_loras: int,
        max_rank: int, batch: LoRABatch, dtype: torch.dtype, device: torch.device,
    ):  # fmt: skip
        super().__init__()
        self.base = base
        self.batch = batch
        # Plain tensors, not buffers: no state dict holds them.
        self.lora_a = torch.zeros((max_loras, in_features, max_rank), dtype=dtype, device=device)
        self.lora_b = torch.zeros((max_loras, max_rank, out_features), dtype=dtype, device=device)

    def set_slot(self, slot: int, factors: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Fills `slot` with (A [rank, in], B [out, rank]) zero-padded to max_rank, or zeros."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        if factors is not None:
            a, b = factors
            rank = a.shape[0]
            self.lora_a[slot, :, :rank].copy_(a.t())
            self.lora_b[slot, :rank].copy_(b.t())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        batch = self.batch
        if batch.slot is not None:
            return torch.addmm(out, x @ self.lora_a[batch.slot], self.lora_b[batch.slot])
        if batch.slots is None:
            return out
        assert batch.padded_rows is not None and batch.rows is not None
        groups, length = batch.padded_rows.shape
        if batch.leading_slots:  # slots 0..G-1 in order: views, no copies
            lora_a, lora_b = self.lora_a[:groups], self.lora_b[:groups]
        else:
            lora_a = self.lora_a.index_select(0, batch.slots)
            lora_b = self.lora_b.index_select(0, batch.slots)
        grown = torch.bmm(torch.bmm(x[batch.padded_rows], lora_a), lora_b)
        grown = grown.view(groups * length, -1)
        if batch.valid is not None:  # some groups padded
            grown = grown.index_select(0, batch.valid)
        return out.index_add_(0, batch.rows, grown)


class LoRAManager:
    """The adapters an engine serves: their checked weights (the `max_cpu_loras` most
    recently used kept loaded; others reloaded from their folder when needed), and
    `max_loras` slots in the model's target layers.

    `add` checks an adapter when a request brings it (ParameterError naming lora_path);
    `prepare` gives the step's adapters slots (a step never has more than max_loras: the
    scheduler admits no more) and tells the layers which rows are whose.
    """

    def __init__(
        self, model: GPT2LMHeadModel, config: GPT2Config, max_loras: int, max_rank: int,
        max_cpu_loras: int, dtype: torch.dtype, device: torch.device,
    ):  # fmt: skip
        self.config = config
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.max_cpu_loras = max_cpu_loras
        self.batch = LoRABatch()
        self.layers: dict[str, LoRALinear] = {}
        for layer, block in enumerate(cast(nn.ModuleList, model.h)):
            for target in TARGETS:
                owner_name, product = target.split(".")
                owner = getattr(block, owner_name)
                in_features, out_features = target_shape(config, target)
                wrapped = LoRALinear(
                    getattr(owner, product), in_features, out_features, max_loras, max_rank,
                    self.batch, dtype, device,
                )  # fmt: skip
                setattr(owner, product, wrapped)
                self.layers[f"h.{layer}.{target}"] = wrapped
        self._requests: dict[int, LoRARequest] = {}
        self._loaded: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self._slot_ids: list[int | None] = [None] * max_loras
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
        adapter = load_adapter(request, self.config, self.max_rank)
        self._requests[request.lora_int_id] = request
        self._keep(adapter)

    def _keep(self, adapter: LoRAAdapter) -> None:
        self._loaded[adapter.lora_int_id] = adapter
        self._loaded.move_to_end(adapter.lora_int_id)
        while len(self._loaded) > self.max_cpu_loras:
            self._loaded.popitem(last=False)

    def prepare(self, token_lora_ids: np.ndarray | None, device: torch.device) -> None:
        """The step's `LoRABatch` from each token's adapter id (0: the base)."""
        batch = self.batch
        batch.clear()
        if token_lora_ids is None:
            return
        ids = np.unique(token_lora_ids)
        ids = ids[ids != 0]
        if not len(ids):
            return
        slots = self._slots_for([int(i) for i in ids])
        if len(ids) == 1 and (token_lora_ids == ids[0]).all():
            batch.slot = slots[0]
            return
        members = [np.flatnonzero(token_lora_ids == lora_int_id) for lora_int_id in ids]
        length = max(len(rows) for rows in members)
        padded = np.zeros((len(ids), length), dtype=np.int64)
        valid = []
        for group, rows in enumerate(members):
            padded[group, : len(rows)] = rows
            valid.append(np.arange(group * length, group * length + len(rows)))
        batch.slots = torch.tensor(slots, dtype=torch.long, device=device)
        batch.leading_slots = slots == list(range(len(slots)))
        batch.padded_rows = torch.from_numpy(padded).to(device)
        if any(len(rows) < length for rows in members):
            batch.valid = torch.from_numpy(np.concatenate(valid)).to(device)
        batch.rows = torch.from_numpy(np.concatenate(members)).to(device)

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
                    adapter = load_adapter(self._requests[lora_int_id], self.config, self.max_rank)
                    self._keep(adapter)
                for module, layer in self.layers.items():
                    layer.set_slot(slot, adapter.weights.get(module))
                self._slot_ids[slot] = lora_int_id
                self._slot_of[lora_int_id] = slot
        return [self._slot_of[i] for i in ids]
