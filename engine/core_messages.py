"""What crosses the boundary between the front end and the engine core (vLLM's
EngineCoreRequest / EngineCoreOutputs), in-process or over ZMQ.

Every message is a msgspec Struct so that the same objects are passed by reference in one
process and encoded to msgpack between two (no pickle: nothing decoded can run code). The core
sees token ids only: text, detokenization and stop strings are the front end's
(`OutputProcessor`). Outputs are *deltas*: the tokens a step added, never a copy of what was
sent before.
"""

from __future__ import annotations

import msgspec

from octavo.engine.lora_request import LoRARequest
from octavo.engine.sampling_params import BeamSearchParams, SamplingParams


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """A validated request; exactly one of sampling_params / beam_params is set.
    `all_stop_token_ids`: the tokens that end its samples (`stop_rules.stop_token_set`);
    `grammar` and `bad_words_token_ids`: what the front end derived from its parameters
    (ProcessedPrompt's)."""

    request_id: str
    prompt_token_ids: list[int]
    arrival_time: float
    all_stop_token_ids: list[int]
    sampling_params: SamplingParams | None = None
    beam_params: BeamSearchParams | None = None
    lora_request: LoRARequest | None = None
    grammar: str | None = None
    bad_words_token_ids: list[list[int]] = []
    # What the scheduling policy orders it by: priority (lower first) and user (fair).
    priority: int = 0
    user: str = ""

    @property
    def params(self) -> SamplingParams | BeamSearchParams:
        params = self.sampling_params or self.beam_params
        assert params is not None, "a request carries sampling or beam search parameters"
        return params


class SampleAbort(msgspec.Struct, array_like=True, frozen=True):
    """Stops one sample of a request (a stop string the front end matched); the request's
    other samples go on."""

    request_id: str
    index: int


class EngineCoreInputs(msgspec.Struct, array_like=True, omit_defaults=True):
    """Everything the front end sent since its last message, applied before the next step:
    new requests, whole-request aborts, sample aborts; `shutdown` stops the core (once every
    API process sent it). `client_index`: which of the core's API processes sent it (0 of 1
    unless --api-server-count), the one its requests' outputs go back to."""

    requests: list[EngineCoreRequest] = []
    aborts: list[str] = []
    sample_aborts: list[SampleAbort] = []
    shutdown: bool = False
    client_index: int = 0


# gc=False on the records built per row per step (they never take part in a reference cycle):
# untracked, they do not count toward the collector's thresholds, so they set off no
# collections, which otherwise cost a visible share of a large batch's step
# (benchmarks/host_overhead.py).
class SampleDelta(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What one sample of a request gained in a step.

    new_logprobs holds, per new token, {token_id: logprob} for the sampled token and the top-N
    alternatives when the request asked for logprobs. finish_reason is set when the core
    finished the sample on a token rule (EOS, a stop token, max_tokens, max_model_len);
    stop_reason is then the stop token id, if one matched.
    """

    index: int
    new_token_ids: list[int]
    cumulative_logprob: float | None  # None unless the request asked for logprobs
    new_logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | None = None


class PromptLogprobs(msgspec.Struct, array_like=True):
    """Log-probabilities of consecutive prompt tokens, the next ones of a request (its first
    prompt token has none): per token, {token_id: logprob} with the prompt token first, then
    the request's `prompt_logprobs` most likely tokens at that position; and the prompt
    token's rank there (1: the most likely token; the best tokens rank 1, 2, ...)."""

    logprobs: list[dict[int, float]]
    ranks: list[int]


class BeamResult(msgspec.Struct, array_like=True):
    """One returned hypothesis of a finished beam search (token ids; the front end decodes)."""

    token_ids: list[int]
    cumulative_logprob: float
    score: float
    finish_reason: str


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # see above
    """A request's progress in one step. `finished` comes once, and with it the final
    hypotheses of a beam search, or `error` when processing the request raised. A request
    that asked for prompt logprobs gets them chunk by chunk as its prompt is computed (in
    outputs that may carry no tokens). `first_scheduled_time` (time.monotonic(): one clock
    for every process of the host) and `num_cached_tokens` come with the first token and
    with the end; `first_token_time` with the end (a request whose tokens all come at its
    end was not served its first token then)."""

    request_id: str
    samples: list[SampleDelta] = []
    finished: bool = False
    error: str | None = None
    beams: list[BeamResult] | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    prompt_logprobs: PromptLogprobs | None = None  # the next prompt tokens' (in order)
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache


class UserStats(msgspec.Struct, array_like=True, frozen=True):
    """One user's series (engine/core/user_stats.py): its requests running and waiting, and
    the prompt and generated tokens it was served."""

    num_running: int
    num_waiting: int
    prompt_tokens: int
    generation_tokens: int


class EngineStats(msgspec.Struct, array_like=True):
    """The core's counters after a step, for metrics and admission control.
    num_requests_added counts every request the core has taken in, so that the front end can
    tell how many it sent are still on the wire."""

    num_running_seqs: int
    num_waiting_requests: int
    num_free_blocks: int
    num_usable_blocks: int
    kv_cache_usage: float
    num_preemptions: int
    num_prompt_tokens: int
    num_generation_tokens: int
    num_requests_added: int
    num_prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    num_prefix_cache_hits: int  # of which were cached
    num_steps: int  # model forward passes run: generated tokens / steps is the batch's fill
    num_draft_tokens: int = 0  # speculative decoding: draft tokens verified
    num_accepted_tokens: int = 0  # of which the model chose
    num_accepted_tokens_per_pos: list[int] = []  # of those, by position in the draft
    # LoRA: running and waiting requests by adapter id (adapters with none left out).
    lora_running: dict[int, int] = {}
    lora_waiting: dict[int, int] = {}
    # Per user (a bounded set of labels; see engine/core/user_stats.py).
    users: dict[str, UserStats] = {}


class EngineCoreOutputs(msgspec.Struct, array_like=True, tag=True):
    """One step's outputs (only requests that progressed) and the stats after it."""

    outputs: list[EngineCoreOutput]
    stats: EngineStats


class ModelLimits(msgspec.Struct, array_like=True, frozen=True):
    """What the front end validates requests against; known once the core has loaded the
    model and sized its KV cache."""

    vocab_size: int
    max_model_len: int
    eos_token_ids: list[int]
    max_num_seqs: int
    block_size: int
    num_usable_blocks: int
    scheduling_policy: str = "fcfs"  # a request's priority is refused under any other


class EngineCoreReady(msgspec.Struct, array_like=True, tag=True):
    """The core process is up: the first message it sends."""

    limits: ModelLimits
    stats: EngineStats


class EngineCoreFailed(msgspec.Struct, array_like=True, tag=True):
    """The core process could not start (a configuration error, such as a missing model:
    sent instead of EngineCoreReady) or its loop died; it exits after sending this."""

    error: str


# What the core process sends; decoded by the front end with one typed decoder.
CoreMessage = EngineCoreOutputs | EngineCoreReady | EngineCoreFailed
