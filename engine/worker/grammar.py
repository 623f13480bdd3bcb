"""The worker's side of structured outputs: an llguidance matcher per constrained sequence,
and a step's masks applied to its logits in one operation."""

from __future__ import annotations

from collections import OrderedDict
from functools import cached_property
from pathlib import Path

import numpy as np
import torch
from llguidance import LLMatcher, LLTokenizer

from octavo.engine.structured_outputs import COMPILED_GRAMMAR_CACHE_SIZE
from octavo.engine.worker.step_inputs import on_device

# llguidance packs a mask as 32 allowed-token bits per int32 word.
BITS_PER_WORD = 32


class GrammarMatchers:
    """Builds matchers over the model's tokenizer and masks logits with them.

    The llguidance tokenizer (the vocabulary's bytes, for matching token by token) is built
    on the first constrained request, not at startup: an engine that serves none never pays
    for it. Its vocabulary is the model's (the logits' width), and EOS is the model's: a
    matcher allows EOS exactly where its grammar accepts.
    """

    def __init__(self, tokenizer_file: Path | None, vocab_size: int, eos_token_id: int | None):
        self.tokenizer_file = tokenizer_file
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        # A fresh matcher per grammar text, most recently used last: building one parses
        # and compiles its grammar, copying one does not.
        self._fresh: OrderedDict[str, LLMatcher] = OrderedDict()

    @cached_property
    def tokenizer(self) -> LLTokenizer:
        if self.tokenizer_file is None:  # the front end refuses such requests first
            raise ValueError("structured outputs need the model's tokenizer.json")
        return LLTokenizer(
            self.tokenizer_file.read_text(), n_vocab=self.vocab_size, eos_token=self.eos_token_id
        )

    def matcher(self, grammar: str) -> LLMatcher:
        """A matcher at the start of `grammar` (text the front end compiled and validated).
        It never raises: a matcher in its error state allows no token, and the first token
        it refuses fails its request alone (`InputBatch.record_sampled`)."""
        fresh = self._fresh.get(grammar)
        if fresh is None:
            fresh = self._fresh[grammar] = LLMatcher(self.tokenizer, grammar)
            if len(self._fresh) > COMPILED_GRAMMAR_CACHE_SIZE:  # as many as the front end
                self._fresh.popitem(last=False)
        else:
            self._fresh.move_to_end(grammar)
        return fresh.deep_copy()

    def apply_masks(
        self, logits: torch.Tensor, rows: np.ndarray, matchers: list[LLMatcher]
    ) -> None:
        """Sets to -inf, in place, every logit of rows `rows` (ascending, distinct) of
        `logits` [R, vocab] whose token the row's matcher does not allow next: the masks
        are filled on the host (llguidance, one call per row: its parallel executor's thread
        pool fights torch's threads for a small machine's cores), unpacked to one flag per
        token, and applied in one operation."""
        vocab = logits.shape[1]
        words = -(-vocab // BITS_PER_WORD)
        bitmask = np.empty((len(matchers), words), dtype=np.int32)
        row_bytes = words * bitmask.itemsize
        base = bitmask.ctypes.data
        for i, matcher in enumerate(matchers):
            matcher.unsafe_compute_mask_ptr(base + i * row_bytes, row_bytes)
        if logits.device.type == "cuda":  # unpacked on the device: a 32x smaller copy
            packed = on_device(bitmask, logits.device)
            shifts = torch.arange(BITS_PER_WORD, dtype=torch.int32, device=logits.device)
            allowed = ((packed.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab].bool()
            if len(rows) == logits.shape[0]:
                logits.masked_fill_(~allowed, float("-inf"))
            else:
                index = on_device(rows.astype(np.int64), logits.device)
                logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
            return
        # Bit i of word w is token 32 w + i: the inverted words' little-endian bytes, each
        # read from its lowest bit, in one pass, are the refused tokens' flags. numpy's
        # masked copy costs a third of torch's masked_fill_ here.
        little = np.invert(bitmask).astype("<i4", copy=False).view(np.uint8)
        refused = np.unpackbits(little, axis=1, count=vocab, bitorder="little").view(np.bool_)
        values = logits.numpy()
        if len(rows) == len(values):  # every row (all constrained): in place, no gather
            np.copyto(values, -np.inf, where=refused)
        else:
            chosen = values[rows]
            np.copyto(chosen, -np.inf, where=refused)
            values[rows] = chosen
