"""Writes a working copy circuit (an induction head, as in Olsson et al., "In-context Learning
and Induction Heads") into a freshly initialised GPT-2 before training, so that a model too
small and a budget too short to discover copying by gradient descent start with it.

A small GPT-2 trained on a 2-core CPU for minutes does not form induction heads: measured by
tools/induction_probe.py, copy accuracy stays near chance for 20 minutes of the pure task.
Copying is what tool calls need (arguments from the question, a tool's result into the
answer), so the circuit is written in and training keeps and routes it.

The residual stream of `n_embd` (>= 128) dims is laid out at the start:
- TOKEN (64 dims): each token's embedding, random unit vectors (nearly orthogonal), a
  spaced word's and its bare form's nearly the same (`spaced`, below);
- PREVIOUS (32 dims): written by layer 0's first head, the previous token's TOKEN[:32];
- POSITION (32 dims): 16 (cos, sin) pairs of frequencies in [0.5, 3] rad a position.

Layer 0, head 0 (previous-token head): query the position, key the position rotated one step
ahead, so position i's score peaks at i - 1; its value is TOKEN[:32], written to PREVIOUS.
Layer 1, heads 0 and 1 (induction heads): query TOKEN[:32], key PREVIOUS, so position i
attends to the j whose previous token is i's token; their values are TOKEN's two halves,
written back into TOKEN, so the tied unembedding predicts token j: the copy. Every other
weight keeps its random initialisation (its outputs start small beside these).
"""

from __future__ import annotations

import math

import torch

TOKEN = slice(0, 64)
PREVIOUS = slice(64, 96)
POSITION = slice(96, 128)
FREQUENCIES = 16
# Scales, chosen by the probe's copy accuracy before any training: the previous-token head's
# score margin, the induction query's sharpness, the size of the written previous token, and
# of the copy beside the current token's own embedding (which the unembedding reads too).
POSITION_GAIN = 2.0
QUERY_GAIN = 8.0
PREVIOUS_GAIN = 2.0
COPY_GAIN = 6.0
SPACE_SHARE = 0.3  # of a word's embedding, the part that says whether a space leads it


def spaced_pairs(vocab: dict[str, int]) -> list[tuple[int, int]]:
    """(" word", "word") id pairs of a byte-level BPE vocabulary ("Ġ" is its space)."""
    return [(i, vocab[t[1:]]) for t, i in vocab.items() if t.startswith("Ġ") and t[1:] in vocab]


@torch.no_grad()
def write_induction_circuit(
    model, generator: torch.Generator, spaced: list[tuple[int, int]] = ()
) -> None:
    """Overwrites a GPT2LMHeadModel's embeddings and layers 0-1's first heads (see the module
    docstring). Needs n_embd >= 128, head size 32 and at least two layers.

    `spaced`: (" word", "word") token id pairs that share their embedding but for a common
    leading-space direction, so that a word copies across the space it loses in a quote
    (`in Paris?` -> `{"city": "Paris"}`): byte-level BPE gives them unrelated ids."""
    config = model.config
    d, head = config.n_embd, config.n_embd // config.n_head
    if d < 128 or head != 32 or config.n_layer < 2 or config.n_head < 2:
        raise ValueError("the circuit needs n_embd >= 128, heads of 32 and two layers")
    transformer = model.transformer
    # The layer norms leave each part's share; a unit-norm residual part reads as
    # sqrt(d / parts) after them, which the written gains divide out.
    ln_scale = math.sqrt(d / 2)

    tokens = torch.randn(config.vocab_size, 64, generator=generator)
    tokens /= tokens.norm(dim=1, keepdim=True)
    if spaced:
        space = torch.randn(64, generator=generator)
        with_space, bare = (torch.tensor(ids) for ids in zip(*spaced, strict=True))
        tokens[with_space] = tokens[bare] + SPACE_SHARE * space / space.norm()
        tokens[bare] -= SPACE_SHARE * space / space.norm()
    transformer.wte.weight.zero_()
    transformer.wte.weight[:, TOKEN] = tokens / tokens.norm(dim=1, keepdim=True)

    omega = torch.linspace(0.5, 3.0, FREQUENCIES)
    angles = torch.arange(config.n_positions, dtype=torch.float32)[:, None] * omega
    transformer.wpe.weight.zero_()
    transformer.wpe.weight[:, POSITION][:, 0::2] = torch.cos(angles) / math.sqrt(FREQUENCIES)
    transformer.wpe.weight[:, POSITION][:, 1::2] = torch.sin(angles) / math.sqrt(FREQUENCIES)
    # p(j) @ ahead = p(j + 1): each (cos, sin) pair rotated by its frequency.
    ahead = torch.zeros(32, 32)
    for k, w in enumerate(omega.tolist()):
        ahead[2 * k : 2 * k + 2, 2 * k : 2 * k + 2] = torch.tensor(
            [[math.cos(w), math.sin(w)], [-math.sin(w), math.cos(w)]]
        )
    eye = torch.eye(32)

    def head_columns(h: int) -> tuple[slice, slice, slice]:
        return (
            slice(h * head, (h + 1) * head),
            slice(d + h * head, d + (h + 1) * head),
            slice(2 * d + h * head, 2 * d + (h + 1) * head),
        )

    def clear_head(attn, h: int) -> None:
        for columns in head_columns(h):
            attn.c_attn.weight[:, columns] = 0
            attn.c_attn.bias[columns] = 0
        attn.c_proj.weight[h * head : (h + 1) * head, :] = 0

    previous = transformer.h[0].attn
    clear_head(previous, 0)
    q, k, v = head_columns(0)
    gain = math.sqrt(POSITION_GAIN)
    previous.c_attn.weight[POSITION, q] = gain * eye
    previous.c_attn.weight[POSITION, k] = gain * ahead
    previous.c_attn.weight[0:32, v] = eye
    previous.c_proj.weight[0:head, PREVIOUS] = PREVIOUS_GAIN * eye / ln_scale

    induction = transformer.h[1].attn
    for h in (0, 1):
        clear_head(induction, h)
        q, k, v = head_columns(h)
        induction.c_attn.weight[0:32, q] = QUERY_GAIN * eye
        induction.c_attn.weight[PREVIOUS, k] = eye
        half = slice(32 * h, 32 * (h + 1))
        induction.c_attn.weight[half, v] = eye
        induction.c_proj.weight[h * head : (h + 1) * head, half] = COPY_GAIN * eye / ln_scale
