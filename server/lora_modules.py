"""The LoRA adapters a server serves by name (vLLM's --lora-modules and runtime loading): a
request picks one by `model`, /v1/models lists each with the base as its `parent`."""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass
from http import HTTPStatus

from octavo.engine.errors import ParameterError
from octavo.engine.lora_adapter import read_adapter
from octavo.engine.lora_request import LoRARequest
from octavo.engine.worker.models.configs import GPT2Config
from octavo.server.errors import APIError, bad_request, model_not_found


@dataclass(frozen=True)
class LoRAModulePath:
    """One --lora-modules entry: `name=path`, or JSON {"name", "path", "base_model_name"}."""

    name: str
    path: str
    base_model_name: str | None = None

    @classmethod
    def parse(cls, value: str) -> LoRAModulePath:
        """ValueError naming --lora-modules for a value of neither form."""
        if value.lstrip().startswith("{"):
            try:
                fields = json.loads(value)
                return cls(fields["name"], fields["path"], fields.get("base_model_name"))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(
                    f"--lora-modules {value!r}: JSON needs name and path ({exc})"
                ) from None
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {value!r}: expected NAME=PATH or JSON")
        return cls(name, path)


@dataclass(frozen=True)
class LoRAModule:
    request: LoRARequest
    created: int


class LoRAModules:
    """Adapters by name, each checked against the base when it is added (its folder,
    settings and factor shapes: engine/lora_adapter.py) and given the next id. The names
    are the server's: one API process's runtime loads are its own."""

    def __init__(self, base_name: str, config: GPT2Config, max_rank: int):
        self.base_name = base_name
        self.config = config
        self.max_rank = max_rank
        self._modules: dict[str, LoRAModule] = {}
        self._ids = itertools.count(1)

    def add(self, name: str, path: str) -> LoRARequest:
        """Registers an adapter; APIError (400) naming lora_name (taken) or lora_path (an
        adapter the engine cannot serve)."""
        if name == self.base_name or name in self._modules:
            raise bad_request(f"the model name {name!r} is already served", param="lora_name")
        try:
            read_adapter(name, path, self.config, self.max_rank)
        except ParameterError as exc:
            raise bad_request(str(exc), param=exc.param) from exc
        request = LoRARequest(name, next(self._ids), path)
        self._modules[name] = LoRAModule(request, int(time.time()))
        return request

    def remove(self, name: str) -> None:
        """Stops serving an adapter (requests already running finish); 404 if unknown."""
        if self._modules.pop(name, None) is None:
            raise APIError(
                HTTPStatus.NOT_FOUND,
                f"the LoRA adapter {name!r} is not loaded",
                param="lora_name",
                code="model_not_found",
            )

    def resolve(self, model: str) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base); 404 if neither."""
        if model == self.base_name:
            return None
        module = self._modules.get(model)
        if module is None:
            raise model_not_found(model)
        return module.request

    def modules(self) -> list[LoRAModule]:
        return list(self._modules.values())

    def names(self) -> dict[int, str]:
        """The served adapters' names by id (what /metrics labels them with)."""
        return {m.request.lora_int_id: m.request.lora_name for m in self._modules.values()}
