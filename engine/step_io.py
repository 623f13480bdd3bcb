"""The core <-> worker boundary of one step: what the scheduler asks the model runner to
compute (`SchedulerOutput`) and what comes back (`ModelRunnerOutput`).

Data only, ids and diffs (vLLM's NewRequestData / CachedRequestData): the worker never sees a
core object. It keeps what it needs across steps itself: a block-table row per sequence,
rewritten from the tables this contract carries when they change, and the sampling state of
each sequence it samples for, built from `NewSampledSequence` and dropped when the sequence is
listed finished. Every row of a runner output names the sequence it belongs to, so the
scheduler applies results by name instead of recounting rows in the runner's order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
import torch

from octavo.engine.core_messages import PromptLogprobs
from octavo.engine.sampling_params import SamplingParams


class PromptLogprobsSpan(msgspec.Struct, frozen=True):
    """Positions [start, end) of a scheduled chunk whose logits score the next prompt token
    (token p + 1 at position p, `targets[p - start]`), each with the `num_top` most likely
    tokens there."""

    start: int
    end: int
    num_top: int
    targets: list[int]


class NewSampledSequence(msgspec.Struct, frozen=True, gc=False):
    """A sequence the worker samples for the first time (a prompt's end, or a sample forked
    off it): its request's parameters, its prompt (repetition penalty), its place among the
    request's samples (a seeded request's sample i draws from seed + i), its stop tokens
    (kept from being drawn before min_tokens), and its structured-output grammar and bad
    words' token ids (the front end's, from the params). The worker keeps the state this
    starts, through preemption, until the sequence is listed finished."""

    seq_id: int
    params: SamplingParams
    prompt_token_ids: list[int]
    sample_index: int
    stop_token_ids: list[int]
    grammar: str | None = None
    bad_words_token_ids: list[list[int]] = []


class BeamChoice(msgspec.Struct, frozen=True, gc=False):
    """A live beam of a constrained beam search after a step: sequence `seq_id` continues
    beam `parent_seq_id` (itself, or the beam it forked off) with `token_id`. The worker's
    grammar state of the beam is the parent's, advanced by the token."""

    seq_id: int
    parent_seq_id: int
    token_id: int


# gc=False: one per scheduled sequence per step, never in a cycle (see SampleDelta).
class ScheduledSequence(msgspec.Struct, frozen=True, gc=False):
    """One sequence's work in a step: positions [start, start + num_new_tokens).

    `input_token_ids` are the tokens at those positions that the core knows: all of them,
    except for a decode whose input token the previous step sampled and the core has not
    received yet (async scheduling): empty then, and the worker takes it from the device.
    `sample_seq_ids`: the sequences sampled from the last computed position (this one, or this
    one and the samples forked off it this step: an n > 1 prompt is computed once and sampled
    n times). `beam_top_k` > 0: the position feeds beam search, which needs this many best
    next tokens. `prompt_logprobs`: the positions of the chunk whose prompt-token
    log-probabilities the request asked for. `num_draft_tokens` > 0: the chunk's last
    tokens are that many draft tokens (speculative decoding); the sequence is sampled at each
    of its last num_draft_tokens + 1 positions, one row each, in order, and the core keeps
    the tokens its drafts lead to.

    A msgspec Struct, never encoded: one is made for every sequence of every step, and its C
    constructor costs half a dataclass's.
    """

    seq_id: int
    start: int
    num_new_tokens: int
    input_token_ids: list[int]
    sample_seq_ids: tuple[int, ...] = ()
    beam_top_k: int = 0
    prompt_logprobs: PromptLogprobsSpan | None = None
    num_draft_tokens: int = 0


@dataclass
class SchedulerOutput:
    """A step's plan: sequences with one query token come first (the decode fast path), with
    those that carry a draft (the worker verifies a draft as one decode per position).

    `blocks_to_copy`: copy-on-write (src, dst) block pairs to copy before any K/V is stored.
    `block_tables`: the whole table of each sequence whose table was created or changed since
    the previous step (copies; the worker keeps the others from earlier steps).
    `new_sampled`: sequences sampled for the first time this step.
    `freed_seq_ids`: sequences whose blocks were freed since the previous step (finished,
    aborted, preempted, pruned beams): the worker drops their rows first.
    `finished_seq_ids`: sequences that ended since the previous step: the worker drops
    everything it kept of them (a preempted sequence is freed, not finished).
    `new_constrained_beams`: the grammar of each constrained beam search's first beam,
    scheduled for the first time; `beam_choices`: the beams such searches continue with
    after their last step (applied before `finished_seq_ids`, which lists the beams pruned).
    """

    scheduled: list[ScheduledSequence]
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    block_tables: dict[int, list[int]] = field(default_factory=dict)
    new_sampled: list[NewSampledSequence] = field(default_factory=list)
    freed_seq_ids: list[int] = field(default_factory=list)
    finished_seq_ids: list[int] = field(default_factory=list)
    new_constrained_beams: dict[int, str] = field(default_factory=dict)
    beam_choices: list[BeamChoice] = field(default_factory=list)
    # The LoRA adapter of each sequence in `block_tables` that runs with one (the worker
    # keeps it with the sequence's row).
    lora_int_ids: dict[int, int] = field(default_factory=dict)
    has_prompt_logprobs: bool = False  # some sequence has a PromptLogprobsSpan
    num_draft_tokens: int = 0  # of all scheduled sequences (0: each samples once at most)


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
class GrammarProgress:
    """What a step's tokens did to the structured-output grammars of their sequences: the
    sequences whose grammar is complete (they finish with "stop"), and those whose grammar
    refused the token (the request's other controls left no token the grammar allows),
    with llguidance's message (their requests fail)."""

    ended: set[int] = field(default_factory=set)
    failed: dict[int, str] = field(default_factory=dict)


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
    grammar: GrammarProgress = field(default_factory=GrammarProgress)
