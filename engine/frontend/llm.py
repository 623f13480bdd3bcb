"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`, vLLM style."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from collections.abc import Sequence as SequenceABC
from dataclasses import replace
from typing import Any

from tqdm.auto import tqdm

from octavo.engine.config import EngineConfig
from octavo.engine.frontend.llm_engine import LLMEngine
from octavo.engine.frontend.outputs import RequestOutput
from octavo.engine.lora_request import LoRARequest
from octavo.engine.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

PromptType = str | list[int]


class LLM:
    """Runs a GPT-2 over a batch of prompts with continuous batching; keyword names mirror
    EngineConfig. All prompts are validated before any runs: one bad prompt raises
    ValueError and nothing is queued."""

    def __init__(self, model: str, **engine_config: Any):
        """`engine_config`: any EngineConfig field by name (dtype, device, num_blocks,
        max_num_seqs, gpu_memory_utilization, ...); EngineConfig documents them all."""
        self.engine = LLMEngine(EngineConfig(model=model, **engine_config))
        self._request_ids = itertools.count()

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        """Wraps an engine built elsewhere (the CLI builds one from its flags)."""
        llm = cls.__new__(cls)
        llm.engine = engine
        llm._request_ids = itertools.count()
        return llm

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | SequenceABC[PromptType],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | SequenceABC[LoRARequest | None] | None = None,
        priority: SequenceABC[int] | None = None,
    ) -> list[RequestOutput]:
        """Generates for every prompt; returns one RequestOutput per prompt, in prompt order.
        `lora_request`: the LoRA adapter of every prompt, or one per prompt (None: the
        base model); needs enable_lora. `priority`: one per prompt (vLLM's; lower is
        served first), with scheduling_policy "priority"."""
        prompts = self._as_prompt_list(prompts)
        num_prompts = len(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * num_prompts
        if lora_request is None or isinstance(lora_request, LoRARequest):
            lora_request = [lora_request] * num_prompts
        params_list = _per_prompt("sampling_params", sampling_params, num_prompts)
        loras = _per_prompt("lora_request", lora_request, num_prompts)
        if priority is None:
            priority = [0] * num_prompts
        priorities = _per_prompt("priority", priority, num_prompts)
        final_only = [replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in params_list]
        return self._generate(prompts, final_only, loras, priorities, use_tqdm)

    def beam_search(
        self,
        prompts: PromptType | SequenceABC[PromptType],
        params: BeamSearchParams,
        use_tqdm: bool = True,
        lora_request: LoRARequest | None = None,
    ) -> list[RequestOutput]:
        """Beam search for every prompt (all in one continuous batch); each RequestOutput's
        outputs are its num_return_sequences best hypotheses, best first, with `score`.
        `lora_request`: the LoRA adapter every beam runs with (needs enable_lora)."""
        prompts = self._as_prompt_list(prompts)
        count = len(prompts)
        return self._generate(
            prompts, [params] * count, [lora_request] * count, [0] * count, use_tqdm
        )

    @staticmethod
    def _as_prompt_list(prompts) -> list[PromptType]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            return [prompts]
        return list(prompts)

    def _generate(
        self,
        prompts: list[PromptType],
        params_list: list,
        loras: list[LoRARequest | None],
        priorities: list[int],
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        """Adds every request, or none (a bad one aborts those already added and raises),
        then steps until all are finished; their final outputs in prompt order."""
        request_ids = [str(next(self._request_ids)) for _ in prompts]
        added: list[str] = []
        try:
            for request_id, prompt, params, lora, priority in zip(
                request_ids, prompts, params_list, loras, priorities, strict=True
            ):
                self.engine.add_request(
                    request_id, prompt, params, lora_request=lora, priority=priority
                )
                added.append(request_id)
        except ValueError:
            for request_id in added:
                self.engine.abort_request(request_id)
            raise
        finished: dict[str, RequestOutput] = {}
        with tqdm(
            total=len(request_ids),
            desc="Processed prompts",
            disable=not use_tqdm,
            dynamic_ncols=True,
        ) as bar:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
        return [finished[r] for r in request_ids]


def _per_prompt(name: str, values: Iterable, num_prompts: int) -> list:
    """`values` as a list, which must hold one entry per prompt (ValueError otherwise)."""
    values = list(values)
    if len(values) != num_prompts:
        raise ValueError(f"{name} has {len(values)} entries for {num_prompts} prompts")
    return values
