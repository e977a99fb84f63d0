"""The algorithm registry: an algorithm is one file that registers itself; nothing else names it.

``@register`` adds a class under its ``name``; the config schema validates ``algorithm.name`` and
the algorithm's own settings through this registry, and the runner builds the algorithm from it.
Algorithms in this package are imported (and so registered) when :mod:`decentdp.algorithms` is;
an algorithm defined anywhere else registers itself the same way when its module is imported.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import TypeVar

from decentdp.algorithms.base import Algorithm, AlgorithmSettings

_REGISTRY: dict[str, type[Algorithm]] = {}
A = TypeVar("A", bound=type[Algorithm])


def register(cls: A) -> A:
    """Class decorator: make ``cls`` available as ``algorithm.name = cls.name``."""
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"{cls.__qualname__} needs a class attribute `name`")
    if not (isinstance(cls.Settings, type) and issubclass(cls.Settings, AlgorithmSettings)):
        raise TypeError(f"{cls.__qualname__}.Settings must subclass AlgorithmSettings")
    existing = _REGISTRY.get(name)
    if existing is not None and existing.__qualname__ != cls.__qualname__:
        raise ValueError(f"algorithm name {name!r} is already registered by {existing.__qualname__}")
    _REGISTRY[name] = cls
    return cls


def algorithm_names() -> tuple[str, ...]:
    """Every registered algorithm name, sorted."""
    return tuple(sorted(_REGISTRY))


def algorithm_class(name: str) -> type[Algorithm]:
    """The class registered under ``name``; KeyError names the allowed ones."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown algorithm {name!r}; allowed: {', '.join(algorithm_names())}") from None


def load_package_algorithms() -> None:
    """Import every module of :mod:`decentdp.algorithms`, so that each registers its algorithm."""
    package = importlib.import_module("decentdp.algorithms")
    for module in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"decentdp.algorithms.{module.name}")
