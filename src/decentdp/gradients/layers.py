"""Layers applied to all N agents at once, with per-sample gradient norms that need no per-sample gradients.

DP-SGD clips each sample's gradient to norm ``C``, so it needs every sample's gradient *norm* and
then one *weighted* sum of gradients, ``sum_b c_b grad l_b`` with ``c_b = min(1, C / ||grad l_b||)``.
For the layers below both follow from what an ordinary backward pass already has, the layer's
input ``a`` and the gradient ``g`` of the loss with respect to its output ("book-keeping", Bu et
al. 2023, arXiv:2210.00038):

* **linear** ``z = W a + b``: a sample's weight gradient is ``sum_t g_t a_t^T`` over its positions
  ``t``; with one position its squared norm is ``||g||^2 ||a||^2`` (Goodfellow 2015), with T
  positions it is ``sum_{t,t'} (g_t . g_t')(a_t . a_t')`` ("ghost norm", Li et al. 2022,
  arXiv:2110.05679), or the materialised ``T x out x in`` product when that is cheaper (mixed
  ghost clipping, Bu et al. 2022, arXiv:2205.10683);
* **convolution**: the same, with ``a_t`` the input patch under output position ``t`` (unfold);
  the materialised per-sample gradient is one grouped convolution of each sample's input with its
  own output gradient (Rochette et al. 2019, arXiv:1912.06015), no patches needed;
* **group norm**: the affine weight's per-sample gradient is ``sum_t g_t * a_hat_t`` per channel;
* **embedding**: a sample's gradient has row ``v`` equal to the sum of ``g_t`` over positions
  holding token ``v``, so its squared norm is ``sum_{t,t'} [v_t = v_t'] g_t . g_t'``.

Every layer holds the parameters of all agents stacked along a leading agent dimension
``(N, *shape)`` and maps activations ``(N, B, ...)`` to ``(N, B, ...)``; agents never see each
other's parameters (a convolution runs once per agent, or for many agents as one grouped
convolution with ``groups = N``).  A layer can
also take one input ``(B, ...)`` shared by all agents (evaluation on a common test set), which
turns the first layer into one wide convolution or matrix product instead of N copies of the input.

**Augmentation multiplicity** (De et al. 2022, arXiv:2204.13650): a "sample" may be ``K`` augmented
copies of one record, held as ``K`` consecutive rows ``(N, B * K, ...)``, whose gradients are summed
before the norm is taken (``copies = K``).  For the rules above the copies are just more positions
of one sample: the ghost norms run over ``K * T`` positions, and the materialised per-sample
gradients are summed over the copies.

**Rounding.** Norms are summed in float64.  A ghost norm subtracts large terms when a sample's
per-position terms ``g_t a_t^T`` nearly cancel, and the weighted pass then sums those same large terms
in the parameters' precision, so the vector it computes can be far longer than the true, tiny gradient
(a crafted record reached 22 C through float32 grams).  The ghost rules therefore return a certified
upper bound instead of the norm: the float64 grams' rounding error is at most ``gamma_n S^2`` and the
weighted pass's at most ``gamma_{K T} S`` (``S = sum_t ||a_t|| ||g_t||``, ``gamma_n ~ n u``, the
classical bound for a sum of ``n`` products in any order; Higham 2002, Sec. 3.1), both added with a
factor 2 to spare (:func:`_ghost_bound`).  For the other rules the clipped vector is the tensor whose
norm was taken, or one product per entry.  These bounds take float32 arithmetic (unit roundoff ``2^-24``):
the weighted passes run under :func:`~decentdp.gradients.clipping.ieee_float32`, since cuDNN computes
float32 convolutions in TF32 (``2^-11``) by default.  Near underflow, the weighted pass from activations
(``sum_t fl(c g_t) a_t^T``) is off by up to ``2^-126`` per entry of ``c g_t``, which a huge ``a_t`` carries
far beyond any relative bound; :meth:`ParamLayer.underflow_error` bounds that, and the engine drops a
sample for which it matters (:data:`~decentdp.gradients.clipping.UNDERFLOW_SHARE`).

The per-sample results are checked against one-sample-at-a-time autograd in
``tests/gradients/test_layers.py`` for every layer type, with property-based shapes.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from decentdp.gradients.clipping import squared_norms

Tensor = torch.Tensor

#: Temporaries of the per-sample norm computations are built this many samples at a time at most,
#: so that they stay below this many bytes (bounded memory, and blocks the allocator can reuse).
MAX_TEMPORARY_BYTES = 128 * 2**20
#: Up to this many agents a convolution runs once per agent instead of as one grouped convolution.
LOOP_CONV_MAX_AGENTS = 32


class Unsupported(Exception):
    """Raised while compiling a module that has no stacked rule; the message says which and why."""


def _sample_chunks(total: int, bytes_per_sample: int) -> list[slice]:
    """Slices of ``range(total)`` whose temporaries stay within :data:`MAX_TEMPORARY_BYTES`."""
    step = max(1, MAX_TEMPORARY_BYTES // max(1, bytes_per_sample))
    return [slice(start, min(total, start + step)) for start in range(0, total, step)]


def _norms(vectors: Tensor, dim: int = -1) -> Tensor:
    """The l2 norm of each vector along ``dim``, summed in float64 (float64 result; short vectors: no blocks)."""
    return torch.linalg.vector_norm(vectors, 2, dim=dim, dtype=torch.float64)


def _ghost_bound(ghost: Tensor, scale: Tensor, gram_length: int, positions: int, dtype: torch.dtype) -> Tensor:
    """A certified upper bound on the squared norm of the weight gradient the weighted pass computes for a
    sample (module docstring, "Rounding").

    ``ghost`` is ``sum_{t,t'} (a_t . a_t')(g_t . g_t')`` from float64 grams whose dot products have
    ``gram_length`` terms, over ``positions`` positions; ``scale`` is ``S = sum_t ||a_t|| ||g_t||``.  Then
    ``||G||^2 <= ghost + 2 (gram_length + positions^2 + 2) u64 S^2`` and the computed vector is at most
    ``2 (positions + 2) u S`` longer than ``G`` (``u`` the unit roundoff of ``dtype``).
    """
    gram_rounding = 2 * (gram_length + positions * positions + 2) * _unit_roundoff(torch.float64) * scale.square()
    return ((ghost.clamp(min=0.0) + gram_rounding).sqrt() + _sum_rounding(scale, positions, dtype)).square()


def _summed_bias_bound(computed_sq: Tensor, scale: Tensor, positions: int, dtype: torch.dtype) -> Tensor:
    """A certified upper bound on the squared norm of a bias gradient ``sum_t g_t`` that the norm pass and
    the weighted pass each sum on their own in ``dtype``: the computed norm plus both sums' rounding
    (``scale = sum_t ||g_t||``)."""
    return (computed_sq.clamp(min=0.0).sqrt() + 2 * _sum_rounding(scale, positions, dtype)).square()


def _sum_rounding(scale: Tensor, positions: int, dtype: torch.dtype) -> Tensor:
    """Twice the classical bound ``gamma_{positions+2} S`` on the rounding of ``sum_t g_t a_t^T`` in ``dtype``."""
    return 2 * (positions + 2) * _unit_roundoff(dtype) * scale


def _unit_roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2


#: How far one float32 operation near underflow can be off besides its relative rounding: the smallest normal
#: number, since a kernel may flush subnormal inputs and results to zero (FTZ/DAZ; gradual underflow: 2^-150).
_UNDERFLOW = 2.0**-126


def _underflow_bound(input_max: Tensor, output_max: Tensor, positions: int, inputs: int, outputs: int) -> Tensor:
    """A bound on how far underflow moves ``sum_t fl(c g_t) a_t^T`` and ``sum_t fl(c g_t)`` (``c <= 1``) for a
    sample whose ``positions`` inputs ``a_t`` (``inputs`` entries each) and output gradients ``g_t`` (``outputs``
    entries) have entries of size at most ``input_max`` and ``output_max``: each entry of ``c g_t`` off by
    :data:`_UNDERFLOW` (``sqrt(outputs) ||a_t||`` in the product), each entry of ``a_t`` read as zero
    (``sqrt(inputs) ||g_t||``), with ``||a_t|| <= sqrt(inputs) input_max`` and ``||g_t|| <= sqrt(outputs)
    output_max``, and each of the ``positions (inputs + 1) outputs`` products and sums off by :data:`_UNDERFLOW`
    once more (counted twice).  Entries' maxima rather than norms: one float32 pass, no float64 copy."""
    return _UNDERFLOW * positions * (math.sqrt(inputs * outputs) * (input_max.double() + output_max.double())
                                     + 2 * math.sqrt((inputs + 1) * outputs))


def _sample_max(tensor: Tensor, samples: tuple[int, int]) -> Tensor:
    """The largest entry's size of each of the ``(N, B)`` samples (consecutive rows) of ``tensor``; NaN stays NaN.
    (``amax`` and ``amin``: on this project's CPU four times as fast as ``vector_norm(ord=inf)`` or ``aminmax``.)"""
    rows = tensor.reshape(*samples, -1)
    return torch.maximum(rows.amax(dim=-1), -rows.amin(dim=-1))


def _agent_weighted_sums(weights: Tensor, per_sample: Sequence[Tensor], out: Sequence[Tensor]) -> None:
    """``out[k][n] = sum_b w[n, b] * per_sample[k][n, b, ...]`` for every agent and parameter ``k``."""
    n_agents, batch = weights.shape
    for grad, target in zip(per_sample, out, strict=True):
        torch.bmm(weights.unsqueeze(1), grad.reshape(n_agents, batch, -1), out=target.view(n_agents, 1, -1))


def _sum_copies(per_copy: Tensor, copies: int) -> Tensor:
    """``(N, B * K, ...)`` per-copy gradients summed into ``(N, B, ...)`` per-sample ones."""
    if copies == 1:
        return per_copy
    return per_copy.view(per_copy.shape[0], -1, copies, *per_copy.shape[2:]).sum(dim=2)


def _copies_as_positions(per_copy: Tensor, copies: int) -> Tensor:
    """``(S * K, c, T)`` rows, ``K`` consecutive copies per sample, as ``(S, c, K * T)``: copies become positions."""
    if copies == 1:
        return per_copy
    rows, channels, positions = per_copy.shape
    grouped = per_copy.view(rows // copies, copies, channels, positions).transpose(1, 2)
    return grouped.reshape(rows // copies, channels, copies * positions)


@dataclass
class Recorded:
    """What a layer kept from the forward pass: its input as the per-sample rules need it (the
    normalised activations for a norm layer) and its output."""

    layer: ParamLayer
    saved: Tensor
    output: Tensor


class ParamLayer(ABC):
    """A layer with trainable parameters, evaluated for all agents at once."""

    #: Names of the layer's parameters inside its module (``weight``, ``bias``), in flat order.
    param_names: tuple[str, ...]

    @abstractmethod
    def forward(self, params: Sequence[Tensor], x: Tensor, shared: bool) -> tuple[Tensor, Tensor]:
        """``(saved input, output)`` for stacked ``params`` and input ``x``.

        ``x`` is ``(N, B, ...)``, or ``(B, ...)`` when ``shared`` (the same input for every agent).
        The saved input is what the per-sample rules need (e.g. the normalised activations of a
        norm layer); the output is ``(N, B, ...)``.
        """

    @abstractmethod
    def per_sample_sq_norms(self, saved: Tensor, grad_out: Tensor,
                            copies: int = 1) -> tuple[Tensor, list[Tensor] | None]:
        """Squared norm of each sample's gradient over this layer's parameters, ``(N, B)``.

        ``saved`` and ``grad_out`` hold ``B * copies`` rows per agent, each sample's ``copies`` rows
        consecutive; a sample's gradient is the sum of its copies' (module docstring).  Also returns
        the per-sample gradients ``[(N, B, *shape) per parameter]`` when the rule materialised them
        anyway (then :meth:`weighted_gradients` reuses them), else ``None``.
        """

    def weighted_gradients(self, saved: Tensor, grad_out: Tensor, weights: Tensor,
                           per_sample: list[Tensor] | None, out: Sequence[Tensor], copies: int = 1) -> None:
        """Write ``sum_b weights[n, b] * grad_b`` of each parameter into ``out`` (``(N, *shape)`` views,
        typically of the flat ``(N, d)`` gradient matrix, so that no per-layer copy is needed):
        from the per-sample gradients when :meth:`per_sample_sq_norms` built them, else from the
        saved input and the output gradient (each copy weighted as its sample)."""
        if per_sample is not None:
            _agent_weighted_sums(weights, per_sample, out)
        else:
            rows = weights if copies == 1 else weights.repeat_interleave(copies, dim=1)
            self._weighted_from_activations(saved, grad_out, rows, out)

    def underflow_error(self, saved: Tensor, grad_out: Tensor, copies: int = 1) -> Tensor | None:
        """A bound ``(N, B)`` (float64) on how far float32 underflow can move each sample's weighted gradient when
        :meth:`weighted_gradients` works from the activations (:meth:`per_sample_sq_norms` returned no per-sample
        gradients), whatever its clip factor; None where that is negligible.

        The default, None, is for passes that multiply each factor only into values they then sum or copy (the
        embedding's rows): underflow moves such a gradient by at most ``2^-126`` per entry and position, below
        ``1e-30`` for any model here.  A linear or convolution layer multiplies ``c g_t`` by its input ``a_t``,
        which can carry an error of ``2^-126`` in ``c g_t`` into one of any size (module docstring, "Rounding").
        """
        return None

    @abstractmethod
    def _weighted_from_activations(self, saved: Tensor, grad_out: Tensor, weights: Tensor,
                                   out: Sequence[Tensor]) -> None:
        """:meth:`weighted_gradients` without per-sample gradients (as an ordinary backward would)."""


# ---------------------------------------------------------------------------------------------
# Linear
# ---------------------------------------------------------------------------------------------


class StackedLinear(ParamLayer):
    """``nn.Linear`` over inputs ``(N, B, ..., in)``; positions are the middle dimensions."""

    def __init__(self, module: nn.Linear) -> None:
        self.bias = module.bias is not None
        self.param_names = ("weight", "bias") if self.bias else ("weight",)

    def forward(self, params: Sequence[Tensor], x: Tensor, shared: bool) -> tuple[Tensor, Tensor]:
        weight = params[0]
        n_agents, out_features, in_features = weight.shape
        if shared:
            # One product for all agents: (P, in) @ (in, N * out).
            flat = x.reshape(-1, in_features) @ weight.reshape(n_agents * out_features, in_features).T
            out = flat.view(-1, n_agents, out_features).transpose(0, 1)
            out = out.reshape(n_agents, *x.shape[:-1], out_features)
        else:
            flat = torch.bmm(x.reshape(n_agents, -1, in_features), weight.transpose(1, 2))
            out = flat.view(*x.shape[:-1], out_features)
        if self.bias:
            out = out + params[1].view(n_agents, *([1] * (out.dim() - 2)), out_features)
        return x, out

    def per_sample_sq_norms(self, saved: Tensor, grad_out: Tensor,
                            copies: int = 1) -> tuple[Tensor, list[Tensor] | None]:
        n_agents, batch = grad_out.shape[0], grad_out.shape[1] // copies
        a = saved.reshape(n_agents, batch, -1, saved.shape[-1])       # (N, B, K * T, in): copies are positions
        g = grad_out.reshape(n_agents, batch, -1, grad_out.shape[-1])  # (N, B, K * T, out)
        positions, p, q = a.shape[2], a.shape[3], g.shape[3]
        bias_sq = squared_norms(g.sum(dim=2), 1) if self.bias else 0.0
        if positions == 1:  # ||g a^T||_F = ||g|| ||a||
            return squared_norms(a, 2) * squared_norms(g, 2) + bias_sq, None
        if positions * (p + q) < p * q:  # ghost norm: sum_{t,t'} (a_t . a_t')(g_t . g_t'), a certified bound
            sq = torch.empty(n_agents, batch, dtype=torch.float64, device=g.device)
            for rows in _sample_chunks(batch, n_agents * positions * (16 * positions + 8 * (p + q))):
                a64, g64 = a[:, rows].double(), g[:, rows].double()
                ghost = ((a64 @ a64.transpose(-1, -2)) * (g64 @ g64.transpose(-1, -2))).sum(dim=(-1, -2))
                scale = (_norms(a64) * _norms(g64)).sum(dim=-1)
                sq[:, rows] = _ghost_bound(ghost, scale, max(p, q), positions, g.dtype)
            if self.bias:
                bias_sq = _summed_bias_bound(bias_sq, _norms(g).sum(dim=-1), positions, g.dtype)
            return sq + bias_sq, None
        weight = torch.einsum("nbto,nbti->nboi", g, a)
        per_sample = [weight, g.sum(dim=2)] if self.bias else [weight]
        return squared_norms(weight, 2) + bias_sq, per_sample

    def underflow_error(self, saved: Tensor, grad_out: Tensor, copies: int = 1) -> Tensor | None:
        samples = (grad_out.shape[0], grad_out.shape[1] // copies)
        positions = saved[0, 0, ..., 0].numel() * copies  # (N, B * K, ..., in): the middle dimensions, all copies
        return _underflow_bound(_sample_max(saved, samples), _sample_max(grad_out, samples), positions,
                                saved.shape[-1], grad_out.shape[-1])

    def _weighted_from_activations(self, saved: Tensor, grad_out: Tensor, weights: Tensor,
                                   out: Sequence[Tensor]) -> None:
        n_agents, batch = weights.shape
        scale = weights.view(n_agents, batch, *([1] * (grad_out.dim() - 2)))
        g = (grad_out * scale).reshape(n_agents, -1, grad_out.shape[-1])
        torch.bmm(g.transpose(1, 2), saved.reshape(n_agents, -1, saved.shape[-1]), out=out[0])
        if self.bias:
            out[1].copy_(g.sum(dim=1))


# ---------------------------------------------------------------------------------------------
# Convolution
# ---------------------------------------------------------------------------------------------


def _pair(value: int | tuple[int, ...]) -> tuple[int, int]:
    return (value, value) if isinstance(value, int) else (int(value[0]), int(value[1]))


class StackedConv2d(ParamLayer):
    """``nn.Conv2d`` (``groups = 1``, zero padding) for all agents: once per agent, or one grouped convolution."""

    def __init__(self, module: nn.Conv2d) -> None:
        if module.groups != 1:
            raise Unsupported(f"Conv2d with groups={module.groups} (only groups=1 has a stacked rule)")
        if module.padding_mode != "zeros":
            raise Unsupported(f"Conv2d with padding_mode={module.padding_mode!r} (only 'zeros')")
        if isinstance(module.padding, str):
            raise Unsupported(f"Conv2d with padding={module.padding!r} (only numeric padding)")
        self.bias = module.bias is not None
        self.param_names = ("weight", "bias") if self.bias else ("weight",)
        self.stride = _pair(module.stride)
        self.padding = _pair(module.padding)
        self.dilation = _pair(module.dilation)
        self.kernel = _pair(module.kernel_size)
        self.out_channels = module.out_channels
        self.in_channels = module.in_channels

    def _conv(self, x: Tensor, weight: Tensor, bias: Tensor | None, groups: int) -> Tensor:
        return F.conv2d(x, weight, bias, self.stride, self.padding, self.dilation, groups)

    def forward(self, params: Sequence[Tensor], x: Tensor, shared: bool) -> tuple[Tensor, Tensor]:
        weight = params[0]
        n_agents = weight.shape[0]
        wide = weight.reshape(n_agents * self.out_channels, *weight.shape[2:])
        bias = params[1].reshape(-1) if self.bias else None
        if shared:  # (P, C, H, W) with N * out channels: the input is read once for all agents
            batch = x.shape[0]
            out = self._conv(x, wide, bias, groups=1)
        elif n_agents <= LOOP_CONV_MAX_AGENTS:
            # One convolution per agent: oneDNN's grouped convolution took twice as long as N plain
            # ones for the ConvNet at N = 10 on this project's CPU (27 against 14 ms, forward alone).
            return x, torch.stack([self._conv(x[i], weight[i], params[1][i] if self.bias else None, groups=1)
                                   for i in range(n_agents)])
        else:  # agents side by side in the channel dimension, one group each
            batch = x.shape[1]
            out = self._conv(x.transpose(0, 1).reshape(batch, n_agents * self.in_channels, *x.shape[3:]),
                             wide, bias, groups=n_agents)
        out = out.view(batch, n_agents, self.out_channels, *out.shape[2:]).transpose(0, 1)
        return x, out

    def _cost_ghost_over_materialised(self, positions: int) -> float:
        p = self.in_channels * self.kernel[0] * self.kernel[1]
        return positions * (p + self.out_channels) / (p * self.out_channels)

    def _per_sample_weights(self, a: Tensor, g: Tensor) -> Tensor:
        """Each sample's weight gradient by one grouped convolution of its input with its output gradient."""
        samples = a.shape[0]
        inputs = a.transpose(0, 1)                                   # (C_in, S, H, W): samples as channels
        kernels = g.reshape(samples * self.out_channels, 1, *g.shape[2:])
        # Stride and dilation swap roles in the weight gradient of a convolution.
        full = F.conv2d(inputs, kernels, None, self.dilation, self.padding, self.stride, groups=samples)
        full = full[..., : self.kernel[0], : self.kernel[1]]
        return full.reshape(self.in_channels, samples, self.out_channels, *self.kernel).permute(1, 2, 0, 3, 4)

    def _ghost_sq_norms(self, a: Tensor, g: Tensor, copies: int) -> Tensor:
        """Certified upper bounds (:func:`_ghost_bound`) on the squared weight-gradient norms of
        ``len(a) // copies`` samples, each ``copies`` consecutive rows of ``a`` and ``g``."""
        patches = _copies_as_positions(F.unfold(a, self.kernel, self.dilation, self.padding, self.stride),
                                       copies).double()                             # (S, p, K * T)
        outputs = _copies_as_positions(g.reshape(g.shape[0], self.out_channels, -1), copies).double()  # (S, q, K*T)
        ghost = ((patches.transpose(1, 2) @ patches) * (outputs.transpose(1, 2) @ outputs)).sum(dim=(1, 2))
        scale = (_norms(patches, dim=1) * _norms(outputs, dim=1)).sum(dim=1)
        return _ghost_bound(ghost, scale, max(patches.shape[1], outputs.shape[1]), patches.shape[2], g.dtype)

    def per_sample_sq_norms(self, saved: Tensor, grad_out: Tensor,
                            copies: int = 1) -> tuple[Tensor, list[Tensor] | None]:
        n_agents, batch = grad_out.shape[0], grad_out.shape[1] // copies
        samples = n_agents * batch
        a = saved.reshape(samples * copies, *saved.shape[2:])
        g = grad_out.reshape(samples * copies, *grad_out.shape[2:])
        positions = copies * g.shape[2] * g.shape[3]
        bias = g.sum(dim=(2, 3)).view(samples, copies, self.out_channels).sum(dim=1) if self.bias else None
        bias_sq = squared_norms(bias, 1).view(n_agents, batch) if bias is not None else 0.0
        if self._cost_ghost_over_materialised(positions) < 1.0:
            sq = torch.empty(samples, dtype=torch.float64, device=g.device)
            patch_bytes = 12 * positions * (self.in_channels * self.kernel[0] * self.kernel[1] + self.out_channels)
            for rows in _sample_chunks(samples, 16 * positions * positions + patch_bytes):
                copy_rows = slice(rows.start * copies, rows.stop * copies)
                sq[rows] = self._ghost_sq_norms(a[copy_rows], g[copy_rows], copies)
            if bias is not None:
                outputs = _copies_as_positions(g.reshape(len(g), self.out_channels, -1), copies)  # (S, q, K * T)
                scale = _norms(outputs, dim=1).sum(dim=1)
                bias_sq = _summed_bias_bound(bias_sq, scale.view(n_agents, batch), positions, g.dtype)
            return sq.view(n_agents, batch) + bias_sq, None
        weight = torch.empty(samples, self.out_channels, self.in_channels, *self.kernel, dtype=g.dtype,
                             device=g.device)
        sample_bytes = 8 * (weight[0].numel() + copies * (a[0].numel() + g[0].numel()))
        for rows in _sample_chunks(samples, sample_bytes):
            copy_rows = slice(rows.start * copies, rows.stop * copies)
            per_copy = self._per_sample_weights(a[copy_rows], g[copy_rows])
            weight[rows] = per_copy if copies == 1 else per_copy.view(-1, copies, *weight.shape[1:]).sum(dim=1)
        sq = squared_norms(weight, 4)
        per_sample = [weight.view(n_agents, batch, *weight.shape[1:])]
        if bias is not None:
            per_sample.append(bias.view(n_agents, batch, self.out_channels))
        return sq.view(n_agents, batch) + bias_sq, per_sample

    def underflow_error(self, saved: Tensor, grad_out: Tensor, copies: int = 1) -> Tensor | None:
        samples = (grad_out.shape[0], grad_out.shape[1] // copies)
        positions = copies * grad_out.shape[3] * grad_out.shape[4]  # a patch is an input position (zero padding)
        return _underflow_bound(_sample_max(saved, samples), _sample_max(grad_out, samples), positions,
                                self.in_channels * self.kernel[0] * self.kernel[1], self.out_channels)

    def _weighted_from_activations(self, saved: Tensor, grad_out: Tensor, weights: Tensor,
                                   out: Sequence[Tensor]) -> None:
        n_agents, batch = weights.shape
        g = grad_out * weights.view(n_agents, batch, 1, 1, 1)
        inputs = saved.transpose(0, 1).reshape(batch, n_agents * self.in_channels, *saved.shape[3:])
        outputs = g.transpose(0, 1).reshape(batch, n_agents * self.out_channels, *g.shape[3:])
        weight = torch.nn.grad.conv2d_weight(
            inputs, (n_agents * self.out_channels, self.in_channels, *self.kernel), outputs,
            self.stride, self.padding, self.dilation, groups=n_agents)
        out[0].copy_(weight.view(n_agents, self.out_channels, self.in_channels, *self.kernel))
        if self.bias:
            out[1].copy_(g.sum(dim=(1, 3, 4)))


# ---------------------------------------------------------------------------------------------
# Normalisation
# ---------------------------------------------------------------------------------------------


class StackedGroupNorm(ParamLayer):
    """``nn.GroupNorm`` with an affine transform: normalise per sample, then scale and shift per agent."""

    def __init__(self, module: nn.GroupNorm) -> None:
        self.groups = module.num_groups
        self.eps = module.eps
        self.param_names = ("weight", "bias")

    def forward(self, params: Sequence[Tensor], x: Tensor, shared: bool) -> tuple[Tensor, Tensor]:
        weight, bias = params
        n_agents, channels = weight.shape
        leading = 1 if shared else 2
        flat = x.reshape(-1, *x.shape[leading:])
        normalised = F.group_norm(flat, self.groups, eps=self.eps).view(x.shape)
        view = (n_agents, 1, channels, *([1] * (x.dim() - leading - 1)))
        return normalised, normalised * weight.view(view) + bias.view(view)

    def _per_sample(self, saved: Tensor, grad_out: Tensor) -> list[Tensor]:
        spatial = tuple(range(3, grad_out.dim()))
        if not spatial:  # (N, B, C): sum(dim=()) would reduce over everything
            return [grad_out * saved, grad_out]
        return [(grad_out * saved).sum(dim=spatial), grad_out.sum(dim=spatial)]

    def per_sample_sq_norms(self, saved: Tensor, grad_out: Tensor,
                            copies: int = 1) -> tuple[Tensor, list[Tensor] | None]:
        per_sample = [_sum_copies(grad, copies) for grad in self._per_sample(saved, grad_out)]
        return sum(squared_norms(grad, 1) for grad in per_sample), per_sample

    def _weighted_from_activations(self, saved: Tensor, grad_out: Tensor, weights: Tensor,
                                   out: Sequence[Tensor]) -> None:
        _agent_weighted_sums(weights, self._per_sample(saved, grad_out), out)


# ---------------------------------------------------------------------------------------------
# Embedding
# ---------------------------------------------------------------------------------------------


class StackedEmbedding(ParamLayer):
    """``nn.Embedding`` (dense gradients, no ``max_norm``): one table per agent."""

    def __init__(self, module: nn.Embedding) -> None:
        if module.max_norm is not None or module.sparse or module.scale_grad_by_freq:
            raise Unsupported("Embedding with max_norm, sparse gradients or scale_grad_by_freq")
        self.padding_idx = module.padding_idx
        self.vocabulary = module.num_embeddings
        self.param_names = ("weight",)

    def forward(self, params: Sequence[Tensor], x: Tensor, shared: bool) -> tuple[Tensor, Tensor]:
        table = params[0]
        n_agents, vocabulary, _ = table.shape
        if shared:
            x = x.unsqueeze(0).expand(n_agents, *x.shape)
        offsets = torch.arange(n_agents, device=x.device).view(n_agents, *([1] * (x.dim() - 1))) * vocabulary
        out = F.embedding(x + offsets, table.reshape(n_agents * vocabulary, -1))
        if self.padding_idx is not None:  # as in nn.Embedding, the padding row gets no gradient
            out = torch.where((x == self.padding_idx).unsqueeze(-1), out.detach(), out)
        return x, out

    def _active(self, tokens: Tensor, grad_out: Tensor) -> Tensor:
        """Output gradients with padding positions (which train nothing) zeroed."""
        if self.padding_idx is None:
            return grad_out
        return grad_out * (tokens != self.padding_idx).unsqueeze(-1).to(grad_out.dtype)

    def per_sample_sq_norms(self, saved: Tensor, grad_out: Tensor,
                            copies: int = 1) -> tuple[Tensor, list[Tensor] | None]:
        n_agents, batch = saved.shape[0], saved.shape[1] // copies
        tokens = saved.reshape(n_agents, batch, -1)  # (N, B, K * T): copies are positions
        g = self._active(saved, grad_out).reshape(n_agents, batch, tokens.shape[2], -1)
        positions = tokens.shape[2]
        sq = torch.empty(n_agents, batch, dtype=torch.float64, device=g.device)
        for rows in _sample_chunks(batch, n_agents * positions * (16 * positions + 8 * g.shape[-1])):
            g64 = g[:, rows].double()
            same = (tokens[:, rows, :, None] == tokens[:, rows, None, :]).double()
            ghost = (same * (g64 @ g64.transpose(-1, -2))).sum(dim=(-1, -2))
            # a one-hot "activation" per position: S = sum_t ||g_t||
            sq[:, rows] = _ghost_bound(ghost, _norms(g64).sum(dim=-1), g.shape[-1], positions, g.dtype)
        return sq, None

    def _weighted_from_activations(self, saved: Tensor, grad_out: Tensor, weights: Tensor,
                                   out: Sequence[Tensor]) -> None:
        n_agents, batch = weights.shape
        g = self._active(saved, grad_out) * weights.view(n_agents, batch, *([1] * (grad_out.dim() - 2)))
        vocabulary = self.vocabulary
        offsets = torch.arange(n_agents, device=saved.device).view(n_agents, *([1] * (saved.dim() - 1))) * vocabulary
        table = torch.zeros(n_agents * vocabulary, g.shape[-1], dtype=g.dtype, device=g.device)
        table.index_add_(0, (saved + offsets).reshape(-1), g.reshape(-1, g.shape[-1]))
        out[0].copy_(table.view(n_agents, vocabulary, -1))


# ---------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------


def stacked_layer(module: nn.Module) -> ParamLayer:
    """The stacked rule for a module with parameters; :class:`Unsupported` when there is none."""
    if type(module) is nn.Linear:
        return StackedLinear(module)
    if type(module) is nn.Conv2d:
        return StackedConv2d(module)
    if type(module) is nn.GroupNorm and module.affine:
        return StackedGroupNorm(module)
    if type(module) is nn.Embedding:
        return StackedEmbedding(module)
    raise Unsupported(f"no stacked per-sample rule for {type(module).__name__}")


#: Modules without parameters that act on each sample independently, so that they can be applied
#: to ``(N * B, ...)`` activations as they are.  Only these exact types: a subclass may override ``forward``.
PER_SAMPLE_MODULES: tuple[type[nn.Module], ...] = (
    nn.Identity, nn.Flatten, nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU,
    nn.Mish, nn.Tanh, nn.Sigmoid, nn.Softplus, nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid,
    nn.MaxPool1d, nn.MaxPool2d, nn.AvgPool1d, nn.AvgPool2d, nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d,
    nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d,
)
