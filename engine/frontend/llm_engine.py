"""The synchronous engine: input processor, engine core and output processor in one process."""

from __future__ import annotations

import time

from octavo.engine.config import EngineConfig
from octavo.engine.core.block_manager import BlockManager
from octavo.engine.core.engine_core import EngineCore
from octavo.engine.core.scheduler import Scheduler
from octavo.engine.core_messages import EngineCoreInputs, EngineCoreOutput, EngineStats
from octavo.engine.errors import ParameterError
from octavo.engine.frontend.input_processor import InputProcessor, ProcessedPrompt
from octavo.engine.frontend.output_processor import OutputProcessor
from octavo.engine.frontend.outputs import RequestOutput
from octavo.engine.frontend.tokenizer import load_tokenizer
from octavo.engine.lora_request import LoRARequest
from octavo.engine.sampling_params import BeamSearchParams, SamplingParams
from octavo.engine.worker.model_runner import ModelRunner
from octavo.engine.worker.models.configs import GPT2Config

__all__ = ["EngineStats", "LLMEngine", "ProcessedPrompt"]


class LLMEngine:
    """Requests in, one scheduled and executed step at a time, RequestOutputs out.

    The same three parts as the server's process split, called directly: `add_request`
    validates (ValueError naming the parameter) before anything is queued, so bad input
    never disturbs requests already running; a stop string the output processor matches
    stops its sample in the core before the next step, so no token is computed past it.
    """

    def __init__(self, config: EngineConfig):
        self.config = config
        self.core = EngineCore(config)
        self.tokenizer = load_tokenizer(config.model, config.load_format)
        self.input_processor = InputProcessor(self.tokenizer, self.core.limits)
        self.output_processor = OutputProcessor(self.tokenizer)

    # The core's parts, for tests and tools that inspect them.
    @property
    def block_manager(self) -> BlockManager:
        return self.core.block_manager

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def runner(self) -> ModelRunner:
        return self.core.runner

    @property
    def model_config(self) -> GPT2Config:
        return self.core.model_config

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def eos_token_id(self) -> int | None:
        return self.core.eos_token_id

    # -- requests ----------------------------------------------------------------------------

    def process_inputs(
        self, prompt: str | list[int], params: SamplingParams | BeamSearchParams
    ) -> ProcessedPrompt:
        """Tokenizes and validates a request without touching engine state; raises
        ParameterError (a ValueError) naming the offending parameter."""
        return self.input_processor.process_inputs(prompt, params)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | ProcessedPrompt,
        params: SamplingParams | BeamSearchParams,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
        user: str = "",
    ) -> None:
        """Validates and queues a request (with `lora_request`, under that LoRA adapter;
        `priority` and `user`: what the scheduling policy orders it by); raises ValueError
        naming the offending parameter."""
        if self.output_processor.has_request(request_id):
            raise ParameterError("request_id", f"request_id {request_id!r} is already in use")
        if not isinstance(prompt, ProcessedPrompt):
            prompt = self.process_inputs(prompt, params)
        arrival_time = arrival_time or time.monotonic()
        request = self.input_processor.core_request(
            request_id, prompt, params, arrival_time, lora_request, priority, user
        )
        self.core.add_request(request)
        self.output_processor.add_request(
            request_id, prompt.text, prompt.token_ids, params, arrival_time
        )

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stops a request and frees its blocks now; its final output, or None if unknown."""
        final = self.core.abort_request(request_id)
        if final is None:
            return None
        outputs = self._process([final])
        return outputs[0] if outputs else None

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    # -- the loop ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Runs one step; returns the outputs of requests that progressed, as each request's
        output kind asks (only finished ones for FINAL_ONLY requests and beam search)."""
        return self._process(self.core.step().outputs)

    def _process(self, outputs: list[EngineCoreOutput]) -> list[RequestOutput]:
        processed = self.output_processor.process(outputs)
        if processed.sample_aborts or processed.aborts:
            self.core.apply(
                EngineCoreInputs(aborts=processed.aborts, sample_aborts=processed.sample_aborts)
            )
        return processed.request_outputs

    def stats(self) -> EngineStats:
        return self.core.stats()
