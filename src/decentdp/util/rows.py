"""Rows of a stacked tensor that repeat another row bit for bit, so that work on them is done once.

On the complete graph Metropolis-Hastings weights are all ``1 / N``, so after a round of DPDL or DP-DSGT
every agent holds the same model, bit for bit.  The oracle then computes each owner's clipped sum once for
all the models it is sent (:mod:`decentdp.privacy.oracle`), and the evaluator scores one model for all
agents (:mod:`decentdp.runtime.evaluation`).
"""

from __future__ import annotations

import numpy as np
import torch

COMPARED_FIRST = 64
"""Coordinates :func:`repeated_rows` compares before whole rows."""
COMPARE_BLOCK_BYTES = 16 << 20
"""Row bytes :func:`repeated_rows` compares at once (its temporaries stay this small)."""


def repeated_rows(rows: torch.Tensor, groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(distinct, inverse)`` when some row of ``rows`` (``(R, d)``; ``groups``: a host id per row) equals, bit
    for bit, the first row of its group: then ``rows[distinct][inverse]`` are all ``R`` rows and any function of
    a row (with its group) is computed once per distinct one.  ``None`` when no row repeats.

    For cross-gradients the group is the data owner (the same model on the same batch is the same clipped sum);
    for evaluation there is one group (the same model scores the same).  Only on the CPU: the comparison is read
    back to the host, which a GPU run avoids (it computes all rows in one wide call), and a row holding NaN never
    repeats (NaN is unequal to itself)."""
    if rows.device.type != "cpu" or len(groups) < 2:
        return None
    ids = groups.numpy()
    _, first, group = np.unique(ids, return_index=True, return_inverse=True)
    if len(first) == len(ids):
        return None  # one row per group: nothing to compare
    leader = torch.from_numpy(first[group])  # host index tensors, as ``rows`` (checked above) and the groups
    here = torch.arange(len(ids), device=rows.device)
    # A few coordinates first (distinct rows differ in almost all of them), then whole rows, a block at a time.
    same = torch.eq(rows[:, :COMPARED_FIRST], rows[leader, :COMPARED_FIRST]).all(dim=1)
    candidates = torch.nonzero(same & (leader != here)).flatten()
    block = max(1, COMPARE_BLOCK_BYTES // max(1, rows.shape[1] * rows.element_size()))
    for start in range(0, len(candidates), block):
        compared = candidates[start:start + block]
        same[compared] = torch.eq(rows[compared], rows[leader[compared]]).all(dim=1)
    representative = torch.where(same, leader, here)
    distinct = torch.unique(representative)
    if len(distinct) == len(ids):
        return None
    return distinct, torch.searchsorted(distinct, representative)
