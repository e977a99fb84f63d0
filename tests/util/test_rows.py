"""``repeated_rows``: rows equal bit for bit to their group's first row, found so that work on them is done once."""

from __future__ import annotations

import torch

from decentdp.util.rows import COMPARE_BLOCK_BYTES, repeated_rows


def test_repeated_rows_pairs_each_repeat_with_its_groups_first_row() -> None:
    models = torch.randn(7, 100)
    models[2] = models[0]
    models[4] = models[5] = models[3]
    models[5, 99] += 1.0  # differs from group 2's first row in its last coordinate only
    models[6] = models[1]  # the same row in another group: not a repeat
    owners = torch.tensor([0, 1, 0, 2, 2, 2, 3])
    distinct, inverse = repeated_rows(models, owners)
    assert distinct.tolist() == [0, 1, 3, 5, 6] and inverse.tolist() == [0, 1, 0, 2, 2, 3, 4]
    torch.testing.assert_close(models[distinct][inverse][[0, 1, 2, 3, 4, 6]], models[[0, 1, 2, 3, 4, 6]],
                               rtol=0, atol=0)
    assert repeated_rows(models, torch.arange(7)) is None  # one row per group
    with_nan = models.clone()
    with_nan[:, 50] = float("nan")
    assert repeated_rows(with_nan, owners) is None  # NaN equals nothing: every row is computed


def test_rows_longer_than_a_compared_block_are_compared_whole() -> None:
    """Rows wider than the comparison's block are compared a few at a time; a difference in the last coordinate
    of the last row still counts."""
    width = COMPARE_BLOCK_BYTES // 4 + 3
    rows = torch.zeros(4, width)
    rows[3, -1] = 1.0
    distinct, inverse = repeated_rows(rows, torch.zeros(4, dtype=torch.int64))
    assert distinct.tolist() == [0, 3] and inverse.tolist() == [0, 0, 0, 1]
