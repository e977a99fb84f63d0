"""Faster CPU kernels for per-sample modules that dominate small convolutional models on the CPU.

On this project's CPU build of torch (AVX2; one thread per run in the grids) some ATen kernels cost far more than
their arithmetic (``benchmarks/cpu_kernels.py``; BENCHMARKS.md, "CPU kernels for Mish and pooling"):

* **Mish**, ``x * tanh(softplus(x))``, evaluates an exp, a log1p and a tanh per element through SLEEF, about
  seven times the cost of one ``exp``.  The same function needs one exp: with ``e = exp(x)``,
  ``tanh(log(1 + e)) = n / (n + 2)`` where ``n = e (e + 2)``, and ``mish'(x) = n / (n + 2) + 4 x e (e + 1) /
  (n + 2)^2``.  Neither form cancels (``n`` is a product of positive terms; for very negative ``x`` both are
  ``~ e``), and ``x`` is capped at 20 inside the exp, where ``n / (n + 2)`` is 1 in float32 and float64 alike,
  and in the derivative's second term, which is below ``4e-16`` from there on.
* **Max-pooling** whose kernel equals its stride writes an int64 argmax per output.  Without a gradient to
  carry (evaluation) its values are the elementwise maximum of the window's strided views, exactly.  With one,
  ATen's kernel stays: its backward pass needs those indices, and routing the gradient another way (to the first
  maximum of each window, as ATen does) cost more than it saved.
* **Average pooling** with the kernel equal to the stride is the sum of the same views in ATen's order (row-major,
  in the input's dtype) divided by the window's size, bit for bit; its backward pass repeats the scaled output
  gradient over each window.

Their forward passes work through the input in cache-sized chunks (Mish's in both directions, with preallocated
scratch buffers), so that no intermediate streams through memory.  They take float32 and float64 tensors on the
CPU; anything else (another device, where ATen's fused kernels are the fast ones, or another dtype) goes to the
module itself.  Mish agrees with the exact function to a few units in the last place, as ATen's does; pooling
equals ATen's bit for bit (``tests/gradients/test_cpu_kernels.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn
from torch.autograd.function import once_differentiable

Tensor = torch.Tensor

#: Elements per chunk (per thread): 64 Ki float32 values and their temporaries stay in cache.  Measured for Mish on
#: this machine: 2^12 and 2^14 lose to per-call overhead (3.5 and 1.6 times 2^16), 2^18 is no faster than 2^16.
CHUNK = 1 << 16
#: Above this argument ``tanh(softplus(x))`` is 1 to float64 precision (``2 / n < 1e-17``), so the exp is capped.
_MISH_CAP = 20.0
_FLOATS = (torch.float32, torch.float64)


def _fast(x: Tensor) -> bool:
    """Whether the CPU kernels apply to ``x`` (float32 or float64 on the CPU)."""
    return x.device.type == "cpu" and x.dtype in _FLOATS


def _chunk_bounds(numel: int, unit: int = 1) -> range:
    """Chunk starts over ``numel`` items of ``unit`` elements each, about :data:`CHUNK` elements per thread."""
    step = max(1, CHUNK * torch.get_num_threads() // unit)
    return range(0, numel, step)


def _elementwise(kernel: Callable[..., None], scratch: int, *inputs: Tensor) -> Tensor:
    """``kernel(*chunks, out=target, scratch=buffers)`` over matching flat chunks of ``inputs`` (same shape), into a
    new tensor; ``scratch`` chunk-sized buffers are allocated once and reused, so the loop allocates nothing."""
    flats = [tensor.contiguous().view(-1) for tensor in inputs]
    out = torch.empty(inputs[0].shape, dtype=inputs[0].dtype, device=inputs[0].device)
    target = out.view(-1)
    bounds = _chunk_bounds(target.numel())
    buffers = [torch.empty(min(bounds.step, target.numel()), dtype=out.dtype, device=out.device)
               for _ in range(scratch)]
    for start in bounds:
        stop = min(start + bounds.step, target.numel())
        kernel(*(flat[start:stop] for flat in flats), out=target[start:stop],
               scratch=[buffer[:stop - start] for buffer in buffers])
    return out


def _mish_terms(x: Tensor, e: Tensor, n: Tensor) -> None:
    """``e = exp(min(x, 20))`` and ``n = e (e + 2)``, into the buffers ``e`` and ``n``."""
    torch.clamp(x, max=_MISH_CAP, out=e).exp_()
    torch.add(e, 2.0, out=n).mul_(e)


def _mish_forward(x: Tensor, *, out: Tensor, scratch: list[Tensor]) -> None:
    """``mish(x) = x n / (n + 2)``."""
    e, n = scratch
    _mish_terms(x, e, n)
    torch.div(n, torch.add(n, 2.0, out=e), out=out).mul_(x)


def _mish_backward(x: Tensor, grad: Tensor, *, out: Tensor, scratch: list[Tensor]) -> None:
    """``grad * mish'(x)`` with ``mish'(x) = n / (n + 2) + 4 x e (e + 1) / (n + 2)^2``, where ``e (e + 1) = n - e``.

    ``x`` is capped at 20 in the second term too, as ``e`` is: past the cap that term is below ``4e-16`` however
    it is computed, but with the capped ``e`` and the uncapped ``x`` it grows with ``x`` (170 at ``1e19``, inf at
    ``1e21``, where the derivative is 1)."""
    e, n, denominator, capped = scratch
    _mish_terms(x, e, n)
    torch.add(n, 2.0, out=denominator)
    torch.div(n, denominator, out=out)
    slope = n.sub_(e).mul_(torch.clamp(x, max=_MISH_CAP, out=capped)).mul_(4.0).div_(denominator).div_(denominator)
    out.add_(slope).mul_(grad)


class _Mish(torch.autograd.Function):
    """Mish through one exp per element, forward and backward (module docstring)."""

    @staticmethod
    def forward(x: Tensor) -> Tensor:  # type: ignore[override]
        return _elementwise(_mish_forward, 2, x)

    @staticmethod
    def setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple[Tensor], output: Tensor) -> None:
        ctx.save_for_backward(inputs[0])

    @staticmethod
    @once_differentiable
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> Tensor:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        return _elementwise(_mish_backward, 4, x, grad)


def mish(x: Tensor) -> Tensor:
    """``torch.nn.functional.mish(x)``, through :class:`_Mish` where the CPU kernels apply."""
    return _Mish.apply(x) if _fast(x) else nn.functional.mish(x)


def _pooled(x: Tensor, kernel: tuple[int, int], combine: str) -> Tensor:
    """Pooling of ``x`` (``(..., H, W)``) with kernel = stride = ``kernel``, chunk by chunk of planes, through the
    window's ``kh * kw`` strided views in row-major order: their ``maximum`` (NaN propagates, as in ATen), or their
    sum divided by ``kh * kw`` (``"mean"``: ATen's order of additions, in the input's dtype, so the same bits).
    Rows and columns beyond the last whole window are dropped, as ATen does without padding or ceil mode."""
    kh, kw = kernel
    planes = x.contiguous().view(-1, *x.shape[-2:])
    rows, cols = planes.shape[-2] // kh, planes.shape[-1] // kw
    out = torch.empty(planes.shape[0], rows, cols, dtype=x.dtype, device=x.device)
    (first_rows, first_cols), *rest = [(slice(i, rows * kh, kh), slice(j, cols * kw, kw))
                                       for i in range(kh) for j in range(kw)]
    bounds = _chunk_bounds(planes.shape[0], planes.shape[-2] * planes.shape[-1])
    for start in bounds:
        chunk, target = planes[start:start + bounds.step], out[start:start + bounds.step]
        target.copy_(chunk[:, first_rows, first_cols])
        for window_rows, window_cols in rest:
            if combine == "max":
                torch.maximum(target, chunk[:, window_rows, window_cols], out=target)
            else:
                target.add_(chunk[:, window_rows, window_cols])
        if combine == "mean":
            target.div_(kh * kw)
    return out.view(*x.shape[:-2], rows, cols)


def max_pool(x: Tensor, kernel: tuple[int, int], module: nn.Module) -> Tensor:
    """``module(x)`` for a max-pooling ``module`` whose kernel is ``kernel`` and equals its stride.  Without a
    gradient to carry (evaluation), where the CPU kernels apply, through :func:`_pooled`; with one, ATen's
    kernel, whose indices its backward pass needs (computing them here costs more than it saves)."""
    if _fast(x) and x.dim() >= 3 and not (torch.is_grad_enabled() and x.requires_grad):
        return _pooled(x, kernel, "max")
    return module(x)


class _AvgPool(torch.autograd.Function):
    """Average pooling with kernel = stride, no padding: forward by :func:`_pooled`, backward the output gradient
    divided by the window's size at each of its positions (ATen's, bit for bit), spread by repeating it."""

    @staticmethod
    def forward(x: Tensor, kernel: tuple[int, int]) -> Tensor:  # type: ignore[override]
        return _pooled(x, kernel, "mean")

    @staticmethod
    def setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple[Tensor, tuple[int, int]],
                      output: Tensor) -> None:
        ctx.kernel, ctx.shape = inputs[1], inputs[0].shape

    @staticmethod
    @once_differentiable
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        (kh, kw), (height, width) = ctx.kernel, ctx.shape[-2:]
        spread = grad.div(kh * kw).repeat_interleave(kh, dim=-2).repeat_interleave(kw, dim=-1)
        # rows and columns beyond the last whole window took no part: their gradient is zero
        if spread.shape[-2:] != (height, width):
            spread = nn.functional.pad(spread, (0, width - spread.shape[-1], 0, height - spread.shape[-2]))
        return spread.view(ctx.shape), None


def avg_pool(x: Tensor, kernel: tuple[int, int], module: nn.Module) -> Tensor:
    """``module(x)`` for an average-pooling ``module`` whose kernel is ``kernel`` and equals its stride, through
    :class:`_AvgPool` where the CPU kernels apply."""
    return _AvgPool.apply(x, kernel) if _fast(x) and x.dim() >= 3 else module(x)


def _pair(value: int | tuple[int, ...]) -> tuple[int, ...]:
    return (value, value) if isinstance(value, int) else tuple(value)


def cpu_kernel(module: nn.Module) -> Callable[[Tensor], Tensor] | None:
    """The faster CPU form of a per-sample ``module``, or None: ``nn.Mish``; ``nn.MaxPool2d`` and ``nn.AvgPool2d``
    whose kernel equals its stride, without padding or ceil mode (nor dilation and returned indices, nor a
    divisor override)."""
    if type(module) is nn.Mish:
        return mish
    if type(module) in (nn.MaxPool2d, nn.AvgPool2d):
        kernel = _pair(module.kernel_size)
        stride = _pair(module.stride if module.stride is not None else module.kernel_size)
        if kernel != stride or _pair(module.padding) != (0, 0) or module.ceil_mode:
            return None
        if type(module) is nn.MaxPool2d and _pair(module.dilation) == (1, 1) and not module.return_indices:
            return partial(max_pool, kernel=kernel, module=module)
        if type(module) is nn.AvgPool2d and module.divisor_override is None:  # no padding: count_include_pad moot
            return partial(avg_pool, kernel=kernel, module=module)
    return None
