"""The engine core: the scheduler and the worker it steps (engine/worker/worker.py), on
token ids alone.

It knows no text: requests arrive validated and tokenized (`InputProcessor`), and each step
returns only what changed (`EngineCoreOutputs` of delta outputs), which the front end's
`OutputProcessor` turns into text and stop-string decisions. The same class runs inside the
offline `LLMEngine`, in the `AsyncEngine`'s thread, or in its own process (`core_process`).
"""

from __future__ import annotations

from collections.abc import Callable

from octavo.engine.config import EngineConfig
from octavo.engine.core.beam_state import BeamState
from octavo.engine.core.block_manager import BlockManager
from octavo.engine.core.request_outputs import final_output, refused_output
from octavo.engine.core.scheduled_step import ScheduledStep
from octavo.engine.core.scheduler import Scheduler, SchedulerConfig
from octavo.engine.core.sequence import Sequence, SequenceGroup
from octavo.engine.core.stop_checker import StopChecker
from octavo.engine.core_messages import (
    EngineCoreInputs,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineStats,
    ModelLimits,
)
from octavo.engine.errors import ParameterError
from octavo.engine.lora_request import LoRARequest
from octavo.engine.sampling_params import BeamSearchParams
from octavo.engine.speculative import SpeculativeConfig, can_speculate, propose_ngram
from octavo.engine.step_io import SchedulerOutput
from octavo.engine.stop_rules import length_limit
from octavo.engine.worker.draft_model import DraftRequest
from octavo.engine.worker.model_runner import StepFuture
from octavo.engine.worker.worker import load_worker


