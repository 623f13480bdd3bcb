"""InputBatch: the persistent rows give exactly the inputs a from-scratch build gives, step
after step, through chunked prefill, n > 1 forks (copy-on-write), preemption and frees."""

import itertools

import numpy as np

from octavo.engine.core.block_manager import BlockManager
from octavo.engine.core.scheduler import Scheduler, SchedulerConfig
from octavo.engine.core.sequence import Sequence, SequenceGroup
from octavo.engine.core.stop_checker import StopChecker
from octavo.engine.sampling_params import SamplingParams
from octavo.engine.step_io import ModelRunnerOutput, SamplerOutput, SchedulerOutput
from octavo.engine.worker.input_batch import InputBatch

BLOCK_SIZE = 4
MAX_MODEL_LEN = 64


def naive_inputs(output: SchedulerOutput, bm: BlockManager) -> dict[str, list]:
    """The step's inputs built from scratch, straight from the BlockManager's tables."""
    ids, positions, slots, seq_lens, tables, rows = [], [], [], [], [], []
    for item in output.scheduled:
        table = bm.block_tables[item.seq_id]
        end = item.start + item.num_new_tokens
        for p in range(item.start, end):
            ids.append(item.token_ids[p])
            positions.append(p)
            slots.append(table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
            if p == end - 1:
                rows += [len(ids) - 1] * (len(item.samples) + (item.beam_top_k > 0))
        seq_lens.append(end)
        tables.append(list(table))
    return {"ids": ids, "positions": positions, "slots": slots, "seq_lens": seq_lens,
            "tables": tables, "rows": rows}  # fmt: skip


def test_persistent_rows_match_a_from_scratch_build_every_step():
    bm = BlockManager(14, BLOCK_SIZE)  # small enough to force preemptions
    scheduler = Scheduler(SchedulerConfig(6, 10), bm, StopChecker(MAX_MODEL_LEN, None))
    # Two rows to start: the n > 1 requests make the table grow.
    batch = InputBatch(2, MAX_MODEL_LEN, BLOCK_SIZE)
    tokens = itertools.count(100)
    for i, (prompt_len, n, max_tokens) in enumerate(
        [(9, 1, 12), (3, 3, 7), (14, 2, 5), (5, 1, 20)]
    ):
        prompt = list(range(1, prompt_len + 1))
        params = SamplingParams(temperature=0.0, n=n, max_tokens=max_tokens, ignore_eos=True)
        group = SequenceGroup(str(i), None, prompt, params, arrival_time=0.0)
        group.seqs.append(Sequence(scheduler.new_seq_id(), prompt))
        scheduler.add(group)
    steps = preempted = 0
    while scheduler.has_unfinished():
        output = scheduler.schedule()
        preempted += len(output.preempted)
        host = batch.prepare(output)
        want = naive_inputs(output, bm)
        assert host.input_ids.tolist() == want["ids"]
        assert host.positions.tolist() == want["positions"]
        assert host.slot_mapping.tolist() == want["slots"]
        assert host.seq_lens.tolist() == want["seq_lens"]
        assert host.query_lens.tolist() == [s.num_new_tokens for s in output.scheduled]
        assert host.cu_seqlens_q.tolist() == [0, *np.cumsum(host.query_lens).tolist()]
        for table, row in zip(want["tables"], host.block_tables.tolist(), strict=True):
            assert row[: len(table)] == table
        assert host.logits_rows.tolist() == want["rows"]
        assert host.sampled_seq_ids == [r.seq.seq_id for s in output.scheduled for r in s.samples]
        assert batch.num_rows_in_use <= len(bm.block_tables)
        sampled = SamplerOutput(
            [next(tokens) for _ in host.sampled_seq_ids],
            [0.0] * len(host.requests),
            [None] * len(host.requests),
        )
        scheduler.update(output, ModelRunnerOutput(host.sampled_seq_ids, sampled))
        steps += 1
    assert steps > 10 and preempted > 0 and len(batch.block_table) > 2
    # Every sequence's row went back once its blocks were freed.
    batch.prepare(SchedulerOutput([], [], *bm.take_changes()))
    assert batch.num_rows_in_use == 0
