"""The synchronous engine core: requests in, one scheduled and executed step at a time."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from octavo import kernels
from octavo.engine.attention.backend import AttentionBackend
from octavo.engine.attention.torch_backend import TorchAttentionBackend
from octavo.engine.attention.triton_backend import TritonAttentionBackend
from octavo.engine.beam_search import BeamState
from octavo.engine.block_manager import BlockManager
from octavo.engine.config import DEFAULT_CPU_KV_CACHE_GB, EngineConfig
from octavo.engine.errors import ParameterError
from octavo.engine.model_runner import ModelRunner, profile_activation_bytes
from octavo.engine.models.gpt2 import GPT2LMHeadModel
from octavo.engine.models.weights import load_model
from octavo.engine.outputs import RequestOutput
from octavo.engine.sampler import Sampler
from octavo.engine.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from octavo.engine.scheduler import Scheduler, SchedulerConfig
from octavo.engine.sequence import Sequence, SequenceGroup
from octavo.engine.stop_checker import StopChecker
from octavo.engine.tokenizer import IncrementalDetokenizer

_GIB = 1 << 30


@dataclass(frozen=True)
class ProcessedPrompt:
    """A validated prompt: its text (None when given as token ids) and its token ids."""

    text: str | None
    token_ids: list[int]


@dataclass
class EngineStats:
    """A snapshot for metrics and tests."""

    num_running_seqs: int
    num_waiting_requests: int
    num_free_blocks: int
    num_usable_blocks: int
    kv_cache_usage: float
    num_preemptions: int
    num_prompt_tokens: int
    num_generation_tokens: int


def make_backend(config: EngineConfig) -> AttentionBackend:
    """The configured attention backend; triton on CPU needs the Triton interpreter."""
    if config.backend_name == "torch":
        return TorchAttentionBackend()
    if config.torch_device.type != "cuda" and not kernels.interpreter_active():
        raise ValueError(
            "attention_backend='triton' needs CUDA, or on CPU the Triton "
            "interpreter (TRITON_INTERPRET=1 set before the engine is imported)"
        )
    return TritonAttentionBackend()


class LLMEngine:
    """Owns model, KV cache, scheduler and sampler; `step()` advances every running request.

    Requests are validated in `add_request` (ValueError naming the parameter) before anything
    is queued, so bad input never disturbs requests already running.
    """

    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = config.torch_device
        dtype = config.torch_dtype
        backend = make_backend(config)
        if config.block_size < backend.min_block_size:
            raise ValueError(
                f"block_size must be >= {backend.min_block_size} for the "
                f"{backend.name} attention backend, got {config.block_size}"
            )
        loaded = load_model(
            config.model, config.load_format, backend, self.device, dtype, config.seed
        )
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.eos_token_id = loaded.eos_token_id
        n_positions = self.model_config.n_positions
        self.max_model_len = config.max_model_len or n_positions
        if self.max_model_len > n_positions:
            raise ValueError(
                f"max_model_len ({self.max_model_len}) exceeds the model's "
                f"n_positions ({n_positions})"
            )

        num_blocks = config.num_blocks or self._default_num_blocks(loaded.model, backend, dtype)
        self.block_manager = BlockManager(num_blocks, config.block_size)
        needed = self.block_manager.num_blocks_for_tokens(self.max_model_len)
        if needed > self.block_manager.num_usable_blocks:
            raise ValueError(
                f"num_blocks={num_blocks} cannot hold one sequence of max_model_len "
                f"{self.max_model_len} ({needed} blocks of {config.block_size} "
                f"tokens plus the null block)"
            )
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens),
            self.block_manager,
            StopChecker(self.max_model_len, self.eos_token_id),
        )
        generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self.runner = ModelRunner(
            loaded.model,
            backend,
            self.block_manager,
            Sampler(self.eos_token_id, generator),
            num_blocks,
            config.block_size,
            self.device,
            dtype,
        )
        if self.device.type == "cuda" and backend.name == "triton" and not config.enforce_eager:
            self.runner.enable_cuda_graphs(config.max_num_seqs, self.max_model_len)
        self._groups: dict[str, SequenceGroup] = {}

    def _default_num_blocks(
        self, model: GPT2LMHeadModel, backend: AttentionBackend, dtype: torch.dtype
    ) -> int:
        """CPU: kv_cache_gb. CUDA: gpu_memory_utilization of the device, minus what is in use
        (weights) and what the largest step needs on top (profiled with a dummy step)."""
        config = self.config
        per_block = ModelRunner.kv_bytes_per_block(self.model_config, config.block_size, dtype)
        if self.device.type == "cuda":
            activation = profile_activation_bytes(
                model, backend, config.max_num_batched_tokens, config.max_num_seqs,
                self.max_model_len, config.block_size,
            )  # fmt: skip
            # Blocks torch's allocator caches but no tensor holds (a previous engine's, say)
            # are free for this cache: hand them back before reading the device's free memory.
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(self.device)
            budget = total * config.gpu_memory_utilization - (total - free) - activation
        else:
            budget = (self.config.kv_cache_gb or DEFAULT_CPU_KV_CACHE_GB) * _GIB
        return max(int(budget // per_block), 2)

    # -- requests ----------------------------------------------------------------------------

    def process_inputs(
        self, prompt: str | list[int], params: SamplingParams | BeamSearchParams
    ) -> ProcessedPrompt:
        """Tokenizes and validates a request without touching engine state (any thread may call
        it); raises ParameterError (a ValueError) naming the offending parameter."""
        text, token_ids = self._tokenize(prompt)
        self._validate(token_ids, params)
        return ProcessedPrompt(text, token_ids)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | ProcessedPrompt,
        params: SamplingParams | BeamSearchParams,
        arrival_time: float | None = None,
    ) -> None:
        """Validates and queues a request; raises ValueError naming the offending parameter."""
        if request_id in self._groups:
            raise ParameterError("request_id", f"request_id {request_id!r} is already in use")
        if not isinstance(prompt, ProcessedPrompt):
            prompt = self.process_inputs(prompt, params)
        group = SequenceGroup(
            request_id,
            prompt.text,
            prompt.token_ids,
            params,
            arrival_time or time.monotonic(),
            self.device,
        )
        if isinstance(params, BeamSearchParams):
            room = self.max_model_len - len(prompt.token_ids)
            group.beam = BeamState.create(
                params, self.eos_token_id, max(min(params.max_tokens, room), 1)
            )
        detokenizer = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
        seq = Sequence(
            self.scheduler.new_seq_id(), prompt.token_ids, detokenizer, group.make_generator(0)
        )
        group.seqs.append(seq)
        self._groups[request_id] = group
        self.scheduler.add(group)

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ParameterError(
                    "prompt", "prompt: this model has no tokenizer.json; pass token ids"
                )
            return prompt, self.tokenizer.encode(prompt)
        if not isinstance(prompt, list | tuple) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            raise ParameterError("prompt", "prompt must be a string or a list of integer token ids")
        return None, list(prompt)

    def _validate(self, prompt_ids: list[int], params: SamplingParams | BeamSearchParams) -> None:
        if not prompt_ids:
            raise ParameterError("prompt", "prompt must not be empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ParameterError(
                "prompt", f"prompt token ids must be in [0, {vocab}), got {bad[:4]}"
            )
        if len(prompt_ids) > self.max_model_len:
            raise ParameterError(
                "prompt",
                f"prompt is {len(prompt_ids)} tokens, longer than "
                f"max_model_len ({self.max_model_len})",
            )
        bad_stop = [t for t in params.stop_token_ids if t >= vocab]
        if bad_stop:
            raise ParameterError(
                "stop_token_ids", f"stop_token_ids must be in [0, {vocab}), got {bad_stop[:4]}"
            )
        if isinstance(params, BeamSearchParams):
            stops = len(params.stop_token_ids) + (0 if params.ignore_eos else 1)
            if max(2, 1 + stops) * params.beam_width > vocab:
                raise ParameterError(
                    "beam_width",
                    f"beam_width={params.beam_width} ranks more "
                    f"candidates per step than the vocabulary ({vocab}) has",
                )
        elif params.logprobs is not None and params.logprobs > vocab:
            raise ParameterError("logprobs", f"logprobs must be <= the vocabulary size {vocab}")
        width = "beam_width" if isinstance(params, BeamSearchParams) else "n"
        if params.n > self.config.max_num_seqs:
            raise ParameterError(
                width,
                f"{width}={params.n} exceeds max_num_seqs "
                f"({self.config.max_num_seqs}): its sequences run together",
            )
        # Each group must fit alone even after a preemption undoes its prompt sharing.
        longest = min(len(prompt_ids) + params.max_tokens, self.max_model_len)
        blocks = params.n * self.block_manager.num_blocks_for_tokens(longest)
        if blocks > self.block_manager.num_usable_blocks:
            raise ParameterError(
                width,
                f"{width}={params.n} sequences of up to {longest} tokens need "
                f"{blocks} KV blocks; the cache has "
                f"{self.block_manager.num_usable_blocks}",
            )

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stops a request and frees its blocks now; its final output, or None if unknown."""
        group = self.scheduler.abort(request_id)
        self._groups.pop(request_id, None)
        return RequestOutput.from_group(group, self.tokenizer) if group is not None else None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the loop ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedules, runs and applies one step; returns outputs of requests that progressed
        (only finished ones for FINAL_ONLY requests)."""
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty:
            return []
        sampled = self.runner.execute(scheduled)
        outputs = []
        for group in self.scheduler.update(scheduled, sampled):
            if group.is_finished:
                del self._groups[group.request_id]
            elif group.beam is not None:
                continue  # beam search ranks whole sequences: only final outputs mean anything
            elif group.sampling.output_kind is RequestOutputKind.FINAL_ONLY:
                continue
            outputs.append(self._output(group))
        return outputs

    def _output(self, group: SequenceGroup) -> RequestOutput:
        """The group's output; building it (detokenizing) fails the group alone."""
        try:
            return RequestOutput.from_group(group, self.tokenizer)
        except Exception as exc:  # noqa: BLE001 -- one request's fault is its own
            self.scheduler.fail(group, exc)
            self._groups.pop(group.request_id, None)
            return RequestOutput.failed(group)

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running_seqs=self.scheduler.num_running_seqs,
            num_waiting_requests=len(self.scheduler.waiting),
            num_free_blocks=bm.num_free_blocks,
            num_usable_blocks=bm.num_usable_blocks,
            kv_cache_usage=bm.usage,
            num_preemptions=self.scheduler.num_preemptions,
            num_prompt_tokens=self.scheduler.num_prompt_tokens,
            num_generation_tokens=self.scheduler.num_generation_tokens,
        )
