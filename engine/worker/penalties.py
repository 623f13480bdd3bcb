"""Repetition, frequency and presence penalties over a step's rows, from token counts the
worker keeps on the device."""

from __future__ import annotations

import numpy as np
import torch

from octavo.engine.worker.sampler import MAX_TEMPERABLE_LOGIT
from octavo.engine.worker.sampling_batch import SamplingBatch
from octavo.engine.worker.step_inputs import on_device


class PenaltyCounts:
    """Per slot of the sampling columns: how many times each token has been sampled for the
    slot's sequence (`output_counts`, int32 [slots, vocab]) and which tokens it has seen,
    in its prompt or its output (`seen`, bool [slots, vocab]), on the sampler's device.

    Only penalized sequences are written: the tensors are allocated when the first one
    arrives and grow with the columns. The sampler counts each penalized row's token as it
    draws it, on the device and in stream order, so the next step's penalties see it
    without the host having received it: penalized requests run a step ahead like the rest.
    A preempted sequence keeps its slot and so its counts.
    """

    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size = vocab_size
        self.device = device
        self.output_counts = torch.zeros((0, vocab_size), dtype=torch.int32, device=device)
        self.seen = torch.zeros((0, vocab_size), dtype=torch.bool, device=device)

    def reset(self, slot: int, capacity: int, prompt_token_ids: list[int]) -> None:
        """Starts slot `slot` (of `capacity` column slots) for a new sequence: no token
        sampled, the prompt's tokens seen."""
        old = len(self.output_counts)
        if old < capacity:
            counts = torch.zeros((capacity, self.vocab_size), dtype=torch.int32, device=self.device)
            seen = torch.zeros((capacity, self.vocab_size), dtype=torch.bool, device=self.device)
            counts[:old], seen[:old] = self.output_counts, self.seen
            self.output_counts, self.seen = counts, seen
        self.output_counts[slot] = 0
        self.seen[slot] = False
        self.seen[slot, on_device(prompt_token_ids, self.device, torch.long)] = True

    def count(self, slots: np.ndarray, token_ids: torch.Tensor) -> None:
        """One more sample of `token_ids[i]` (on the device) for the sequence in `slots[i]`
        (each slot once)."""
        at = (on_device(slots, token_ids.device), token_ids)
        self.output_counts[at] += 1
        self.seen[at] = True

    def apply(self, logits: torch.Tensor, batch: SamplingBatch) -> None:
        """Penalizes the penalized rows of `batch` in `logits` [R, vocab] (one row per row of
        the batch), in place, each with its sequence's penalties and counts.

        Only a row's seen tokens change, and they are few next to the vocabulary: they are
        gathered, penalized and scattered back, which on CPU costs a fraction of penalizing
        [rows, vocab] densely. Finding them (`nonzero`) waits for the device on CUDA, as a
        step that applies every token first would.
        """
        device, rows = logits.device, batch.penalized_rows
        slots = on_device(batch.slots[rows], device)
        which, tokens = self.seen[slots].nonzero(as_tuple=True)
        at = (on_device(rows, device)[which], tokens)
        logits[at] = apply_penalties(
            logits[at],
            self.output_counts[slots[which], tokens],
            on_device(batch.repetition_penalty[rows], device)[which],
            on_device(batch.frequency_penalty[rows], device)[which],
            on_device(batch.presence_penalty[rows], device)[which],
        )


def apply_penalties(
    logits: torch.Tensor,
    output_counts: torch.Tensor,
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> torch.Tensor:
    """The repetition, frequency and presence penalties (vLLM / OpenAI semantics) of logits
    of tokens a sequence has seen, elementwise: each logit with its token's count in the
    sequence's output (0 for a token seen only in its prompt) and its sequence's penalties.

    repetition: a logit is divided by the penalty when positive and multiplied by it when
    negative. frequency: minus penalty x count in the output. presence: minus penalty if the
    token occurs in the output at all.
    """
    counts = output_counts.to(logits.dtype)
    scaled = torch.where(logits > 0, logits / repetition, logits * repetition)
    # A penalty near float32's bounds can carry a finite logit to +-inf: a row whose every
    # allowed token was seen would have none left to draw, or two at +inf would make a NaN.
    # Finite logits stay within what can be tempered; masked ones keep their -inf.
    bounded = scaled.clamp(-MAX_TEMPERABLE_LOGIT, MAX_TEMPERABLE_LOGIT)
    scaled = torch.where(logits.isfinite(), bounded, logits)
    return scaled - frequency * counts - presence * (output_counts > 0)
