"""Sampler: exact masks on hand-made logits, penalties by hand, seeds, and the draw itself."""

import math

import numpy as np
import pytest
import torch

from octavo.engine.sampling_params import SamplingParams
from octavo.engine.step_io import NewSampledSequence
from octavo.engine.stop_rules import stop_token_set
from octavo.engine.worker.grammar import GrammarMatchers
from octavo.engine.worker.penalties import PenaltyCounts
from octavo.engine.worker.sampler import (
    Sampler,
    apply_min_p,
    apply_top_k_top_p,
    argmax_rows,
)
from octavo.engine.worker.sampling_batch import SamplingBatch, SamplingColumns
from octavo.engine.worker.sampling_state import SamplingState

PROBS = [0.5, 0.2, 0.15, 0.1, 0.05]
EOS = 4
# No row of these tests is constrained: the matchers' tokenizer is never built.
GRAMMARS = GrammarMatchers(None, vocab_size=0, eos_token_id=EOS)


def kept(logits: torch.Tensor) -> list[list[int]]:
    return [torch.isfinite(row).nonzero().squeeze(1).tolist() for row in logits]


def request(prompt=(1,), output=(), seed=None, bad_words_token_ids=(), **params) -> SamplingState:
    """The worker's state of a sequence with `output` sampled so far (`bad_words_token_ids`:
    its bad words as the front end tokenized them)."""
    sampling = SamplingParams(seed=seed, **params)
    stops = stop_token_set(sampling.stop_token_ids, sampling.ignore_eos, [EOS])
    new = NewSampledSequence(
        0, sampling, list(prompt), 0, stops, bad_words_token_ids=list(bad_words_token_ids)
    )
    state = SamplingState.create(new, torch.device("cpu"), GRAMMARS)
    state.output_token_ids += list(output)
    return state


def batch(states: list[SamplingState], vocab_size: int = len(PROBS)) -> SamplingBatch:
    """The rows `states` (one state may fill several) as the input batch gathers them, each
    sequence's earlier outputs counted as the steps that sampled them counted them (rows,
    and the sampler's counts of a penalized row's tokens)."""
    columns = SamplingColumns(1, PenaltyCounts(vocab_size, torch.device("cpu")))
    for state in {id(s): s for s in states}.values():
        state.slot = columns.add(state)
        for token in state.output_token_ids:
            earlier = columns.gather([state])
            if len(earlier.penalized_rows):
                earlier.penalties.count(np.array([state.slot]), torch.tensor([token]))
    return columns.gather(states)


def test_top_k_keeps_exactly_the_k_largest():
    logits = torch.tensor([[1.0, 3.0, 2.0, 5.0, 4.0], [1.0, 3.0, 2.0, 5.0, 4.0]])
    out = apply_top_k_top_p(logits, top_k=[2, 0], top_p=[1.0, 1.0])
    assert kept(out) == [[3, 4], [0, 1, 2, 3, 4]]
    assert torch.equal(out[0, [3, 4]], logits[0, [3, 4]])


@pytest.mark.parametrize(
    ("top_p", "expected"),
    [(0.6, [0, 1]), (0.75, [0, 1, 2]), (0.3, [0]), (0.9, [0, 1, 2, 3]), (1.0, [0, 1, 2, 3, 4])],
)
def test_top_p_keeps_the_smallest_set_reaching_the_mass(top_p, expected):
    logits = torch.tensor([PROBS]).log()[:, [2, 0, 4, 1, 3]]  # shuffled: order must not matter
    order = [2, 0, 4, 1, 3]
    out = apply_top_k_top_p(logits, top_k=[0], top_p=[top_p])
    assert sorted(order.index(i) for i in expected) == kept(out)[0]


def test_top_k_then_top_p_per_row():
    logits = torch.tensor([PROBS, PROBS]).log()
    out = apply_top_k_top_p(logits, top_k=[3, 1], top_p=[0.6, 1.0])
    assert kept(out) == [[0, 1], [0]]


def test_min_p_masks_below_a_fraction_of_the_top_probability():
    logits = torch.tensor([PROBS, PROBS]).log()
    out = apply_min_p(logits, [0.25, 0.5])  # thresholds 0.125 and 0.25
    assert kept(out) == [[0, 1, 2], [0]]


def penalized(logits: torch.Tensor, rows: SamplingBatch) -> torch.Tensor:
    """`logits` [R, vocab] with the penalties of every penalized row of `rows` applied."""
    out = logits.clone()
    rows.penalties.apply(out, rows)
    return out