class EngineCore:
    """Owns the scheduler and its block manager and steps the worker (`load_worker`: the
    model, KV cache, runner and draft model); `step()` advances every running request.

    Requests come validated (the front end checked them against `limits`); a request the core
    still cannot take (a duplicate id) raises ValueError in `add_request` and disturbs nobody
    else.
    """

    def __init__(self, config: EngineConfig):
        self.config = config
        worker = load_worker(config)
        self.model_config = worker.model_config
        self.eos_token_ids = worker.eos_token_ids
        self.eos_token_id = self.model_config.eos_token_id
        self.max_model_len = worker.max_model_len
        self.runner, self.drafter = worker.runner, worker.drafter
        self.block_manager = BlockManager(
            worker.num_blocks, config.block_size, config.enable_prefix_caching
        )
        needed = self.block_manager.num_blocks_for_tokens(self.max_model_len)
        if needed > self.block_manager.num_usable_blocks:
            raise ValueError(
                f"num_blocks={worker.num_blocks} cannot hold one sequence of max_model_len "
                f"{self.max_model_len} ({needed} blocks of {config.block_size} "
                f"tokens plus the null block)"
            )
        self.scheduler = Scheduler(
            SchedulerConfig(
                config.max_num_seqs,
                config.max_num_batched_tokens,
                config.effective_prefill_interval,
                config.max_loras,
                config.scheduling_policy,
                config.fair_prompt_token_weight,
                config.fair_output_token_weight,
            ),
            self.block_manager,
            StopChecker(self.eos_token_ids),
        )
        self.limits = ModelLimits(
            vocab_size=self.model_config.vocab_size,
            max_model_len=self.max_model_len,
            eos_token_ids=self.eos_token_ids,
            max_num_seqs=config.max_num_seqs,
            block_size=config.block_size,
            num_usable_blocks=self.block_manager.num_usable_blocks,
            scheduling_policy=config.scheduling_policy,
        )
        self._groups: dict[str, SequenceGroup] = {}
        self._num_requests_added = 0
        self._num_steps = 0
        # Async scheduling: the step launched last, applied after the next one is launched.
        self._in_flight: tuple[ScheduledStep, StepFuture] | None = None
        # Resolved once: the config is frozen, and resolving it per step would ask torch.
        self._async_scheduling = config.uses_async_scheduling
        # Requests that need their steps in order (SequenceGroup.needs_sync_steps): while
        # one runs, steps are applied before the next.
        self._needs_sync_steps: set[str] = set()
        # Called with each step's worker input just before it launches: a way to watch
        # steps, or to fail one as a model fault would (an observer that raises fails the
        # step, and the engine's fatal path follows).
        self.step_observers: list[Callable[[SchedulerOutput], None]] = []

    # -- requests ----------------------------------------------------------------------------

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queues a validated request; ValueError if it cannot be taken."""
        self._num_requests_added += 1
        if request.request_id in self._groups:
            raise ParameterError(
                "request_id", f"request_id {request.request_id!r} is already in use"
            )
        params = request.params
        num_prompt_tokens = len(request.prompt_token_ids)
        max_num_tokens = length_limit(num_prompt_tokens, params.max_tokens, self.max_model_len)
        spec = self.config.speculative
        group = SequenceGroup(
            request.request_id,
            request.prompt_token_ids,
            params,
            request.arrival_time,
            frozenset(request.all_stop_token_ids),
            max_num_tokens,
            num_speculative_tokens=(
                spec.num_speculative_tokens if spec and can_speculate(params) else 0
            ),
            lora_int_id=self._add_lora(request.lora_request),
            priority=request.priority,
            user=request.user,
            grammar=request.grammar,
            bad_words_token_ids=request.bad_words_token_ids,
        )
        if isinstance(params, BeamSearchParams):
            group.beam = BeamState.create(
                params, request.all_stop_token_ids, max(max_num_tokens - num_prompt_tokens, 1)
            )
        seq = Sequence(
            self.scheduler.new_seq_id(), request.prompt_token_ids, lora_int_id=group.lora_int_id
        )
        group.seqs.append(seq)
        self._groups[request.request_id] = group
        if group.needs_sync_steps:
            self._needs_sync_steps.add(request.request_id)
        self.scheduler.add(group)

    def _add_lora(self, lora_request: LoRARequest | None) -> int:
        """The adapter id a request runs with (0: the base), its adapter checked and loaded;
        ParameterError naming lora_request (LoRA off) or lora_path (an adapter it cannot
        serve)."""
        if lora_request is None:
            return 0
        if not self.config.enable_lora:
            raise ParameterError(
                "lora_request", "this engine serves no LoRA adapters: start it with enable_lora"
            )
        if lora_request.lora_int_id < 1:
            raise ParameterError(
                "lora_request", f"lora_int_id must be >= 1, got {lora_request.lora_int_id}"
            )
        self.runner.add_lora(lora_request)
        return lora_request.lora_int_id

    def abort_request(self, request_id: str) -> EngineCoreOutput | None:
        """Stops a request and frees its blocks now; its final output (finish_reason "abort";
        a beam search reports its live beams), or None if unknown."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return None
        self.scheduler.abort(group)
        self._needs_sync_steps.discard(request_id)
        return final_output(group, [])

    def abort_sample(self, request_id: str, index: int) -> None:
        """Stops one sample (the front end matched a stop string and finished it already)."""
        group = self._groups.get(request_id)
        if group is not None and self.scheduler.abort_sample(group, index):
            del self._groups[request_id]
            self._needs_sync_steps.discard(request_id)

    def apply(self, inputs: EngineCoreInputs) -> list[EngineCoreOutput]:
        """Applies what the front end sent, in order: adds, aborts, sample aborts. Returns
        the final outputs this produced: aborted requests, and requests the core refused."""
        outputs = []
        for request in inputs.requests:
            try:
                self.add_request(request)
            except Exception as exc:  # noqa: BLE001 -- refuses this request, not the loop
                outputs.append(refused_output(request.request_id, exc))
        for request_id in inputs.aborts:
            final = self.abort_request(request_id)
            if final is not None:
                outputs.append(final)
        for sample in inputs.sample_aborts:
            self.abort_sample(sample.request_id, sample.index)
        return outputs

    def has_unfinished_requests(self) -> bool:
        # A step in flight holds tokens for live requests only while the scheduler still
        # has them; once every request has finished or was aborted its results are dropped,
        # which the next step() call does.
        return self.scheduler.has_unfinished()

    def run_busy_loop(
        self,
        receive: Callable[[bool], EngineCoreInputs | None],
        send: Callable[[EngineCoreOutputs], None],
    ) -> None:
        """Serves a front end until it sends `shutdown`: applies everything received (waiting
        in `receive(True)` only while idle: no busy loop), steps while requests are
        unfinished, and sends one EngineCoreOutputs per iteration that changed anything.
        Whatever a step raises propagates: the loop cannot go on after a failed step."""
        while True:
            outputs: list[EngineCoreOutput] = []
            block = not self.has_unfinished_requests()
            received = False
            while (inputs := receive(block)) is not None:
                if inputs.shutdown:
                    return
                outputs += self.apply(inputs)
                received, block = True, False
            if self.has_unfinished_requests():
                outputs += self.step().outputs
            elif not received:
                continue
            send(EngineCoreOutputs(outputs, self.stats()))

    # -- the loop ----------------------------------------------------------------------------

    def step(self) -> EngineCoreOutputs:
        """Launches step N and applies step N - 1 while N runs, then N itself unless steps
        are scheduled one ahead (`async_scheduling`: N's tokens then feed N + 1 on the
        device). Returns the outputs of requests that progressed."""
        outputs: list[EngineCoreOutput] = []
        ahead = self._async_scheduling and not self._needs_sync_steps
        if not ahead:  # a request that needs sync steps came in while one was in flight
            outputs += self._apply_in_flight()
        scheduled = self.scheduler.schedule()
        launched = None
        if not scheduled.output.scheduled:  # nothing to run; the worker still hears what ended
            self.runner.apply_changes(scheduled.output)
        else:
            for observe in self.step_observers:
                observe(scheduled.output)
            launched = (scheduled, self.runner.execute_async(scheduled.output))
            self._num_steps += 1
        outputs += self._apply_in_flight()
        self._in_flight = launched
        if not ahead:
            outputs += self._apply_in_flight()
        if self.config.speculative is not None:
            self._propose_drafts(self.config.speculative)
        return EngineCoreOutputs(outputs, self.stats())

    def _propose_drafts(self, spec: SpeculativeConfig) -> None:
        """Gives each speculating sequence that has just sampled a draft for the next step
        (prompt lookup, or the draft model), unless more sequences run than
        `disable_by_batch_size`. A draft stops short of the request's length limit: tokens
        past it would not be kept."""
        scheduler, drafter = self.scheduler, self.drafter
        if drafter is not None:
            drafter.release({seq.seq_id for group in scheduler.running for seq in group.seqs})
        limit = spec.disable_by_batch_size
        if limit is not None and scheduler.num_running_seqs > limit:
            return
        drafted: list[tuple[Sequence, int]] = []
        for group in scheduler.running:
            if not group.num_speculative_tokens:
                continue
            for seq in group.seqs:
                tokens = seq.token_ids
                if seq.is_finished or seq.num_computed_tokens != len(tokens) - 1:
                    continue  # still prefilling, or ended
                k = min(group.num_speculative_tokens, group.max_num_tokens - len(tokens) - 1)
                if k > 0:
                    drafted.append((seq, k))
        if drafter is None:
            for seq, k in drafted:
                seq.spec_token_ids = propose_ngram(
                    seq.token_ids, k, spec.prompt_lookup_min, spec.prompt_lookup_max
                )
            return
        bm, requests = self.block_manager, []
        for seq, k in drafted:
            # Slots for the draft's own proposals too: it writes them through this table.
            bm.allocate_lookahead(seq, k)
            requests.append(DraftRequest(seq.seq_id, seq.token_ids, k, bm.block_tables[seq.seq_id]))
        for (seq, _), draft in zip(drafted, drafter.propose(requests), strict=True):
            seq.spec_token_ids = draft

    def _apply_in_flight(self) -> list[EngineCoreOutput]:
        """Applies the step in flight, if any; the outputs of the requests that progressed
        or ended."""
        if self._in_flight is None:
            return []
        scheduled, launched = self._in_flight
        self._in_flight = None
        update = self.scheduler.update(scheduled, launched.result())
        for group in update.finished:
            del self._groups[group.request_id]
            self._needs_sync_steps.discard(group.request_id)
        return update.outputs

    def stats(self) -> EngineStats:
        bm, updater = self.block_manager, self.scheduler.updater
        return EngineStats(
            num_running_seqs=self.scheduler.num_running_seqs,
            num_waiting_requests=len(self.scheduler.waiting),
            num_free_blocks=bm.num_free_blocks,
            num_usable_blocks=bm.num_usable_blocks,
            kv_cache_usage=bm.usage,
            num_preemptions=self.scheduler.num_preemptions,
            num_prompt_tokens=self.scheduler.num_prompt_tokens,
            num_generation_tokens=updater.num_generation_tokens,
            num_requests_added=self._num_requests_added,
            num_prefix_cache_queries=self.scheduler.num_prefix_cache_queries,
            num_prefix_cache_hits=self.scheduler.num_prefix_cache_hits,
            num_steps=self._num_steps,
            num_draft_tokens=updater.num_draft_tokens,
            num_accepted_tokens=updater.num_accepted_tokens,
            num_accepted_tokens_per_pos=list(updater.num_accepted_tokens_per_pos),
            lora_running=self.scheduler.requests_per_adapter(self.scheduler.running),
            lora_waiting=self.scheduler.requests_per_adapter(self.scheduler.waiting),
            users=self.scheduler.users.stats(self.scheduler.running, self.scheduler.waiting),
        )
