"""Sampling with drafts keeps the model's distribution: the scheduler's acceptance rule under
a model whose next-token distribution is known (a Markov chain over a few tokens, each row
sampled from the row's own input token, as the worker samples each verified position).

Speculated outputs against plain ones are as close as two plain runs with different seeds
are to each other; a scheduler that keeps every draft (the mutation) is far from both."""

import collections
import random

import pytest

from octavo.engine.core.block_manager import BlockManager
from octavo.engine.core.scheduler import Scheduler, SchedulerConfig
from octavo.engine.core.sequence import Sequence, SequenceGroup
from octavo.engine.core.step_updater import StepUpdater
from octavo.engine.core.stop_checker import StopChecker
from octavo.engine.sampling_params import SamplingParams
from octavo.engine.step_io import ModelRunnerOutput, SamplerOutput

VOCAB = 4
# The chain: from token u, the next token is (u + 1) % VOCAB with probability 0.6, each
# other with 0.4 / 3. Drafts guess the likeliest path, so about 60% of draft tokens hold.
LIKELY = 0.6
NUM_REQUESTS = 1500
MAX_TOKENS = 8
NUM_DRAFT = 3


def next_token(u: int, rng: random.Random) -> int:
    if rng.random() < LIKELY:
        return (u + 1) % VOCAB
    return rng.choice([t for t in range(VOCAB) if t != (u + 1) % VOCAB])


def generate(seed: int, drafts: bool) -> list[list[int]]:
    """NUM_REQUESTS outputs of the chain through the scheduler, with drafts of NUM_DRAFT
    likeliest tokens or none."""
    rng = random.Random(seed)
    scheduler = Scheduler(SchedulerConfig(256, 4096, 1), BlockManager(4096, 4), StopChecker([99]))
    groups = []
    for i in range(NUM_REQUESTS):
        params = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        prompt = [i % VOCAB]
        group = SequenceGroup(
            str(i), prompt, params, arrival_time=0.0, stop_token_ids=frozenset(),
            max_num_tokens=1 + MAX_TOKENS, num_speculative_tokens=NUM_DRAFT if drafts else 0,
        )  # fmt: skip
        group.seqs.append(Sequence(scheduler.new_seq_id(), prompt))
        scheduler.add(group)
        groups.append(group)
    while scheduler.has_unfinished():
        for group in scheduler.running:
            seq = group.seqs[0]
            room = group.max_num_tokens - len(seq.token_ids) - 1
            if group.num_speculative_tokens and room > 0:
                last = seq.token_ids[-1]
                seq.spec_token_ids = [
                    (last + j) % VOCAB for j in range(1, min(NUM_DRAFT, room) + 1)
                ]
        out = scheduler.schedule()
        seq_ids, tokens = [], []
        for item in out.output.scheduled:
            if not item.sample_seq_ids:
                continue
            # One row per computed position that is sampled: each draft position, or the last.
            inputs = item.input_token_ids[-(item.num_draft_tokens + 1) :]
            for u in inputs:
                seq_ids.append(item.seq_id)
                tokens.append(next_token(u, rng))
        rows = len(tokens)
        scheduler.update(
            out, ModelRunnerOutput(seq_ids, SamplerOutput(tokens, [None] * rows, [None] * rows))
        )
    return [g.seqs[0].token_ids[1:] for g in groups]


def pairs(outputs: list[list[int]]) -> collections.Counter:
    """How often each (position, token, next token) occurs: a token's law given the one
    before it, which a wrongly kept draft breaks."""
    return collections.Counter(
        (p, out[p], out[p + 1]) for out in outputs for p in range(len(out) - 1)
    )


def distance(a: collections.Counter, b: collections.Counter) -> float:
    """Total variation distance of two histograms of equal mass."""
    total = sum(a.values())
    return sum(abs(a[k] - b[k]) for k in set(a) | set(b)) / (2 * total)


@pytest.fixture(scope="module")
def plain_runs():
    return pairs(generate(0, drafts=False)), pairs(generate(1, drafts=False))


def test_drafted_samples_have_the_plain_distribution(plain_runs):
    first, second = plain_runs
    spread = distance(first, second)
    outputs = generate(2, drafts=True)
    assert all(len(out) == MAX_TOKENS for out in outputs)
    assert distance(pairs(outputs), first) < 1.5 * spread + 0.01


def test_keeping_every_draft_is_caught(plain_runs, monkeypatch):
    first, second = plain_runs
    spread = distance(first, second)
    keep_drafted = StepUpdater._keep_drafted

    def keeps_every_draft(self, group, seq, row, result):
        # The mutation: the worker's rows say the model chose every draft token.
        tokens = result.sampled.token_ids
        for offset, draft in enumerate(seq.spec_token_ids):
            tokens[row + offset] = draft
        return keep_drafted(self, group, seq, row, result)

    monkeypatch.setattr(StepUpdater, "_keep_drafted", keeps_every_draft)
    assert distance(pairs(generate(2, drafts=True)), first) > 3 * spread + 0.05