def test_penalties_match_a_hand_computation():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0])
    req = request(
        prompt=[0],
        output=[1, 1, 3],
        repetition_penalty=2.0,
        frequency_penalty=0.5,
        presence_penalty=0.25,
    )
    # repetition (seen: 0, 1, 3): [1, -2, 0.5, 1.5]; frequency (counts 0, 2, 0, 1): -[0, 1, 0, .5];
    # presence (tokens 1, 3): -[0, .25, 0, .25].
    expected = torch.tensor([1.0, -3.25, 0.5, 0.75])
    assert torch.equal(penalized(logits[None], batch([req], vocab_size=4))[0], expected)


def test_penalties_of_a_batch_are_each_rows_own():
    """Rows with other penalties, prompts and outputs, penalized together, equal a dense
    computation of each row's penalties from its prompt and outputs; a row without
    penalties is untouched; the sampler counts each penalized row's draw."""
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 7, generator=generator)
    logits[1, 5] = 0.0
    reqs = [
        request(prompt=[0, 6], output=[1, 1, 2], repetition_penalty=1.7, temperature=0.0),
        request(prompt=[5], output=[4], frequency_penalty=-0.8, presence_penalty=1.5),
        request(output=[3, 3], temperature=0.0),  # no penalty
        request(prompt=[2], output=[6, 0, 6], presence_penalty=-2.0, repetition_penalty=0.5),
    ]
    rows = batch(reqs, vocab_size=7)
    assert rows.penalized_rows.tolist() == [0, 1, 3]
    got = penalized(logits, rows)
    for i, req in enumerate(reqs):
        params = req.params
        counts = torch.bincount(torch.tensor(req.output_token_ids), minlength=7).float()
        seen = counts > 0
        seen[req.prompt_token_ids] = True
        row = logits[i]
        p = params.repetition_penalty
        row = torch.where(seen, torch.where(row > 0, row / p, row * p), row)
        row = row - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)
        assert torch.allclose(got[i], row, rtol=0, atol=1e-6), i
    assert torch.equal(got[2], logits[2])
    sampled = Sampler(torch.Generator().manual_seed(0), GRAMMARS)(logits, rows).token_ids
    for i in rows.penalized_rows.tolist():
        expected = torch.bincount(torch.tensor(reqs[i].output_token_ids), minlength=7)
        expected[sampled[i]] += 1
        assert torch.equal(rows.penalties.output_counts[rows.slots[i]].long(), expected)
        assert rows.penalties.seen[rows.slots[i], sampled[i]]


