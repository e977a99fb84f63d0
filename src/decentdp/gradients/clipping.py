"""Per-sample gradient clipping (flat l2), as in DP-SGD (Abadi et al. 2016, Algorithm 1).

``clip_C(g) = g * min(1, C / ||g||_2)`` bounds each record's contribution to a batch sum by ``C``,
which is the sensitivity the Gaussian noise ``sigma * C`` is calibrated to.  Norms are summed in
float64 (:func:`squared_norms`): a float32 sum of millions of squares can fall 0.3 % short of the true
norm (measured for 4M equal entries), far more than the clipping margin absorbs.

Three things keep the float32 clipped sum within ``C`` beyond the norm itself:

* **The clip factor is rounded toward zero** (:func:`clip_weights`): the factor is computed in float64,
  and its float32 value must not be the larger one.
* **A sample of absurd size is dropped** (:func:`dropped`), as one with a non-finite gradient is: a
  norm above ``2^100 C`` (a float32 input near ``1e38``, say) makes the factor and the products of the
  weighted sum subnormal, where float32 keeps few significant bits and rounding to nearest can land
  well above the exact value (a reviewer's records of that size reached ``1.0015 C``).  The stacked
  engine also drops a sample whose inputs or output gradients at a layer are so large (entries beyond
  about ``1e27 C`` in the models here) that underflow in a weighted pass could move its contribution by
  :data:`UNDERFLOW_SHARE` of ``C`` (:meth:`~decentdp.gradients.layers.ParamLayer.underflow_error`).
  Dropping a sample because of its own data is a clipping rule like any other: its contribution, zero,
  is within ``C``.
* **Matrix products and convolutions run in IEEE float32** (:func:`ieee_float32`) while the clipped
  sums are formed: by default cuDNN computes float32 convolutions in TF32 (10-bit mantissa, unit
  roundoff ``2^-11`` instead of ``2^-24``), and ``torch.set_float32_matmul_precision("high" | "medium")``
  does the same to cuBLAS products and, on CPUs with bfloat16 units, rounds oneDNN's to bfloat16.  The
  rounding bounds of :mod:`decentdp.gradients.layers` and the clipping margin assume float32 arithmetic
  (under an emulation of TF32, a record crafted to make its per-position gradients cancel reached ``1.165 C``).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

_NORM_EPS = 1e-6
#: Clipping aims this far inside ``C``: a norm computed in float32 over a large model can be ~1e-6 below the true
#: one (measured: clipped norms up to 2e-7 above C through the stacked layers, 9e-7 through the flat path), and
#: the noise is calibrated to a sensitivity of exactly C, so the clipped norm must not exceed it.
_CLIP_MARGIN = 1.0 - 1e-5
#: A sample whose clip factor would fall below this (a norm above ``2^100 C``) is dropped (:func:`dropped`): the
#: factor stays a normal float32 number (above ``2^-126``), with its full 24 significant bits.
MIN_CLIP_FACTOR = 2.0**-100
#: The stacked engine drops a sample when float32 underflow could move its clipped contribution by more than this
#: fraction of ``C`` (:meth:`~decentdp.gradients.layers.ParamLayer.underflow_error`); with the other roundings
#: (below 1e-6 of C, see above) it stays inside :data:`_CLIP_MARGIN`.
UNDERFLOW_SHARE = 1e-6
#: :func:`squared_norms` converts this many elements to float64 at a time at most (128 MiB).
_FLOAT64_BLOCK = 2**24
#: The ``torch.backends`` settings (torch >= 2.9) of the products and convolutions a clipped sum goes through:
#: cuBLAS, cuDNN (convolutions; RNNs only so that cuDNN's legacy ``allow_tf32`` flag stays readable) and oneDNN.
_PRECISION_SETTINGS = ("cuda.matmul", "cudnn.conv", "cudnn.rnn", "mkldnn.matmul", "mkldnn.conv", "mkldnn.rnn")


def squared_norms(tensor: torch.Tensor, trailing: int) -> torch.Tensor:
    """Squared l2 norms over the last ``trailing`` dimensions, as float64, summed in float64.

    The elements are converted block by block of leading rows (at most :data:`_FLOAT64_BLOCK` elements
    at a time), so a float32 tensor of per-sample gradients needs no full float64 copy.
    """
    leading = tensor.shape[: tensor.dim() - trailing]
    rows = tensor.reshape(-1, math.prod(tensor.shape[tensor.dim() - trailing:]))
    out = torch.empty(rows.shape[0], dtype=torch.float64, device=tensor.device)
    step = max(1, _FLOAT64_BLOCK // max(1, rows.shape[1]))
    for start in range(0, rows.shape[0], step):
        block = rows[start:start + step]
        out[start:start + step] = torch.linalg.vector_norm(block, 2, dim=1, dtype=torch.float64).square()
    return out.view(leading)


def clip_factors(norms: torch.Tensor, clip: float) -> torch.Tensor:
    """``min(1, C' / ||g||)`` for each per-sample gradient norm, ``C' = C (1 - 1e-5)`` (:data:`_CLIP_MARGIN`)."""
    return (clip * _CLIP_MARGIN / (norms + _NORM_EPS)).clamp(max=1.0)


def dropped(norms: torch.Tensor, clip: float) -> torch.Tensor:
    """The samples that contribute nothing to a clipped sum whatever their mask: a non-finite norm (0 * inf would
    be NaN), or one so large that the clip factor would fall below :data:`MIN_CLIP_FACTOR` (module docstring)."""
    return ~torch.isfinite(norms) | (norms > clip * _CLIP_MARGIN / MIN_CLIP_FACTOR)


def clip_weights(norms: torch.Tensor, keep: torch.Tensor, clip: float, dtype: torch.dtype) -> torch.Tensor:
    """Each sample's weight in its agent's clipped sum, in ``dtype``: :func:`clip_factors` where ``keep``, else 0,
    rounded toward zero, so that no weight exceeds its float64 value."""
    factors = torch.where(keep, clip_factors(norms, clip), torch.zeros_like(norms))
    weights = factors.to(dtype)
    if dtype == factors.dtype:
        return weights
    return torch.where(weights.to(factors.dtype) > factors, torch.nextafter(weights, torch.zeros_like(weights)),
                       weights)


_precision_lock = threading.Lock()
_precision_holders = 0
_saved_precision: tuple[bool | None, str | None, list[str]] | None = None


def _precision_settings() -> list[object]:
    """The objects of :data:`_PRECISION_SETTINGS` (none before torch 2.9, which has only the legacy flags)."""
    if not hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        return []
    settings = []
    for path in _PRECISION_SETTINGS:
        owner, operation = path.split(".")
        settings.append(getattr(getattr(torch.backends, owner), operation))
    return settings


def _legacy(read: object) -> object:
    """A legacy flag's value, or None where torch refuses to read it (settings mixed through both APIs)."""
    try:
        return read()  # type: ignore[operator]
    except RuntimeError:
        return None


@contextmanager
def ieee_float32() -> Iterator[None]:
    """Hold float32 matrix products and convolutions (cuBLAS, cuDNN, oneDNN) at IEEE float32 inside the block.

    Both of torch's interfaces are set, consistently: the legacy flags (``torch.backends.cudnn.allow_tf32 =
    False``, ``torch.set_float32_matmul_precision("highest")``) and, from torch 2.9, each operation's
    ``fp32_precision = "ieee"`` (an operation left at ``"none"`` would inherit a TF32 or bfloat16 default set for
    its whole backend).  The caller's settings come back when the block ends.  Blocks may nest and may run in
    several threads at once (a sharded run's local shards): the settings are set when the first block starts
    and restored when the last one ends.
    """
    global _precision_holders, _saved_precision
    with _precision_lock:
        if _precision_holders == 0:
            settings = _precision_settings()
            _saved_precision = (_legacy(lambda: torch.backends.cudnn.allow_tf32),
                                _legacy(torch.get_float32_matmul_precision),
                                [setting.fp32_precision for setting in settings])
            torch.backends.cudnn.allow_tf32 = False
            torch.set_float32_matmul_precision("highest")
            for setting in settings:
                setting.fp32_precision = "ieee"
        _precision_holders += 1
    try:
        yield
    finally:
        with _precision_lock:
            _precision_holders -= 1
            if _precision_holders == 0 and _saved_precision is not None:
                allow_tf32, matmul, precisions = _saved_precision
                if allow_tf32 is not None:
                    torch.backends.cudnn.allow_tf32 = allow_tf32
                if matmul is not None:
                    torch.set_float32_matmul_precision(matmul)
                for setting, precision in zip(_precision_settings(), precisions, strict=True):
                    setting.fp32_precision = precision
                _saved_precision = None


def clipped_sum(per_sample: torch.Tensor, mask: torch.Tensor, clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum over each agent's batch of clipped per-sample gradients.

    Parameters
    ----------
    per_sample:
        ``(N, B, d)`` per-sample gradients (padded batches).
    mask:
        ``(N, B)`` with 1 for real samples and 0 for padding.
    clip:
        The clipping norm ``C``.

    Returns
    -------
    The ``(N, d)`` clipped sums and the ``(N, B)`` per-sample norms before clipping (in ``per_sample``'s dtype:
    a norm beyond float32's range comes back as inf).  Padding and :func:`dropped` samples contribute nothing.
    """
    norms = squared_norms(per_sample, 1).sqrt()
    keep = (mask > 0) & ~dropped(norms, clip)
    weights = clip_weights(norms, keep, clip, per_sample.dtype)
    # A dropped gradient's entries are zeroed too, since 0 * inf and 0 * NaN are NaN.
    safe = torch.where(keep[..., None], per_sample, torch.zeros_like(per_sample))
    with ieee_float32():
        sums = torch.einsum("nb,nbd->nd", weights, safe)
    return sums, norms.to(per_sample.dtype)
