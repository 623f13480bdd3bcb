"""The induction probe's rows: segments repeated at once, and the copy mask marking exactly the
tokens a model can know (a repeat's tokens after its first), so that its accuracy means
copying."""

import argparse

import torch

from tools.induction_probe import FIRST_ID, rows


def test_the_mask_marks_each_repeats_tokens_after_its_first():
    args = argparse.Namespace(context=128, seg_min=2, seg_max=6, token_range=4096)
    ids, mask = rows(args, torch.Generator().manual_seed(0), 8)
    assert ids.shape == mask.shape == (8, 128)
    assert int(ids.min()) >= FIRST_ID and int(ids.max()) < 4096
    checked = 0
    for row, marks in zip(ids.tolist(), mask.tolist(), strict=True):
        position = 0
        while True:
            # The segment's length: its tokens stand again right after it (with 4,093 ids a
            # shorter false match is all but impossible, and the seed is fixed).
            whole = [
                k
                for k in range(2, 7)
                if position + 2 * k <= len(row)
                and row[position : position + k] == row[position + k : position + 2 * k]
            ]
            if not whole:
                break  # the row's last pair, cut by its end
            k = whole[0]
            assert not any(marks[position : position + k + 1])
            assert all(marks[position + k + 1 : position + 2 * k])
            position += 2 * k
            checked += 1
    assert checked > 8 * 10
