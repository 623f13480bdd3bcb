"""Incremental detokenization: never half a character; deltas concatenate to the decode."""

import random

import pytest

from octavo.engine.frontend.tokenizer import IncrementalDetokenizer, Tokenizer
from tests.checkpoints import corpus, tokenizer_json

TEXT = "Naïve café — ünïcode 日本語 and 🎉 emoji: déjà vu, «quotes» ∑ x² ≤ 10."


@pytest.fixture(scope="module")
def tokenizer():
    import tokenizers

    return Tokenizer(tokenizers.Tokenizer.from_str(tokenizer_json(512)))


@pytest.fixture(scope="module")
def metaspace_tokenizer():
    """A tokenizer whose decoder is not byte-level (SentencePiece-style word boundaries):
    the detokenizer steps tokenizers' own streaming decoder for it."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    raw = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace()
    raw.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<|endoftext|>"])
    raw.train_from_iterator([corpus()[:50_000], TEXT], trainer)
    return Tokenizer(raw)


@pytest.fixture(params=["byte_level", "metaspace"])
def any_tokenizer(request, tokenizer, metaspace_tokenizer):
    if request.param == "byte_level":
        assert tokenizer.byte_level_table(True) is not None
        return tokenizer
    assert metaspace_tokenizer.byte_level_table(True) is None
    return metaspace_tokenizer


def test_deltas_never_split_a_character_and_concatenate_to_the_full_decode(tokenizer):
    ids = tokenizer.encode(TEXT)
    assert len(ids) > len(TEXT.split())  # multi-byte characters span several tokens
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.step(ids[: i + 1]) for i in range(len(ids))]
    assert all("\ufffd" not in d for d in deltas)
    assert any(d == "" for d in deltas)  # some tokens end inside a character
    assert "".join(deltas) == tokenizer.decode(ids) == TEXT == detok.text
    assert detok.flush(ids) == ""


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_any_token_ids_stepped_in_any_chunks_concatenate_to_the_decode(
    any_tokenizer, skip_special_tokens
):
    """The oracle is the tokenizer's own decode of the whole sequence: random ids (special
    tokens, ids past the vocabulary, byte tokens that make invalid UTF-8) fed 1-4 at a time."""
    rng = random.Random(0)
    vocab = any_tokenizer.vocab_size
    special = any_tokenizer.encode("<|endoftext|>")
    for _ in range(200):
        ids = [rng.randrange(vocab + 8) for _ in range(rng.randint(1, 24))]
        ids[rng.randrange(len(ids))] = special[0]
        detok = IncrementalDetokenizer(any_tokenizer, skip_special_tokens)
        deltas, end = [], 0
        while end < len(ids):
            end = min(end + rng.randint(1, 4), len(ids))
            deltas.append(detok.step(ids[:end]))
        deltas.append(detok.flush(ids))
        expected = any_tokenizer.decode([i for i in ids if i < vocab], skip_special_tokens)
        assert "".join(deltas) == detok.text == expected, ids


def test_text_is_the_decode_for_the_streaming_decoder_too(metaspace_tokenizer):
    ids = metaspace_tokenizer.encode(TEXT)
    detok = IncrementalDetokenizer(metaspace_tokenizer)
    deltas = [detok.step(ids[: i + 1]) for i in range(len(ids))]
    deltas.append(detok.flush(ids))
    assert "".join(deltas) == detok.text == metaspace_tokenizer.decode(ids)


def test_flush_emits_held_back_bytes_of_an_incomplete_character(tokenizer):
    ids = tokenizer.encode("ok 🎉")
    detok = IncrementalDetokenizer(tokenizer)
    for i in range(len(ids) - 1):
        detok.step(ids[: i + 1])
    assert detok.text == "ok "
    assert detok.flush(ids[:-1]).startswith("\ufffd")


def test_token_bytes_are_the_bytes_each_token_stands_for(tokenizer):
    """Against transformers' byte-level alphabet: every token's bytes, and a text's tokens'
    bytes laid end to end, even where a token holds part of a character."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = {char: byte for byte, char in bytes_to_unicode().items()}
    for token_id in range(tokenizer.vocab_size):
        piece = tokenizer.raw.id_to_token(token_id)
        if token_id in tokenizer.raw.get_added_tokens_decoder():
            assert tokenizer.token_bytes(token_id) == piece.encode()
        else:
            assert tokenizer.token_bytes(token_id) == bytes(alphabet[c] for c in piece)
    ids = tokenizer.encode(TEXT + "<|endoftext|>")
    assert b"".join(tokenizer.token_bytes(t) for t in ids) == (TEXT + "<|endoftext|>").encode()
    assert any(tokenizer.decode([t]) == "\ufffd" for t in ids)  # split characters were seen
