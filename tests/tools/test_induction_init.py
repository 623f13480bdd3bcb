"""The written copy circuit copies before any training: on the induction probe's held-out rows
(random tokens, each segment repeated at once) a fresh GPT-2 of the embedded model's shape
predicts nearly every copyable token, and a word copies across the space a quote drops."""

import argparse

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from tools.induction_init import spaced_pairs, write_induction_circuit
from tools.induction_probe import rows


def fresh_model(**overrides) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    shape = dict(vocab_size=4096, n_positions=512, n_embd=128, n_layer=4, n_head=4)
    return GPT2LMHeadModel(GPT2Config(**(shape | overrides))).eval()


def copy_accuracy(model, ids: torch.Tensor, mask: torch.Tensor) -> float:
    with torch.no_grad():
        predicted = model(input_ids=ids).logits[:, :-1].argmax(-1)
    return (predicted[mask[:, 1:]] == ids[:, 1:][mask[:, 1:]]).float().mean().item()


def test_a_fresh_model_copies_only_with_the_circuit():
    args = argparse.Namespace(context=256, seg_min=4, seg_max=24, token_range=4096)
    ids, mask = rows(args, torch.Generator().manual_seed(1), 16)
    model = fresh_model()
    assert copy_accuracy(model, ids, mask) < 0.01
    write_induction_circuit(model, torch.Generator().manual_seed(0))
    assert copy_accuracy(model, ids, mask) > 0.9


def test_a_spaced_word_copies_as_the_bare_word():
    vocab = {"Ġfoo": 10, "foo": 11, "Ġbar": 12, "baz": 13, "Ġ": 14}
    assert sorted(spaced_pairs(vocab)) == [(10, 11)]
    model = fresh_model(vocab_size=16)
    write_induction_circuit(model, torch.Generator().manual_seed(0), [(10, 11)])
    embedding = model.transformer.wte.weight
    similarity = torch.cosine_similarity(embedding[10], embedding[11], dim=0)
    unrelated = torch.cosine_similarity(embedding[10], embedding[12], dim=0)
    assert similarity > 0.8 and abs(unrelated) < 0.5


def test_a_shape_without_room_for_the_circuit_is_refused():
    with pytest.raises(ValueError, match="heads of 32"):
        write_induction_circuit(fresh_model(n_head=2), torch.Generator())
