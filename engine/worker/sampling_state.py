"""What the worker keeps of each sequence it samples for."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from llguidance import LLMatcher

from octavo.engine.sampling_params import SamplingParams
from octavo.engine.step_io import NewSampledSequence
from octavo.engine.worker.grammar import GrammarMatchers


@dataclass(eq=False, slots=True)
class SamplingState:
    """One sampled sequence's state, from its first sampled step until the scheduler lists it
    finished (a preempted sequence keeps it: its seeded draws go on where they stopped).

    `output_token_ids` holds the tokens that reached the host, kept only when
    `bad_words_token_ids` read them; requests with those never run a step ahead, so every
    earlier token is there when a row is sampled (penalties read counts kept on the device
    instead: `PenaltyCounts`). `matcher`: where a constrained
    sequence is in its grammar, advanced by every token that reaches the host (such requests
    never run a step ahead either). Its parameters, and the count of rows sampled for it, are
    in the input batch's `SamplingColumns`, at `slot`.
    """

    params: SamplingParams
    prompt_token_ids: list[int]
    stop_token_ids: list[int]
    generator: torch.Generator | None
    keeps_outputs: bool
    matcher: LLMatcher | None = None
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    slot: int = -1

    @classmethod
    def create(
        cls, new: NewSampledSequence, device: torch.device, grammars: GrammarMatchers
    ) -> SamplingState:
        params = new.params
        generator = None
        if params.seed is not None:  # vLLM seeds parallel samples seed + index
            generator = torch.Generator(device=device).manual_seed(params.seed + new.sample_index)
        words = new.bad_words_token_ids
        matcher = None if new.grammar is None else grammars.matcher(new.grammar)
        return cls(
            params, new.prompt_token_ids, new.stop_token_ids, generator, bool(words), matcher,
            words,
        )  # fmt: skip