@pytest.mark.parametrize("logprobs", [None, 2], ids=["plain", "logprobs"])
def test_half_precision_logits_sample_as_their_float32_widening(logprobs):
    """The model's logits come in its dtype: a plain greedy batch takes the argmax as they
    are, any other widens them first, so both give what float32 logits give."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1)).half()
    logits[1, [7, 30]] = logits[1].max() + 1  # a tie: the first index wins either way
    states = [request(temperature=0.0, logprobs=logprobs) for _ in range(3)]
    got = Sampler(torch.Generator().manual_seed(0), GRAMMARS)(logits, batch(states, 50))
    expected = Sampler(torch.Generator().manual_seed(0), GRAMMARS)(
        logits.float(), batch(states, 50)
    )
    assert (
        got.token_ids.tolist()
        == expected.token_ids.tolist()
        == [int(row.float().argmax()) for row in logits]
    )
    assert got.token_ids[1] == 7
    if logprobs is not None:
        assert got.logprobs.dtype == torch.float32
        assert torch.equal(got.logprobs, expected.logprobs)


def test_greedy_takes_the_argmax_and_reports_model_logprobs():
    sampler = Sampler(torch.Generator().manual_seed(0), GRAMMARS)
    logits = torch.tensor([PROBS, PROBS[::-1]]).log()
    out = sampler(
        logits, batch([request(temperature=0.0, logprobs=2), request(temperature=0.0)])
    ).to_host()
    assert out.token_ids == [0, 4]
    # Only the row that asked for logprobs gets them (vLLM's contract).
    assert out.logprobs[0] == pytest.approx(math.log(0.5), abs=1e-6)
    assert out.logprobs[1] is None
    assert list(out.top_logprobs[0]) == [0, 1]
    assert out.top_logprobs[0][1] == pytest.approx(math.log(0.2), abs=1e-6)
    assert out.top_logprobs[1] is None


def test_argmax_rows_matches_torch_argmax_with_ties_infinities_and_nan():
    generator = torch.Generator().manual_seed(0)
    values = torch.randint(0, 4, (64, 50), generator=generator).float()  # many ties
    values[3, :] = float("-inf")
    values[5, 7] = float("inf")
    values[9, 11] = float("nan")
    strided = torch.randn(16, 100, generator=generator)[:, ::3]
    for x in (values, strided, values.to(torch.bfloat16), values.to(torch.float16)):
        got = argmax_rows(x)
        assert got.dtype == torch.int64
        assert torch.equal(got, x.argmax(dim=-1))


def test_min_tokens_keeps_eos_and_stop_tokens_from_being_drawn():
    sampler = Sampler(torch.Generator().manual_seed(0), GRAMMARS)
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 9.0]] * 3)
    reqs = [
        request(output=[7], temperature=0.0, min_tokens=2, stop_token_ids=[3]),
        request(output=[7, 8], temperature=0.0, min_tokens=2, stop_token_ids=[3]),
        request(output=[7], temperature=0.0, min_tokens=2, ignore_eos=True),
    ]
    assert sampler(logits, batch(reqs)).to_host().token_ids == [2, EOS, EOS]


def test_penalised_greedy_row_changes_its_choice():
    sampler = Sampler(torch.Generator().manual_seed(0), GRAMMARS)
    logits = torch.tensor([[3.0, 2.9, 0.0, 0.0, 0.0]])
    penalized = request(output=[0], temperature=0.0, presence_penalty=0.5, logprobs=0)
    out = sampler(logits, batch([penalized])).to_host()
    assert out.token_ids == [1]
    # The reported log-probability is the model's, before the penalty.
    assert out.logprobs[0] == pytest.approx(torch.log_softmax(logits[0], 0)[1].item())


def test_token_controls_match_a_hand_computation():
    sampler = Sampler(torch.Generator().manual_seed(0), GRAMMARS)
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, 0.5]] * 5)
    # 1 always; 0 after 2; 2 after 7 (the words' text is the tokenizer's business)
    bad_words = {"bad_words": ["a", "b c", "d e"], "bad_words_token_ids": [[1], [2, 0], [7, 2]]}
    bad = request(output=[9, 2], temperature=0.0, **bad_words)
    reqs = [
        request(temperature=0.0, logit_bias={4: 4.5}),  # 1.0 + 4.5 beats 5.0
        request(temperature=0.0, logit_bias={0: -100.0, 1: -100.0}),
        request(temperature=0.0, allowed_token_ids=[3, 5]),  # 3 is the best allowed
        bad,  # 0 (after 2) and 1 banned; 2 would follow 7, which did not come
        # allowed first, then the bias: a biased token outside the allowed set stays out
        request(temperature=0.0, allowed_token_ids=[2, 3], logit_bias={0: 50.0, 3: 1.5}),
    ]
    assert sampler(logits, batch(reqs)).to_host().token_ids == [4, 2, 3, 2, 3]


def test_logit_bias_comes_before_penalties_as_in_vllm():
    # repetition_penalty 2 on a seen token: (3 + 1) / 2 = 2 < 2.5 (bias first), where
    # 3 / 2 + 1 = 2.5 would tie (penalty first).
    sampler = Sampler(torch.Generator().manual_seed(0), GRAMMARS)
    logits = torch.tensor([[3.0, 2.5, 0.0, 0.0, 0.0]])
    row = request(
        prompt=(4,), output=[0], temperature=0.0, logit_bias={0: 1.0}, repetition_penalty=2.0
    )
    assert sampler(logits, batch([row])).to_host().token_ids == [1]


def test_a_seeded_row_draws_the_same_token_whatever_else_is_in_the_batch():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))

    def draw(rows: list[int], seed_row: int) -> int:
        sampler = Sampler(torch.Generator().manual_seed(len(rows)), GRAMMARS)
        reqs = [request(seed=1234 if r == seed_row else None, temperature=1.0) for r in rows]
        return sampler(logits[rows], batch(reqs)).to_host().token_ids[rows.index(seed_row)]

    draws = [draw(list(range(4)), 2), draw([2], 2), draw([5, 1, 2, 0], 2), draw([2, 3], 2)]
    assert len(set(draws)) == 1


def test_random_draws_follow_the_filtered_distribution():
    sampler = Sampler(torch.Generator().manual_seed(0), GRAMMARS)
    logits = torch.tensor([PROBS]).log().repeat(4000, 1)
    tokens = sampler(logits, batch([request(temperature=1.0, top_k=3)] * 4000)).to_host().token_ids
    freq = torch.bincount(torch.tensor(tokens), minlength=5).float() / 4000
    expected = torch.tensor([0.5, 0.2, 0.15, 0.0, 0.0]) / 0.85
    assert torch.allclose(freq, expected, atol=0.03)
    assert freq[3] == 0 and freq[4] == 0
