"""The sampler's grammar masks against llguidance's own byte-per-token mask: the rows named
are masked exactly (a vocabulary that is no multiple of 32 too), the other rows untouched."""

import numpy as np
import torch

from octavo.engine.structured_outputs import StructuredOutputsParams, compile_grammar
from octavo.engine.worker.grammar import GrammarMatchers
from octavo.server.server_args import DEFAULT_MODEL
from tests.engine.helpers import llguidance_allowed

# The default model's tokenizer (4097 tokens) in a logits row of a width that is no multiple
# of 32: the last mask word is partly padding.
VOCAB = 4100
EOS = 0


def test_masks_equal_llguidance_logit_bias_on_the_rows_named():
    vocab = VOCAB
    grammars = GrammarMatchers(DEFAULT_MODEL / "tokenizer.json", vocab, EOS)
    grammar = compile_grammar(StructuredOutputsParams(regex="[a-z]{2,4}( [0-9]+)?"))
    matchers = [grammars.matcher(grammar) for _ in range(2)]
    assert matchers[1].consume_tokens(grammars.tokenizer.tokenize_str("ab"))
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    grammars.apply_masks(logits, np.array([0, 2]), matchers)
    assert torch.equal(logits[1], before[1])
    for row, matcher in zip((0, 2), matchers, strict=True):
        allowed = llguidance_allowed(matcher, vocab)
        assert 0 < int(allowed.sum()) < vocab
        assert torch.equal(logits[row][allowed], before[row][allowed])
        assert bool((logits[row][~allowed] == float("-inf")).all())
