"""InputBatch: the persistent rows give exactly the inputs a from-scratch build gives, step
after step, through chunked prefill, n > 1 forks (copy-on-write), preemption and frees."""

import itertools

import numpy as np
import torch

from octavo.engine.core.block_manager import BlockManager
from octavo.engine.core.scheduled_step import ScheduledStep
from octavo.engine.core.scheduler import Scheduler, SchedulerConfig
from octavo.engine.core.sequence import Sequence, SequenceGroup
from octavo.engine.core.stop_checker import StopChecker
from octavo.engine.sampling_params import SamplingParams
from octavo.engine.step_io import ModelRunnerOutput, SamplerOutput
from octavo.engine.stop_rules import length_limit
from octavo.engine.worker.grammar import GrammarMatchers
from octavo.engine.worker.input_batch import InputBatch

BLOCK_SIZE = 4
MAX_MODEL_LEN = 64
VOCAB = 32  # no test here samples with a penalty: the counts stay unallocated


def naive_inputs(step: ScheduledStep, bm: BlockManager) -> dict[str, list]:
    """The step's inputs built from scratch, straight from the core's sequences and the
    BlockManager's tables."""
    ids, positions, slots, seq_lens, tables, rows = [], [], [], [], [], []
    for item, (_, seq, _) in zip(step.output.scheduled, step.entries, strict=True):
        table = bm.block_tables[item.seq_id]
        end = item.start + item.num_new_tokens
        for p in range(item.start, end):
            ids.append(seq.token_ids[p])
            positions.append(p)
            slots.append(table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
            if p == end - 1:
                rows += [len(ids) - 1] * (len(item.sample_seq_ids) + (item.beam_top_k > 0))
        seq_lens.append(end)
        tables.append(list(table))
    return {"ids": ids, "positions": positions, "slots": slots, "seq_lens": seq_lens,
            "tables": tables, "rows": rows}  # fmt: skip


def test_persistent_rows_match_a_from_scratch_build_every_step():
    bm = BlockManager(14, BLOCK_SIZE)  # small enough to force preemptions
    scheduler = Scheduler(SchedulerConfig(6, 10), bm, StopChecker([]))
    # Two rows to start: the n > 1 requests make the table grow.
    grammars = GrammarMatchers(None, vocab_size=0, eos_token_id=None)  # nothing constrained
    batch = InputBatch(2, MAX_MODEL_LEN, BLOCK_SIZE, VOCAB, torch.device("cpu"), grammars)
    tokens = itertools.count(100)
    for i, (prompt_len, n, max_tokens) in enumerate(
        [(9, 1, 12), (3, 3, 7), (14, 2, 5), (5, 1, 20)]
    ):
        prompt = list(range(1, prompt_len + 1))
        # Parameters that differ per request: the step's columns must follow the rows.
        params = SamplingParams(
            temperature=0.25 * i, top_k=i, n=n, max_tokens=max_tokens, ignore_eos=True
        )
        limit = length_limit(prompt_len, max_tokens, MAX_MODEL_LEN)
        group = SequenceGroup(str(i), prompt, params, 0.0, frozenset(), limit)
        group.seqs.append(Sequence(scheduler.new_seq_id(), prompt))
        scheduler.add(group)
    steps = preempted = 0
    while scheduler.has_unfinished():
        step = scheduler.schedule()
        output = step.output
        preempted += len(step.preempted)
        host = batch.prepare(output)
        want = naive_inputs(step, bm)
        assert host.input_ids.tolist() == want["ids"]
        assert host.positions.tolist() == want["positions"]
        assert host.slot_mapping.tolist() == want["slots"]
        assert host.seq_lens.tolist() == want["seq_lens"]
        assert host.query_lens.tolist() == [s.num_new_tokens for s in output.scheduled]
        assert host.cu_seqlens_q.tolist() == [0, *np.cumsum(host.query_lens).tolist()]
        for table, row in zip(want["tables"], host.block_tables.tolist(), strict=True):
            assert row[: len(table)] == table
        assert host.logits_rows.tolist() == want["rows"]
        assert host.sampled_seq_ids == [
            seq.seq_id for _, _, samples in step.entries for seq in samples
        ]
        # The worker samples each sequence with its own request's parameters, whose
        # columns (in slots reused and grown across steps) follow the rows.
        row_params = [g.sampling_params for g, _, samples in step.entries for _ in samples]
        assert [r.params for r in host.sampling.states] == row_params
        assert host.sampling.temperature.tolist() == [p.temperature for p in row_params]
        assert host.sampling.top_k.tolist() == [p.top_k for p in row_params]
        assert host.sampling.greedy.tolist() == [p.temperature == 0 for p in row_params]
        assert batch.num_rows_in_use <= len(bm.block_tables)
        sampled = SamplerOutput(
            [next(tokens) for _ in host.sampled_seq_ids],
            [0.0] * len(host.sampled_seq_ids),
            [None] * len(host.sampled_seq_ids),
        )
        scheduler.update(step, ModelRunnerOutput(host.sampled_seq_ids, sampled))
        steps += 1
    assert steps > 10 and preempted > 0 and len(batch.block_table) > 2
    # Every sequence's row went back once its blocks were freed, and its sampling state once
    # it finished.
    batch.apply_changes(scheduler.schedule().output)
    assert batch.num_rows_in_use == 0 and batch.sampling == {}
