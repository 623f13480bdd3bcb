"""Tokenizer (Hugging Face `tokenizers`, tokenizer.json) and the incremental detokenizer."""

from __future__ import annotations

import codecs
from pathlib import Path

import tokenizers
import tokenizers.decoders

from octavo.engine.worker.models.model_files import tokenizer_file


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's (GPT-2's) character for each byte, inverted: printable Latin-1
    bytes stand for themselves, the other 68 bytes for the characters from U+0100 on, in
    byte order."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\u00a1"), ord("\u00ac") + 1),
        *range(ord("\u00ae"), ord("\u00ff") + 1),
    ]
    alphabet = {chr(b): b for b in printable}
    others = (b for b in range(256) if b not in alphabet.values())
    alphabet.update({chr(0x100 + i): b for i, b in enumerate(others)})
    return alphabet


class Tokenizer:
    """Encodes text to token ids and decodes them back; a thin, typed wrapper."""

    def __init__(self, tokenizer: tokenizers.Tokenizer):
        self._tokenizer = tokenizer
        self._added = {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items()}
        byte_level = isinstance(tokenizer.decoder, tokenizers.decoders.ByteLevel)
        self._byte_alphabet = _byte_level_alphabet() if byte_level else None
        self._byte_level_tables: dict[bool, tuple[bytes, ...]] = {}

    @classmethod
    def from_file(cls, path: str | Path) -> Tokenizer:
        return cls(tokenizers.Tokenizer.from_file(str(path)))

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; GPT-2's tokenizer adds no special tokens either way, a
        tokenizer.json with a post-processor may (BOS, say) when asked."""
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for: a byte-level token's own bytes, which may be part
        of a UTF-8 character (its decoded text would be U+FFFD); an added token's text;
        otherwise the token's decoded text, encoded."""
        if token_id in self._added:
            return self._added[token_id].encode()
        piece = self._tokenizer.id_to_token(token_id)
        alphabet = self._byte_alphabet
        if alphabet is not None and piece is not None and all(c in alphabet for c in piece):
            return bytes(alphabet[c] for c in piece)
        return self.decode([token_id], skip_special_tokens=False).encode()

    @property
    def raw(self) -> tokenizers.Tokenizer:
        """The `tokenizers` object itself (for its streaming decoder)."""
        return self._tokenizer

    def byte_level_table(self, skip_special_tokens: bool) -> tuple[bytes, ...] | None:
        """For a byte-level BPE decoder (GPT-2's), the bytes each token id decodes to, as
        the decoder itself makes them: a token whose characters are all in the byte
        alphabet stands for their bytes, any other for its text's UTF-8 (an added token
        included); a special token is empty when skipped. A decode is then the table's
        bytes laid end to end, read as UTF-8 with replacement characters, which is how the
        decoder ends too. None for any other decoder."""
        alphabet = self._byte_alphabet
        if alphabet is None:
            return None
        if skip_special_tokens in self._byte_level_tables:
            return self._byte_level_tables[skip_special_tokens]
        special = {i for i, t in self._tokenizer.get_added_tokens_decoder().items() if t.special}
        table = []
        for token_id in range(self.vocab_size):
            piece = self._tokenizer.id_to_token(token_id)
            if piece is None or (skip_special_tokens and token_id in special):
                table.append(b"")
            elif all(c in alphabet for c in piece):
                table.append(bytes(alphabet[c] for c in piece))
            else:
                table.append(piece.encode())
        return self._byte_level_tables.setdefault(skip_special_tokens, tuple(table))


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text, one delta per step.

    A delta never ends inside a UTF-8 character: while the newest tokens decode to an
    incomplete character, nothing is emitted and the bytes wait for the token that completes
    them. The deltas concatenate to `text`, the decode of all output tokens. A byte-level
    tokenizer's tokens cost a table lookup each and one incremental UTF-8 decode per step
    (`Tokenizer.byte_level_table`); any other tokenizer's a step of its own streaming decoder
    (tokenizers' DecodeStream, in Rust), several times dearer. Neither decodes the whole
    output again. Without a tokenizer (dummy weights and token-id prompts) the text stays
    empty.
    """

    def __init__(self, tokenizer: Tokenizer | None, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self.text = ""
        self._num_consumed = 0
        self._table = None if tokenizer is None else tokenizer.byte_level_table(skip_special_tokens)
        if self._table is not None:
            self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        else:
            self._stream = tokenizers.decoders.DecodeStream(skip_special_tokens=skip_special_tokens)
            self._num_held = 0  # trailing consumed tokens whose text has not come out yet

    def step(self, output_token_ids: list[int]) -> str:
        """Consumes the newest token(s) of `output_token_ids`; returns the new complete text."""
        if self._tokenizer is None:
            return ""
        new = output_token_ids[self._num_consumed :]
        self._num_consumed = len(output_token_ids)
        table = self._table
        if table is not None:
            size = len(table)
            delta = self._utf8.decode(b"".join([table[t] if t < size else b"" for t in new]))
        else:
            chunks = []
            for token_id in new:
                chunk = self._stream.step(self._tokenizer.raw, token_id)
                if chunk is None:
                    self._num_held += 1
                else:
                    chunks.append(chunk)
                    self._num_held = 0
            delta = "".join(chunks)
        self.text += delta
        return delta

    def flush(self, output_token_ids: list[int]) -> str:
        """At the end of a sequence: emits whatever is still held back, as decoded (an
        incomplete character as replacement characters)."""
        if self._tokenizer is None:
            return ""
        delta = self.step(output_token_ids)
        if self._table is not None:
            tail = self._utf8.decode(b"", final=True)
        elif self._num_held:
            held = output_token_ids[len(output_token_ids) - self._num_held :]
            tail = self._tokenizer.decode(held, self._skip_special_tokens)
            self._num_held = 0
        else:
            return delta
        self.text += tail
        return delta + tail


def load_tokenizer(model: str, load_format: str) -> Tokenizer | None:
    """The model's tokenizer.json, or None (a dummy preset, a folder without one). Loads no
    weights: the API process needs the tokenizer, never the model."""
    path = tokenizer_file(model, load_format)
    return None if path is None else Tokenizer.from_file(path)
