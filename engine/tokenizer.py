"""Tokenizer (Hugging Face `tokenizers`, tokenizer.json) and the incremental detokenizer."""

from __future__ import annotations

from pathlib import Path

import tokenizers

# What tokenizers' byte-level decoder puts where a UTF-8 character is still incomplete.
_REPLACEMENT_CHAR = "\ufffd"


class Tokenizer:
    """Encodes text to token ids and decodes them back; a thin, typed wrapper."""

    def __init__(self, tokenizer: tokenizers.Tokenizer):
        self._tokenizer = tokenizer

    @classmethod
    def from_file(cls, path: str | Path) -> Tokenizer:
        return cls(tokenizers.Tokenizer.from_file(str(path)))

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text, one delta per new token.

    A delta never ends inside a UTF-8 character: while the newest tokens decode to an
    incomplete character, nothing is emitted and the bytes wait for the token that completes
    them. The deltas concatenate to `text`, which is the decode of all output tokens (unless a
    stop string cut it). Decoding restarts at `prefix_offset`, the last clean boundary, so each
    step costs a few tokens, not the whole output. Without a tokenizer (dummy weights and
    token-id prompts) the text stays empty.
    """

    def __init__(self, tokenizer: Tokenizer | None, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self.text = ""
        self._prefix_offset = 0
        self._read_offset = 0

    def copy(self) -> IncrementalDetokenizer:
        other = IncrementalDetokenizer(self._tokenizer, self._skip_special_tokens)
        other.text = self.text
        other._prefix_offset = self._prefix_offset
        other._read_offset = self._read_offset
        return other

    def _decode(self, token_ids: list[int]) -> str:
        assert self._tokenizer is not None
        return self._tokenizer.decode(token_ids, self._skip_special_tokens)

    def step(self, output_token_ids: list[int]) -> str:
        """Consumes the newest token(s) of `output_token_ids`; returns the new complete text."""
        if self._tokenizer is None:
            return ""
        prefix_text = self._decode(output_token_ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(output_token_ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(output_token_ids)
        self.text += delta
        return delta

    def flush(self, output_token_ids: list[int]) -> str:
        """At the end of a sequence: emits whatever is still held back, as decoded."""
        if self._tokenizer is None:
            return ""
        prefix_text = self._decode(output_token_ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(output_token_ids[self._prefix_offset :])
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset = len(output_token_ids)
        self.text += delta
        return delta
