"""Speculative decoding with a draft model: greedy tokens are HF's (the target's), token for
token, whatever the draft proposes; the target itself as draft is accepted throughout, a
smaller model in part; the draft writes through the target's block tables (lookahead slots
for its proposals), forgets sequences as they end, and a table short of slots or changed
under it only costs drafts."""

import shutil
from pathlib import Path

import pytest
import torch

from octavo.engine import EngineConfig, LLMEngine, SamplingParams
from octavo.engine.worker.draft_model import DraftModelProposer, DraftRequest
from tests.checkpoints import TinySpec, make_checkpoint, make_gpt_bigcode_checkpoint, sample_prompts
from tests.engine.helpers import hf_greedy, run_to_completion

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def one_layer_dir(tiny_model_dir, tmp_path_factory) -> str:
    """The tiny model's first layer alone: a smaller model of the same family and
    vocabulary, which agrees with the whole model part of the time."""
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(tiny_model_dir)
    model.transformer.h = model.transformer.h[:1]
    model.config.n_layer = 1
    folder = tmp_path_factory.mktemp("one_layer")
    model.save_pretrained(folder)
    shutil.copy(Path(tiny_model_dir) / "tokenizer.json", folder)
    return str(folder)


@pytest.fixture(scope="module")
def prompts(hf_tiny):
    return sample_prompts(10, 4, 60, hf_tiny.config.vocab_size, seed=9)


@pytest.fixture(scope="module")
def expected(hf_tiny, prompts):
    return [hf_greedy(hf_tiny, p, MAX_TOKENS) for p in prompts]


def engine_for(model_dir: str, draft_dir: str, k: int = 3, **overrides) -> LLMEngine:
    config = {
        "model": model_dir, "device": "cpu", "dtype": "float32", "num_blocks": 256,
        "block_size": 8, "async_scheduling": False,
        "speculative_config": {"model": draft_dir, "num_speculative_tokens": k},
    } | overrides  # fmt: skip
    return LLMEngine(EngineConfig(**config))


def tokens_of(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def assert_draft_cache_empty(engine: LLMEngine) -> None:
    drafter = engine.core.drafter
    assert drafter is not None
    assert drafter.num_sequences == 0
    block_manager = engine.core.block_manager
    block_manager.check_invariants()
    assert not block_manager.block_tables  # the lookahead slots went with their sequences


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"async_scheduling": True},
        # Chunked prefill: the draft catches up on a prompt over several steps too.
        {"max_num_batched_tokens": 12, "block_size": 4},
        # Preemption by recompute: 10 requests of up to 84 tokens (11 blocks) in 40 blocks.
        {"num_blocks": 40, "max_model_len": 96},
    ],
    ids=["plain", "async_scheduling", "chunked_prefill", "preemption"],
)
def test_the_target_as_its_own_draft_is_always_accepted(
    tiny_model_dir, prompts, expected, overrides
):
    engine = engine_for(tiny_model_dir, tiny_model_dir, **overrides)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert tokens_of(run_to_completion(engine, prompts, params)) == expected
    stats = engine.stats()
    assert stats.num_draft_tokens > 0
    assert stats.num_accepted_tokens == stats.num_draft_tokens
    if "num_blocks" in overrides:
        assert stats.num_preemptions > 0
    assert_draft_cache_empty(engine)


def test_a_smaller_draft_is_accepted_in_part_and_changes_no_token(
    tiny_model_dir, one_layer_dir, prompts, expected
):
    engine = engine_for(tiny_model_dir, one_layer_dir, k=4)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert tokens_of(run_to_completion(engine, prompts, params)) == expected
    stats = engine.stats()
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    per_pos = stats.num_accepted_tokens_per_pos
    assert len(per_pos) == 4 and per_pos == sorted(per_pos, reverse=True)
    # Prefix hits on the second round: the draft computes the prompts again, the target not.
    again = run_to_completion(engine, prompts, params)
    assert engine.stats().num_prefix_cache_hits > 0
    assert tokens_of(again) == expected
    assert_draft_cache_empty(engine)


def test_a_draft_of_another_architecture_with_the_vocabulary(
    tiny_model_dir, prompts, expected, tmp_path
):
    """A GPTBigCode draft for a GPT-2 target: only the vocabulary must match."""
    draft = make_gpt_bigcode_checkpoint(tmp_path, TinySpec(n_layer=1, seed=4), multi_query=True)
    engine = engine_for(tiny_model_dir, draft)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert tokens_of(run_to_completion(engine, prompts, params)) == expected
    assert engine.stats().num_draft_tokens > 0


def test_seeded_sampling_repeats_itself_and_n_samples_draft_each(
    tiny_model_dir, one_layer_dir, prompts
):
    params = [
        SamplingParams(temperature=0.5, seed=i, n=2, max_tokens=MAX_TOKENS) for i in range(10)
    ]
    runs = []
    for _ in range(2):
        engine = engine_for(tiny_model_dir, one_layer_dir)
        outputs = run_to_completion(engine, prompts, params)
        runs.append([[o.token_ids for o in output.outputs] for output in outputs])
        assert engine.stats().num_accepted_tokens > 0
        assert_draft_cache_empty(engine)
    assert runs[0] == runs[1]


