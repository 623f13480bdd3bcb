"""Incremental detokenization: never half a character; deltas concatenate to the decode."""

import pytest

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
