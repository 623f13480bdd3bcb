"""Synthetic request workloads, without torch: request lengths drawn from ranges and random
token ids. The scripts that run no model in their own process (api_throughput.py, and
serving_throughput.py's served modes) import this rather than common.py, which loads torch
and transformers."""

from __future__ import annotations

import argparse
import random


def length_range(text: str) -> tuple[int, int]:
    """A length, "N", or a range to draw each request's from, "MIN-MAX" (inclusive)."""
    low, _, high = text.partition("-")
    bounds = (int(low), int(high or low))
    if not 1 <= bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"expected N or MIN-MAX with 1 <= MIN <= MAX: {text}")
    return bounds


def random_tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    """n random token ids below `vocab`."""
    return [rng.randrange(vocab) for _ in range(n)]
