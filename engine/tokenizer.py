"""Tokenizer (Hugging Face `tokenizers`, tokenizer.json) and the incremental detokenizer."""

from __future__ import annotations

from pathlib import Path

import tokenizers
import tokenizers.decoders


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


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text, one delta per new token.

    A delta never ends inside a UTF-8 character: while the newest tokens decode to an
    incomplete character, nothing is emitted and the bytes wait for the token that completes
    them. The deltas concatenate to `text`, the decode of all output tokens. Each token costs
    one step of the tokenizer's own streaming decoder (tokenizers' DecodeStream, in Rust),
    never a decode of the whole output. Without a tokenizer (dummy weights and token-id
    prompts) the text stays empty.
    """

    def __init__(self, tokenizer: Tokenizer | None, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stream = tokenizers.decoders.DecodeStream(skip_special_tokens=skip_special_tokens)
        self.text = ""
        self._num_consumed = 0
        self._num_held = 0  # trailing consumed tokens whose text has not come out yet

    def step(self, output_token_ids: list[int]) -> str:
        """Consumes the newest token(s) of `output_token_ids`; returns the new complete text."""
        if self._tokenizer is None:
            return ""
        chunks = []
        for token_id in output_token_ids[self._num_consumed :]:
            chunk = self._stream.step(self._tokenizer.raw, token_id)
            if chunk is None:
                self._num_held += 1
            else:
                chunks.append(chunk)
                self._num_held = 0
        self._num_consumed = len(output_token_ids)
        delta = "".join(chunks)
        self.text += delta
        return delta

    def flush(self, output_token_ids: list[int]) -> str:
        """At the end of a sequence: emits whatever is still held back, as decoded (an
        incomplete character as replacement characters)."""
        if self._tokenizer is None:
            return ""
        delta = self.step(output_token_ids)
        if self._num_held:
            held = output_token_ids[len(output_token_ids) - self._num_held :]
            tail = self._tokenizer.decode(held, self._skip_special_tokens)
            self._num_held = 0
            self.text += tail
            delta += tail
        return delta
