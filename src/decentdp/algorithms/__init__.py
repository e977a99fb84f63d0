"""The algorithms, one file each, registered by name (see :mod:`decentdp.algorithms.registry`)."""

from decentdp.algorithms.registry import algorithm_class, algorithm_names, load_package_algorithms, register

load_package_algorithms()

__all__ = ["algorithm_class", "algorithm_names", "register"]
