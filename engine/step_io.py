"""The core <-> worker boundary of one step: what the scheduler asks the model runner to
compute (`SchedulerOutput`) and what comes back (`ModelRunnerOutput`).

The worker reads only the fields documented as its own: token ids, positions, block tables
and, per sampling row, the request's parameters. It never touches the BlockManager. Every row
of a runner output names the sequence it belongs to, so the scheduler applies results by
name instead of recounting rows in the runner's order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
import torch

from octavo.engine.core.sequence import Sequence, SequenceGroup
from octavo.engine.core_messages import PromptLogprobs
from octavo.engine.sampling_params import SamplingParams


@dataclass(slots=True)
class SamplingRequest:
    """One row of logits to sample: the sequence that receives the token and its request's
    parameters (the sampler reads its generator, output count and tokens for penalties)."""

    params: SamplingParams
    seq: Sequence


class PromptLogprobsSpan(msgspec.Struct, frozen=True):
    """Positions [start, end) of a scheduled chunk whose logits score the next prompt token
    (token p + 1 at position p), each with the `num_top` most likely tokens there."""

    start: int
    end: int
    num_top: int


# gc=False: one per scheduled sequence per step, never in a cycle (see SampleDelta).
class ScheduledSequence(msgspec.Struct, frozen=True, gc=False):
    """One sequence's work in a step: tokens [start, start + num_new_tokens) of `token_ids`.

    Worker fields: `seq_id`, `token_ids` (the sequence's list, read-only; with async
    scheduling a decode's input token at `start` may not be in it yet: the previous step
    sampled it and the worker takes it from the device), `start`,
    `num_new_tokens`, `block_table` (the BlockManager's table of the sequence, read-only and
    valid for this step), `samples` (the rows sampled from the last computed position: `seq`
    itself, or `seq` and the children forked from it this step -- an n > 1 prompt is computed
    once and sampled n times) and `beam_top_k` (> 0: the position feeds beam search, which
    needs this many best next tokens), `prompt_logprobs` (positions of the chunk whose
    prompt-token log-probabilities the request asked for). Core fields: `group`, `seq`.

    A msgspec Struct, never encoded: one is made for every sequence of every step, and its
    C constructor costs half a dataclass's.
    """

    seq_id: int
    token_ids: list[int]
    start: int
    num_new_tokens: int
    block_table: list[int]
    samples: tuple[SamplingRequest, ...]
    beam_top_k: int
    group: SequenceGroup
    seq: Sequence
    prompt_logprobs: PromptLogprobsSpan | None = None

    @property
    def sample_seqs(self) -> list[Sequence]:
        return [s.seq for s in self.samples]


@dataclass
class SchedulerOutput:
    """A step's plan: sequences with one query token come first (the decode fast path).

    `blocks_to_copy`: copy-on-write (src, dst) block pairs to copy before any K/V is stored.
    `changed_seq_ids`: sequences whose block tables were created or changed since the
    previous step (the worker rereads those tables; the others it keeps from earlier steps).
    `freed_seq_ids`: sequences whose blocks were freed since the previous step (finished,
    aborted, preempted, pruned beams): the worker drops their rows first.
    """

    scheduled: list[ScheduledSequence]
    blocks_to_copy: list[tuple[int, int]]
    changed_seq_ids: set[int] = field(default_factory=set)
    freed_seq_ids: list[int] = field(default_factory=list)
    preempted: list[SequenceGroup] = field(default_factory=list)
    has_prompt_logprobs: bool = False  # some sequence has a PromptLogprobsSpan

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SamplerOutput:
    """Per row: the sampled token, and when its request asked for logprobs the token's
    log-probability and the top-N map (None otherwise)."""

    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[dict[int, float] | None]


@dataclass
class BeamCandidates:
    """Per beam-search row, its `k` most likely next tokens, best first, on the host.

    Adding a beam's running score does not reorder its own tokens, so the best candidates
    over all beams of a group are among each beam's top `k` whenever `k` is at least the
    group's candidates per step plus its stop tokens (which min_tokens may mask out). The
    runner reduces on the device and moves only these [rows, k] tensors, not [rows, vocab].
    """

    logprobs: torch.Tensor  # float32 [num_beam_rows, k], log_softmax of the logits
    token_ids: torch.Tensor  # int64 [num_beam_rows, k]

    def rows(self, index: list[int]) -> BeamCandidates:
        return BeamCandidates(self.logprobs[index], self.token_ids[index])


@dataclass
class ModelRunnerOutput:
    """A step's results. Row i of `sampled` is the token of sequence `sampled_seq_ids[i]`;
    row j of `beam_candidates` holds the best next tokens of beam `beam_seq_ids[j]` (beam
    search ranks candidates across a group's beams itself)."""

    sampled_seq_ids: list[int]
    sampled: SamplerOutput
    beam_seq_ids: list[int] = field(default_factory=list)
    beam_candidates: BeamCandidates | None = None
    # Per sequence with a PromptLogprobsSpan this step: the span's log-probabilities.
    prompt_logprobs: dict[int, PromptLogprobs] = field(default_factory=dict)
