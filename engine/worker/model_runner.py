"""Turns a SchedulerOutput into model inputs, runs GPT-2 and samples."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from octavo.engine.config import EngineConfig
from octavo.engine.core_messages import PromptLogprobs
from octavo.engine.lora_request import LoRARequest
from octavo.engine.step_io import (
    BeamCandidates,
    GrammarProgress,
    ModelRunnerOutput,
    SamplerOutput,
    SchedulerOutput,
)
from octavo.engine.worker.attention.backend import AttentionBackend
from octavo.engine.worker.cuda_graphs import DecodeGraphs
from octavo.engine.worker.cudagraph_dispatcher import CudagraphDispatcher, CUDAGraphMode
from octavo.engine.worker.fused_decode import FusedDecode
from octavo.engine.worker.input_batch import HostBatch, InputBatch, PendingInputs
from octavo.engine.worker.lora import LoRAManager
from octavo.engine.worker.models.gpt2 import GPT2Config, GPT2LMHeadModel
from octavo.engine.worker.piecewise_graphs import PiecewiseGraphs
from octavo.engine.worker.sampler import SampledTokens, Sampler, logprob_entry
from octavo.engine.worker.step_inputs import StepInputs, on_device

# Prompt logprobs are reduced this many positions at a time (a pass holds [rows, vocab]
# float32 logits twice: 100 MB for GPT-2's vocabulary).
PROMPT_LOGPROBS_ROWS_PER_PASS = 256


@dataclass
class TopLogprobs:
    """Per position (on the device): the token that came, its log-probability and rank
    among the vocabulary (1: the most likely), and the best tokens there, best first
    (`top_ids` / `top_values` [positions, k])."""

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    ranks: torch.Tensor
    top_values: torch.Tensor
    top_ids: torch.Tensor

    def to_host(self) -> PromptLogprobs:
        """{token_id: logprob} per position, the token that came first, and its rank."""
        rows = zip(
            self.token_ids.tolist(), self.logprobs.tolist(), self.top_ids.tolist(),
            self.top_values.tolist(), strict=True,
        )  # fmt: skip
        return PromptLogprobs([logprob_entry(*row) for row in rows], self.ranks.tolist())


class StepFuture:
    """A launched step's results (of `batch`'s sampled and beam rows). On CUDA the sampled
    tensors are copied to pinned host memory without blocking and an event marks the
    copies' end: `result()` waits on that event alone, so the host can schedule the next
    step meanwhile. `result()` also hands the sampled tokens to `record` (the worker's own
    record of its sequences' outputs)."""

    def __init__(
        self,
        batch: HostBatch,
        sampled: SampledTokens | None,
        candidates: tuple[torch.Tensor, torch.Tensor] | None,
        prompt_logprobs: dict[int, TopLogprobs],
        record: Callable[[list[int], list[int]], GrammarProgress],
    ):
        self.sampled_seq_ids, self.beam_seq_ids = batch.sampled_seq_ids, batch.beam_seq_ids
        self._record = record
        # Read with a blocking copy in result(): requests that ask for prompt logprobs run
        # without the one-step lag (the core applies their steps before the next).
        self._prompt_logprobs = prompt_logprobs
        tensors = [] if sampled is None else sampled.tensors
        num_sampled = len(tensors)
        tensors += [] if candidates is None else list(candidates)
        self._event = None
        if tensors and tensors[0].device.type == "cuda":
            tensors = [
                torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                for t in tensors
            ]
            self._event = torch.cuda.Event()
            self._event.record()
        self._sampled = None if sampled is None else sampled.with_tensors(tensors[:num_sampled])
        self._candidates = tensors[num_sampled:]

    def result(self) -> ModelRunnerOutput:
        if self._event is not None:
            self._event.synchronize()
        sampled = SamplerOutput([], [], []) if self._sampled is None else self._sampled.to_host()
        grammar = self._record(self.sampled_seq_ids, sampled.token_ids)
        candidates = BeamCandidates(*self._candidates) if self._candidates else None
        prompt = {seq_id: top.to_host() for seq_id, top in self._prompt_logprobs.items()}
        return ModelRunnerOutput(
            self.sampled_seq_ids, sampled, self.beam_seq_ids, candidates, prompt, grammar
        )


class ModelRunner:
    """Owns the model and the KV cache tensor; executes one scheduled step at a time.

    kv_cache is [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim] (the model's
    K/V heads, fewer than its query heads with multi-query attention); block 0 (the
    null block) is zeroed and never written, so padded reads see zeros, not garbage. Inputs
    come from the persistent `InputBatch`; on CUDA each kind of input crosses to the device
    in one non-blocking copy from pinned memory.
    """

    def __init__(
        self,
        config: EngineConfig,
        model: GPT2LMHeadModel,
        backend: AttentionBackend,
        sampler: Sampler,
        num_blocks: int,
        max_model_len: int,
        lora: LoRAManager | None = None,
    ):
        self.lora = lora  # the model's adapter slots, with enable_lora
        self.model = model
        self.backend = backend
        self.sampler = sampler
        self.block_size = block_size = config.block_size
        self.device = device = config.torch_device
        self.input_batch = InputBatch(
            config.max_num_seqs, max_model_len, block_size, model.config.vocab_size, device,
            sampler.grammars,
        )  # fmt: skip
        self.kv_cache = allocate_kv_cache(
            model.config, num_blocks, block_size, config.torch_dtype, device
        )
        # The previous step's sampled tokens (device) and the sequence of each row.
        self._last_sampled: tuple[torch.Tensor, list[int]] | None = None
        # Rows 0..n-1 on the device: where a steady decode's pending tokens go.
        self._leading_rows = torch.arange(config.max_num_seqs, device=device)
        # Uniform decodes of a few sequences run as one fused operator call on a CPU, where
        # the model allows it (FusedDecode.build); on CUDA, full decode graphs are captured
        # for up to max_num_seqs sequences and, with piecewise graphs, pieces for the other
        # steps of up to max_num_batched_tokens tokens. Elsewhere every step runs eagerly.
        self.dispatcher = CudagraphDispatcher()
        if config.uses_fused_decode:
            self.dispatcher = CudagraphDispatcher(FusedDecode.build(model, self.kv_cache))
        elif config.uses_cuda_graphs:
            full = DecodeGraphs(
                model, self.kv_cache, config.max_num_seqs, max_model_len, block_size, capture=True
            )
            piecewise = None
            if config.uses_piecewise_graphs:
                piecewise = PiecewiseGraphs(
                    model, self.kv_cache, config.max_num_batched_tokens, capture=True
                )
            self.dispatcher = CudagraphDispatcher(full, piecewise)

    @staticmethod
    def kv_bytes_per_block(model_config, block_size: int, dtype: torch.dtype) -> int:
        kv_width = model_config.num_kv_heads * model_config.head_dim
        return 2 * model_config.n_layer * block_size * kv_width * dtype.itemsize

    def add_lora(self, request: LoRARequest) -> None:
        """Checks and loads a request's adapter; ParameterError naming what is wrong."""
        assert self.lora is not None, "LoRA requests reach an engine with enable_lora only"
        self.lora.add(request)

    def apply_changes(self, output: SchedulerOutput) -> None:
        """A step with nothing to run: the worker's rows still follow what the scheduler
        changed (sequences that ended, new or changed tables)."""
        self.input_batch.apply_changes(output)

    @torch.inference_mode()
    def execute_async(self, output: SchedulerOutput) -> StepFuture:
        """Launches one step; its results are read on the host when asked for (on CUDA the
        host goes on while the device works). A decode whose input token the previous step
        sampled takes it from that step's device tensor: no host round trip."""
        if output.blocks_to_copy:
            # Before the step stores any K/V: a copy must see the block as it was.
            pairs = np.array(output.blocks_to_copy, dtype=np.int64)
            self.backend.copy_blocks(self.kv_cache, on_device(pairs, self.device))
        batch = self.input_batch.prepare(output)
        uniform_decode = batch.is_uniform_decode
        hidden = self._forward(batch, uniform_decode)
        prompt_logprobs = self._prompt_logprobs(hidden, batch)
        sampled = candidates = None
        if len(batch.logits_rows):  # else a step of prefill chunks that sample nothing yet
            if not uniform_decode:  # a uniform decode's rows are its logits rows, in order
                hidden = hidden[on_device(batch.logits_rows, self.device)]
            logits = self.model.compute_logits(hidden)
            num_sampled = len(batch.sampling)
            sampled = self.sampler(logits[:num_sampled], batch.sampling) if num_sampled else None
            if batch.beam_seq_ids:
                logprobs = torch.log_softmax(logits[num_sampled:].float(), dim=-1)
                self._mask_constrained_beams(logprobs, batch.beam_seq_ids)
                candidates = logprobs.topk(min(batch.beam_top_k, logprobs.shape[1]))
        self._last_sampled = None if sampled is None else (sampled.token_ids, batch.sampled_seq_ids)
        record = self.input_batch.record_sampled
        return StepFuture(batch, sampled, candidates, prompt_logprobs, record)

    def _mask_constrained_beams(self, logprobs: torch.Tensor, beam_seq_ids: list[int]) -> None:
        """Leaves each constrained beam only the tokens its grammar allows next, after the
        log-softmax, as Hugging Face applies a logits processor in beam search."""
        matchers = self.input_batch.beam_matchers
        rows = [i for i, seq_id in enumerate(beam_seq_ids) if seq_id in matchers]
        if rows:
            states = [matchers[beam_seq_ids[i]] for i in rows]
            self.input_batch.grammars.apply_masks(logprobs, np.array(rows), states)

    def _prompt_logprobs(self, hidden: torch.Tensor, batch: HostBatch) -> dict[int, TopLogprobs]:
        """Each span's prompt-token log-probabilities and best tokens, from the step's hidden
        states [T, D], reduced PROMPT_LOGPROBS_ROWS_PER_PASS rows at a time: a whole prompt's
        [rows, vocab] logits are never held at once."""
        found: dict[int, TopLogprobs] = {}
        for span in batch.prompt_logprobs:
            parts = []
            for at in range(0, len(span.rows), PROMPT_LOGPROBS_ROWS_PER_PASS):
                end = at + PROMPT_LOGPROBS_ROWS_PER_PASS
                # Plain (blocking) copies: several passes in one step would overwrite a
                # pinned staging buffer that a non-blocking copy may still be reading.
                rows = torch.as_tensor(span.rows[at:end], device=self.device)
                targets = torch.as_tensor(span.targets[at:end], device=self.device)
                logits = self.model.compute_logits(hidden[rows]).float()
                logprobs = torch.log_softmax(logits, dim=-1)
                chosen = logprobs.gather(1, targets[:, None])
                ranks = (logprobs > chosen).sum(dim=-1) + 1  # 1 = the most likely token
                top = logprobs.topk(min(span.num_top, logprobs.shape[1]), dim=-1)
                parts.append((targets, chosen.squeeze(1), ranks, top.values, top.indices))
            found[span.seq_id] = TopLogprobs(*(torch.cat(p) for p in zip(*parts, strict=True)))
        return found

    def _pending_inputs(self, batch: HostBatch) -> PendingInputs | None:
        """Where the step's unknown input tokens go and where the previous step left them."""
        if not batch.pending_seq_ids:
            return None
        assert self._last_sampled is not None, "a pending input token but no previous sample"
        tokens, seq_ids = self._last_sampled
        rows, pending = batch.pending_rows, batch.pending_seq_ids
        if pending == seq_ids and rows[-1] == len(rows) - 1:
            # The steady state: the sequences the last step sampled, in its order, lead the
            # step (rows are increasing, so the last one places them all): no copy, no gather.
            return PendingInputs(self._leading_rows[: len(rows)], tokens)
        row_of = {seq_id: row for row, seq_id in enumerate(seq_ids)}
        sources = np.array([row_of[s] for s in pending], dtype=np.int64)
        return PendingInputs(on_device(rows, self.device), tokens[on_device(sources, self.device)])

    def _forward(self, batch: HostBatch, uniform_decode: bool) -> torch.Tensor:
        """The step's hidden states [tokens, C], run the way the dispatcher chooses."""
        pending = self._pending_inputs(batch)
        if self.lora is not None:
            self.lora.prepare(batch.token_lora_ids, self.device)
        mode = self.dispatcher.dispatch(
            len(batch.input_ids), uniform_decode, batch.decodes_share_sequences
        )
        if mode is CUDAGraphMode.FULL:
            assert self.dispatcher.full is not None
            return self.dispatcher.full.run(batch, pending)
        metadata = self.backend.prepare(batch.attention_metadata(self.device, self.block_size))
        input_ids = on_device(batch.input_ids, self.device)
        if pending is not None:
            input_ids = input_ids.index_copy(0, pending.rows, pending.tokens)
        positions = on_device(batch.positions, self.device)
        if mode is CUDAGraphMode.PIECEWISE:
            assert self.dispatcher.piecewise is not None
            return self.dispatcher.piecewise.forward(input_ids, positions, metadata)
        return self.model(input_ids, positions, self.kv_cache, metadata)


def allocate_kv_cache(
    config: GPT2Config, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The model's paged K/V cache, [n_layer, 2, num_blocks, block_size, num_kv_heads,
    head_dim], zeroed: so resident from the start (as vLLM's), the process holding the memory
    its cache was sized to from startup on. torch.empty's pages would be committed only when
    first written, and the prefix cache keeps every block it filled until the free ones run
    out: the process grew by a block for each block of new content until the whole cache was
    in memory."""
    shape = (config.n_layer, 2, num_blocks, block_size, config.num_kv_heads, config.head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)


@torch.inference_mode()
def profile_activation_bytes(
    config: EngineConfig, model: GPT2LMHeadModel, backend: AttentionBackend, max_model_len: int
) -> int:
    """Peak CUDA memory of the largest step beyond weights and KV cache: a prefill of
    `config.max_num_batched_tokens` tokens (as sequences of at most max_model_len) that
    samples `config.max_num_seqs` rows. The KV cache gets what is left after this."""
    device, block_size = model.wte.weight.device, config.block_size
    max_num_batched_tokens = config.max_num_batched_tokens
    full, rest = divmod(max_num_batched_tokens, max_model_len)
    lengths = np.array([max_model_len] * full + ([rest] if rest else []), dtype=np.int32)
    width = -(-max_model_len // block_size)
    table = 1 + np.arange(len(lengths) * width, dtype=np.int32).reshape(len(lengths), width)
    cache = allocate_kv_cache(
        model.config, 1 + table.size, block_size, model.wte.weight.dtype, device
    )
    inputs = StepInputs.build(
        np.zeros(max_num_batched_tokens, dtype=np.int64), np.zeros_like(lengths), lengths,
        table, np.arange(len(lengths)), block_size,
    )  # fmt: skip
    metadata = backend.prepare(inputs.attention_metadata(device, block_size))
    input_ids, positions = on_device(inputs.input_ids, device), on_device(inputs.positions, device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    hidden = model(input_ids, positions, cache, metadata)
    rows = torch.arange(config.max_num_seqs, device=device) % hidden.shape[0]
    torch.log_softmax(model.compute_logits(hidden[rows]).float(), dim=-1)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del cache, hidden
    torch.cuda.empty_cache()
    return peak
