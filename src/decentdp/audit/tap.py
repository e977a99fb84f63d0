"""A tap on released messages: what an observer of an agent's releases records, without touching algorithms.

Every value an algorithm may send is a release of :meth:`DataOracle.release` or post-processing of
releases (``docs/architecture.md``, the privacy boundary).  The strongest observer of an agent is
therefore one that sees its releases themselves, as all its neighbours together do (the ledger's
agent view charges exactly that); a neighbour that knows the other messages mixed into the agent's
next model recovers the release from it (DSGD: ``theta_i' = sum_j w_ij theta_j - lr G_i``).

:class:`ReleaseTap` observes the oracle's ``release`` from outside: it shadows the method on the
one oracle instance it is attached to (``oracle.gradient`` calls ``self.release``, so the common
case is observed too), records a projection of the watched agents' rows and hands the released
values back unchanged.  Algorithms, mechanisms and the oracle's code are not changed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from decentdp.privacy.oracle import Clipped, DataOracle

Projection = Callable[[torch.Tensor], torch.Tensor]
"""Maps released rows ``(R, d)`` to what the observer keeps of each, ``(R,)`` or ``(R, k)``."""


class ReleaseTap:
    """Records, for every release of ``oracle``, the watched agents' rows under ``project``.

    Each release appends to :attr:`values` a ``(W, ...)`` tensor: for watched row ``w`` the sum of
    the projections of the rows it released (several rows on one batch: a joint release, e.g.
    cross-gradients), and to :attr:`rows` how many rows it released (0: it released nothing).
    """

    def __init__(self, oracle: DataOracle, watched: torch.Tensor, project: Projection) -> None:
        self.oracle = oracle
        self.project = project
        self.values: list[torch.Tensor] = []
        self.rows: list[torch.Tensor] = []
        self._slot = torch.full((oracle.n_agents,), -1, dtype=torch.long, device=watched.device)
        self._slot[watched] = torch.arange(len(watched), device=watched.device)
        self._watched = len(watched)
        self._release = oracle.release
        oracle.release = self._observe  # type: ignore[method-assign]  # this instance only

    def detach(self) -> None:
        """Stop observing: the oracle's own ``release`` is used again."""
        if self.oracle.__dict__.get("release") == self._observe:
            del self.oracle.release

    def _observe(self, *sums: Clipped, **options: object) -> tuple[torch.Tensor, ...]:
        owners = torch.cat([item.owners for item in sums])  # read before the release unseals the sums
        released = self._release(*sums, **options)
        slot = self._slot.to(owners.device)[owners]
        keep = slot >= 0
        projected = self.project(torch.cat(released)[keep])
        total = torch.zeros(self._watched, *projected.shape[1:], dtype=projected.dtype, device=projected.device)
        self.values.append(total.index_add_(0, slot[keep], projected))
        self.rows.append(torch.bincount(slot[keep], minlength=self._watched))
        return released
