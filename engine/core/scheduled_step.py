"""A scheduled step as the engine core sees it: the worker's input beside, per scheduled
sequence, the core objects its results apply to (the scheduler makes it, the step updater
applies it, the request queue charges it)."""

from __future__ import annotations

from dataclasses import dataclass

from octavo.engine.core.sequence import Sequence, SequenceGroup
from octavo.engine.step_io import PromptLogprobsSpan, SchedulerOutput

# A scheduled sequence as the core sees it: (its group, itself, the sequences sampled from its
# last position: none, itself, or itself and the samples forked off it). Plain tuples, read by
# unpacking: a tuple subclass (a NamedTuple) unpacks through the generic iterator path, and
# these are unpacked for every sequence of every step.
CoreEntry = tuple[SequenceGroup, Sequence, tuple[Sequence, ...]]
# How a sequence is scheduled: (the ids of the sequences sampled from it, its core entry).
SampleRow = tuple[tuple[int, ...], CoreEntry]


@dataclass
class ScheduledStep:
    """A step as the core sees it: the worker's input (`output`) and, for each sequence it
    schedules, in the same order, the core objects its results apply to (`entries`: the
    group, the sequence, the sequences sampled from it). `preempted`: the groups preempted to
    make room for it."""

    output: SchedulerOutput
    entries: list[CoreEntry]
    preempted: list[SequenceGroup]


# A scheduled sequence's fields in ScheduledSequence's order, a decode's without the trailing
# defaults: both ways a sequence is scheduled write them, and `schedule` makes every
# ScheduledSequence of the step from them in one place.
ScheduledFields = (
    tuple[int, int, int, list[int], tuple[int, ...]]
    | tuple[int, int, int, list[int], tuple[int, ...], int, PromptLogprobsSpan | None, int]
)
