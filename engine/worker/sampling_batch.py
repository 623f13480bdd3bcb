"""The sampling parameters of the worker's sequences, column by column, and one step's rows
of them as arrays: the sampler reads a batch's parameters without a loop over its rows."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

from octavo.engine.worker.sampling_state import SamplingState

if TYPE_CHECKING:  # the penalties module imports the sampler, which imports this one
    from octavo.engine.worker.penalties import PenaltyCounts

NO_LOGPROBS = -1  # `num_top` of a row that asked for no log-probabilities
# The largest value a float32 column holds. A larger finite parameter (temperature 1e308:
# every token alike) would become inf there, and inf against a zero or masked logit is NaN,
# which the draw then picks: the column keeps this instead, which means the same.
FLOAT32_MAX = float(np.finfo(np.float32).max)
# The smallest positive normal float32: a top_p below it would read as 0 there and mask even
# the top token (whose mass before it is exactly 0), leaving nothing to draw.
FLOAT32_TINY = float(np.finfo(np.float32).tiny)


class _Column:
    """A SamplingBatch attribute gathered when first read and kept on the batch: the step's
    rows of the column of its name or, with `rows_of`, the indices of the step's rows whose
    flag in column `rows_of` is set."""

    def __init__(self, rows_of: str | None = None):
        self.rows_of = rows_of

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, batch: SamplingBatch, owner: type | None = None) -> np.ndarray:
        rows = getattr(batch.columns, self.rows_of or self.name)[batch.slots]
        if self.rows_of is not None:
            rows = np.flatnonzero(rows)
        batch.__dict__[self.name] = rows  # a non-data descriptor: the next read is the value
        return rows


@dataclass(eq=False)
class SamplingBatch:
    """One step's sampled rows, in row order: per-row parameters as arrays ([R]), gathered
    from the columns when first read (a step of plain greedy rows reads one), and the rows'
    states (`states`), which the work that is a row's own reads (its logits processing, its
    seeded draws), and the device-side token counts of penalized rows (`penalties`, at
    `slots`).

    `num_top`: the top log-probabilities each row returns (NO_LOGPROBS: none; 0: only the
    sampled token's, for best_of ranking). `num_sampled`: the rows sampled for each row's
    sequence so far, this one included (tokens known and in flight: min_tokens counts
    both). `processed_rows` / `seeded_rows` / `constrained_rows`: the rows whose logits are
    processed one by one (masks, biases) / that draw from their own generator / that a
    grammar constrains. `penalized_rows`: the rows with a repetition, frequency or presence
    penalty, applied to all of them at once.
    """

    greedy = _Column()
    temperature = _Column()
    top_k = _Column()
    top_p = _Column()
    min_p = _Column()
    num_top = _Column()
    num_sampled = _Column()
    repetition_penalty = _Column()
    frequency_penalty = _Column()
    presence_penalty = _Column()
    processed_rows = _Column(rows_of="processes_logits")
    penalized_rows = _Column(rows_of="penalized")
    seeded_rows = _Column(rows_of="seeded")
    constrained_rows = _Column(rows_of="constrained")

    states: list[SamplingState]
    slots: np.ndarray
    columns: _Columns
    penalties: PenaltyCounts

    def __len__(self) -> int:
        return len(self.states)

    @cached_property
    def all_plain_greedy(self) -> bool:
        return bool(self.columns.plain_greedy[self.slots].all())


class SamplingColumns:
    """Each sampled sequence's parameters in a slot of preallocated arrays, written once when
    its state is created (`add`) and freed with it (`remove`); a penalized sequence's token
    counts in the same slot of `penalties`."""

    def __init__(self, capacity: int, penalties: PenaltyCounts):
        self._columns = _Columns(capacity)
        self._free = list(range(capacity - 1, -1, -1))
        self.penalties = penalties

    def add(self, state: SamplingState) -> int:
        """Writes `state`'s parameters into a free slot; returns the slot."""
        if not self._free:
            old = len(self._columns.greedy)
            self._columns = self._columns.grown()
            self._free = list(range(len(self._columns.greedy) - 1, old - 1, -1))
        slot = self._free.pop()
        self._columns.write(slot, state)
        if state.params.has_penalties:
            self.penalties.reset(slot, len(self._columns.greedy), state.prompt_token_ids)
        return slot

    def remove(self, slot: int) -> None:
        self._free.append(slot)

    def gather(self, states: list[SamplingState]) -> SamplingBatch:
        """The rows `states` of a step, in order, as arrays; counts one more row sampled
        for each (a sequence has one row a step at most)."""
        slots = np.fromiter((s.slot for s in states), dtype=np.int64, count=len(states))
        self._columns.num_sampled[slots] += 1
        return SamplingBatch(states, slots, self._columns, self.penalties)


class _Columns:
    """The arrays themselves, one entry per slot."""

    def __init__(self, capacity: int):
        self.greedy = np.zeros(capacity, dtype=bool)
        self.plain_greedy = np.zeros(capacity, dtype=bool)
        self.processes_logits = np.zeros(capacity, dtype=bool)
        self.penalized = np.zeros(capacity, dtype=bool)
        self.seeded = np.zeros(capacity, dtype=bool)
        self.constrained = np.zeros(capacity, dtype=bool)
        self.temperature = np.zeros(capacity, dtype=np.float32)
        self.top_k = np.zeros(capacity, dtype=np.int64)
        self.top_p = np.zeros(capacity, dtype=np.float32)
        self.min_p = np.zeros(capacity, dtype=np.float32)
        self.num_top = np.zeros(capacity, dtype=np.int64)
        self.num_sampled = np.zeros(capacity, dtype=np.int64)
        self.repetition_penalty = np.zeros(capacity, dtype=np.float32)
        self.frequency_penalty = np.zeros(capacity, dtype=np.float32)
        self.presence_penalty = np.zeros(capacity, dtype=np.float32)

    def grown(self) -> _Columns:
        """A copy with twice the slots."""
        grown = _Columns(2 * len(self.greedy))
        for name, column in vars(self).items():
            getattr(grown, name)[: len(column)] = column
        return grown

    def write(self, slot: int, state: SamplingState) -> None:
        params = state.params
        self.greedy[slot] = params.greedy
        self.plain_greedy[slot] = params.is_plain_greedy
        self.processes_logits[slot] = params.processes_logits
        self.penalized[slot] = params.has_penalties
        self.repetition_penalty[slot] = min(params.repetition_penalty, FLOAT32_MAX)
        self.frequency_penalty[slot] = params.frequency_penalty
        self.presence_penalty[slot] = params.presence_penalty
        self.seeded[slot] = state.generator is not None
        self.constrained[slot] = state.matcher is not None
        self.num_sampled[slot] = 0
        self.temperature[slot] = min(params.temperature, FLOAT32_MAX)
        self.top_k[slot] = params.top_k
        self.top_p[slot] = max(params.top_p, FLOAT32_TINY)
        self.min_p[slot] = params.min_p
        # Log-probabilities cost a pass over the vocabulary: only for rows that ask (as in
        # vLLM, a request without `logprobs` gets no cumulative_logprob either), and for
        # best_of > n, whose samples are ranked by their tokens' logprobs.
        if params.logprobs is not None:
            self.num_top[slot] = params.logprobs
        else:
            self.num_top[slot] = 0 if params.ranks_samples else NO_LOGPROBS
