"""The algorithms, one file each, and the registry that builds them from a config."""

from __future__ import annotations

from typing import TYPE_CHECKING

from decentdp.algorithms.base import Algorithm
from decentdp.algorithms.central_dpsgd import CentralDPSGD
from decentdp.algorithms.dp_dinno import DPDiNNO
from decentdp.algorithms.dp_dsgd import DPDSGD
from decentdp.algorithms.dp_dsgt import DPDSGT
from decentdp.algorithms.local import LocalTraining
from decentdp.algorithms.optim import make_optimizer

if TYPE_CHECKING:
    from decentdp.config import ExperimentConfig

_CLASSES: dict[str, type[Algorithm]] = {cls.name: cls for cls in (CentralDPSGD, LocalTraining, DPDSGD, DPDSGT, DPDiNNO)}
ALGORITHMS: tuple[str, ...] = tuple(_CLASSES)


def algorithm_class(name: str) -> type[Algorithm]:
    """The class registered under ``name`` (names are validated by the config schema)."""
    return _CLASSES[name]


def build_algorithm(config: ExperimentConfig) -> Algorithm:
    """The algorithm named by ``config.algorithm.name`` with its hyper-parameters."""
    cfg = config.algorithm
    optimizer = make_optimizer(cfg.optimizer, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                               nesterov=cfg.nesterov)
    if cfg.name == CentralDPSGD.name:
        return CentralDPSGD(optimizer)
    if cfg.name == LocalTraining.name:
        return LocalTraining(optimizer)
    if cfg.name == DPDSGD.name:
        return DPDSGD(optimizer)
    if cfg.name == DPDSGT.name:
        return DPDSGT(weight_decay=cfg.weight_decay)
    if cfg.name == DPDiNNO.name:
        return DPDiNNO(optimizer, rho=cfg.rho, rho_growth=cfg.rho_growth, primal_steps=cfg.primal_steps,
                       reset_each_round=cfg.reset_optimizer_each_round)
    raise ValueError(f"unknown algorithm {cfg.name!r}; allowed: {', '.join(ALGORITHMS)}")
