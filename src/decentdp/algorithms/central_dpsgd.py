"""Central DP-SGD (Abadi et al. 2016): one model trained on the union of all agents' data.

The upper baseline of the consensus paper (its "Central" rows): the runner pools every agent's
records into a single agent, which then trains exactly like :class:`LocalTraining` (Poisson
batches of rate ``L / |D|``, clipping, Gaussian noise, optimizer step).
"""

from __future__ import annotations

from typing import ClassVar

from decentdp.algorithms.local import LocalTraining
from decentdp.algorithms.registry import register


@register
class CentralDPSGD(LocalTraining):
    """DP-SGD on pooled data: a single agent, no communication."""

    name: ClassVar[str] = "central-dpsgd"
    pools_data: ClassVar[bool] = True
    reads_mixing: ClassVar[bool] = False  # one agent: no graph