def test_a_draft_with_another_vocabulary_is_refused_at_start(tiny_model_dir, tmp_path):
    other = make_checkpoint(tmp_path, TinySpec(vocab_size=300, n_layer=1))
    with pytest.raises(ValueError, match="speculative_config.model.*vocabulary of 300"):
        engine_for(tiny_model_dir, other)


def argmax_continuation(hf_model, tokens: list[int], k: int) -> list[int]:
    """k tokens, each the argmax after the ones before (through EOS: a draft does not stop)."""
    tokens = list(tokens)
    with torch.no_grad():
        for _ in range(k):
            tokens.append(int(hf_model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[-k:]


@pytest.mark.parametrize("catch_up_tokens", [2048, 16])
def test_each_proposal_is_the_draft_models_greedy_continuation(
    tiny_model_dir, one_layer_dir, catch_up_tokens
):
    """The proposer driven as verification leaves it: each round keeps a random part of every
    draft and appends a token of its own (the target's correction), or leaves a sequence as it
    was (a step that did not schedule it); some rounds a sequence
    gets no draft (the batch was over disable_by_batch_size, say) and grows by one token;
    sequences end and new ones come. Tables come as the scheduler's do: blocks appended as a
    sequence grows, with the lookahead slots of its draft, or fewer (no free block was left:
    the draft is as long as the slots allow); some rounds a block is replaced (a copy-on-write),
    which the target's copy fills but the draft's cache does not. Every draft is the draft
    model's greedy continuation (HF's): its cache never serves a rejected token's K/V nor a
    replaced block's. With a small catch-up budget, long prompts are computed over several
    rounds, proposing nothing until they are."""
    from transformers import GPT2LMHeadModel

    hf_draft = GPT2LMHeadModel.from_pretrained(one_layer_dir).eval()
    core = engine_for(tiny_model_dir, one_layer_dir).core
    assert core.drafter is not None
    block_size, num_blocks = 8, 128
    proposer = DraftModelProposer(
        core.drafter.model, core.drafter.backend, num_blocks, block_size, catch_up_tokens,
        torch.device("cpu"), torch.float32,
    )  # fmt: skip
    vocab = hf_draft.config.vocab_size
    generator = torch.Generator().manual_seed(catch_up_tokens)

    def random_token(high: int) -> int:
        return int(torch.randint(1, high, (), generator=generator))

    free = list(range(num_blocks - 1, 0, -1))
    tables: dict[int, list[int]] = {}

    def table_for(seq_id: int, num_slots: int) -> list[int]:
        table = tables.setdefault(seq_id, [])
        while len(table) * block_size < num_slots:
            table.append(free.pop())
        return table

    live = dict(enumerate(sample_prompts(4, 3, 40, vocab, seed=1)))
    next_id, checked, waited, shortened, replaced = len(live), 0, 0, 0, 0
    for round_ in range(16):
        if round_ % 4 == 3:  # one sequence ends, a new one comes
            ended = min(live)
            del live[ended]
            free += tables.pop(ended, [])
            live[next_id] = sample_prompts(1, 20, 40, vocab, seed=next_id)[0]
            next_id += 1
            proposer.release(set(live))
        undrafted = {seq_id for seq_id in live if random_token(4) == 1}
        ids = [seq_id for seq_id in live if seq_id not in undrafted]
        for seq_id in undrafted:
            live[seq_id] = live[seq_id] + [random_token(vocab)]
        k = 1 + round_ % 4
        requests = []
        for seq_id in ids:
            tokens = live[seq_id]
            # The lookahead: slots through position len + k - 2, or (no block left) fewer.
            short = random_token(5) == 1
            table = table_for(seq_id, len(tokens) + (0 if short else k - 1))
            if seq_id in tables and len(table) > 1 and random_token(6) == 1:
                index = random_token(len(table))  # a copy-on-write of a block the draft wrote
                free.append(table[index])
                table[index] = free.pop(0)
                replaced += 1
            requests.append(DraftRequest(seq_id, list(tokens), k, list(table)))
        drafts = proposer.propose(requests)
        for request, draft in zip(requests, drafts, strict=True):
            tokens = live[request.seq_id]
            if not draft:
                waited += 1
                continue
            room = len(request.block_ids) * block_size - len(tokens) + 1
            assert len(draft) == min(k, room)
            shortened += len(draft) < k
            assert draft == argmax_continuation(hf_draft, tokens, len(draft))
            checked += 1
            kept = random_token(len(draft) + 3) - 2  # -1 (the step did not run it) or 0..k
            if kept >= 0:
                live[request.seq_id] = tokens + draft[:kept] + [random_token(vocab)]
    assert checked > 20 and replaced > 0 and shortened > 0
    assert (waited > 0) == (catch_up_tokens < 2048)
    proposer.release(set())
    assert proposer.num_sequences == 0


def test_drafts_stop_at_the_draft_models_last_position(tiny_model_dir):
    """The tiny draft has 256 positions: a sequence of 254 tokens gets a draft of 3 (its
    inputs reach position 255), one of 256 a draft of 1 (its last token is at 255)."""
    core = engine_for(tiny_model_dir, tiny_model_dir, k=6).core
    assert core.drafter is not None
    long = sample_prompts(1, 256, 256, 512, seed=0)[0]
    table = list(range(1, 1 + 264 // 8))  # room for every position and more
    drafts = core.drafter.propose(
        [DraftRequest(0, long[:254], 6, table), DraftRequest(1, long, 6, table)]
    )
    assert [len(d) for d in drafts] == [3, 1]
