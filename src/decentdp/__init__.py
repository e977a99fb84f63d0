"""decentdp: differentially private decentralized learning.

The public API, three calls from a config file to results (a notebook needs nothing else)::

    import decentdp

    config = decentdp.load_config("experiments/demo.toml", overrides=["experiment.rounds=50"])  # --set syntax
    result = decentdp.run(config)                # trains; result.summary, .metrics, .state (out_dir= writes a folder)
    built = decentdp.assemble(config)            # or: every component (data, privacy stack, simulator), unrun

``run`` and ``assemble`` validate the config again as a whole, so a config changed after loading
(``config.schedule.kind = "pairing"``) is checked as a loaded one is; both also take a config file's path.

They are imported on first use, so that ``import decentdp`` stays light and the thread settings below come
before anything loads torch.
"""

# Idle OpenMP threads must sleep, not spin.  torch (2.13.0+cpu wheel) runs its intra-op work and
# MKL on GNU OpenMP (its bundled libgomp), whose threads busy-wait at every barrier and between
# parallel regions for GOMP_SPINCOUNT = 300000 spins (a few milliseconds) unless
# OMP_WAIT_POLICY=PASSIVE makes them sleep at once.  With a core taken by another process, the
# spinning threads and the one that is not running stall each other at every small operation.
# On 2 cores the demo's training loop took 2-3 s instead of 0.6 s next to one busy process, and
# 6-139 s when two demos ran at once; with passive waiting, 0.8 s in both cases.  The price is
# paid on a quiet machine: waking a sleeping thread costs more than finding it spinning (0.6 ->
# 1.5 s for the demo's tiny operations, 7 % for a ConvNet); BENCHMARKS.md, "Next to a busy
# process (issue 11)", has the figures.  KMP_BLOCKTIME=0 is the same for Intel's OpenMP
# (libiomp5), which other torch builds use.  The runtime reads these once, when torch loads it,
# so they are set here, before anything imports torch: importing torch ahead of decentdp leaves
# them without effect in that process (child processes still inherit them).  A user's own
# setting of any of them is left alone, and then none is set (GOMP_SPINCOUNT overrides the
# policy's spin count).
import importlib as _importlib
import os as _os
from typing import Any as _Any

if not any(name in _os.environ for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME", "KMP_LIBRARY")):
    _os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    _os.environ.setdefault("KMP_BLOCKTIME", "0")

__version__ = "0.1.0"

#: Public name -> (module, attribute), imported on first use.
_PUBLIC = {"load_config": ("decentdp.config", "load_config"),
           "validate_config": ("decentdp.config", "validate_config"),
           "assemble": ("decentdp.experiment.build", "build_experiment"),
           "run": ("decentdp.experiment.loop", "run_experiment")}

__all__ = ["__version__", *_PUBLIC]


def __getattr__(name: str) -> _Any:
    if name in _PUBLIC:
        module, attribute = _PUBLIC[name]
        return getattr(_importlib.import_module(module), attribute)
    raise AttributeError(f"module 'decentdp' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
