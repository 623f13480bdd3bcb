"""Incremental detokenization (never half a character) and exact stop-string cuts."""

import pytest

from octavo.engine.sampling_params import SamplingParams
from octavo.engine.sequence import Sequence, SequenceStatus
from octavo.engine.stop_checker import StopChecker
from octavo.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from tests.checkpoints import tokenizer_json

TEXT = "Naïve café — ünïcode 日本語 and 🎉 emoji: déjà vu, «quotes» ∑ x² ≤ 10."


@pytest.fixture(scope="module")
def tokenizer():
    import tokenizers

    return Tokenizer(tokenizers.Tokenizer.from_str(tokenizer_json(512)))


def test_deltas_never_split_a_character_and_concatenate_to_the_full_decode(tokenizer):
    ids = tokenizer.encode(TEXT)
    assert len(ids) > len(TEXT.split())  # multi-byte characters span several tokens
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.step(ids[: i + 1]) for i in range(len(ids))]
    assert all("\ufffd" not in d for d in deltas)
    assert any(d == "" for d in deltas)  # some tokens end inside a character
    assert "".join(deltas) == tokenizer.decode(ids) == TEXT == detok.text
    assert detok.flush(ids) == ""


def test_flush_emits_held_back_bytes_of_an_incomplete_character(tokenizer):
    ids = tokenizer.encode("ok 🎉")
    detok = IncrementalDetokenizer(tokenizer)
    for i in range(len(ids) - 1):
        detok.step(ids[: i + 1])
    assert detok.text == "ok "
    assert detok.flush(ids[:-1]).startswith("\ufffd")


def run_with_stop(tokenizer, text, **params):
    ids = tokenizer.encode(text)
    seq = Sequence(0, [1], IncrementalDetokenizer(tokenizer))
    sampling = SamplingParams(max_tokens=len(ids) + 1, **params)
    checker = StopChecker(max_model_len=1000, eos_token_id=0)
    for token in ids:
        seq.append_token(token, 0.0, None)
        checker.check(seq, sampling, seq.detokenizer.step(seq.output_token_ids))
        if seq.is_finished:
            break
    return seq


@pytest.mark.parametrize("stop", ["café", "ünï", "日本", " and 🎉", "x²", "u, «", "10."])
def test_stop_strings_cut_exactly_before_the_match(tokenizer, stop):
    seq = run_with_stop(tokenizer, TEXT, stop=[stop, "never appears"])
    assert seq.status is SequenceStatus.FINISHED_STOPPED
    assert seq.stop_reason == stop
    assert seq.detokenizer.text == TEXT[: TEXT.index(stop)]
    included = run_with_stop(tokenizer, TEXT, stop=stop, include_stop_str_in_output=True)
    assert included.detokenizer.text == TEXT[: TEXT.index(stop) + len(stop)]


def test_the_earliest_of_several_matches_wins(tokenizer):
    seq = run_with_stop(tokenizer, "alpha beta gamma", stop=["gamma", "beta", "alpha beta"])
    assert seq.stop_reason == "alpha beta" and seq.detokenizer.text == ""


def test_stop_strings_wait_for_min_tokens(tokenizer):
    seq = run_with_stop(tokenizer, "a b a b a b", stop="a", min_tokens=3)
    assert seq.num_output_tokens >= 3 and seq.stop_reason == "a"
    assert seq.detokenizer.text.count("a") == 1


def test_stop_token_ids_drop_the_stop_tokens_text(tokenizer):
    ids = tokenizer.encode("one two three")
    seq = run_with_stop(tokenizer, "one two three", stop_token_ids=[ids[1]])
    assert seq.stop_reason == ids[1] and seq.output_token_ids == ids[:2]
    assert seq.detokenizer.text == tokenizer.decode(ids[:1])
