"""The CPU kernels for Mish and pooling agree with ATen's: Mish to a few units in the last place (forward and
backward), max- and average pooling bit for bit (ties, NaN windows and uncovered edges included), in any chunking;
modules they do not cover keep their own forward."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from torch import nn

from decentdp.gradients import cpu_kernels
from decentdp.gradients.cpu_kernels import cpu_kernel, max_pool, mish
from decentdp.gradients.stacked_model import StackedModel
from decentdp.models import build_model, classification_loss


@pytest.fixture(params=[cpu_kernels.CHUNK, 7], ids=["cache-sized", "tiny-chunks"])
def chunk(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    """Run each test with the real chunk size and with chunks of 7 elements (many uneven chunks)."""
    monkeypatch.setattr(cpu_kernels, "CHUNK", request.param)
    return request.param


def _wide_inputs(dtype: torch.dtype) -> torch.Tensor:
    """Values from -100 to 100, dense near 0 and around Mish's minimum and its cap, plus exact edges."""
    generator = torch.Generator().manual_seed(0)
    grid = torch.linspace(-100, 100, 2001, dtype=torch.float64)
    near = torch.randn(1000, generator=generator, dtype=torch.float64) * 3
    edges = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1e-6, -1e-6, -1.1924, 19.99, 20.0, 20.01, 44.0, 89.0, -88.0,
                          -103.0], dtype=torch.float64)
    return torch.cat([grid, near, edges]).to(dtype)


@functools.cache
def _exact(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mish of :func:`_wide_inputs`, its derivative ``t + x sigmoid(x) (1 - t^2)`` (t = tanh(softplus(x))) and the
    size of that sum's two terms, evaluated with 40 significant digits (mpmath, which torch's sympy brings along)."""
    mpmath = pytest.importorskip("mpmath")
    values, slopes, terms = [], [], []
    with mpmath.workdps(40):
        for value in _wide_inputs(dtype).double().tolist():
            v = mpmath.mpf(value)
            t = mpmath.tanh(mpmath.log1p(mpmath.exp(v)))
            second = v / (1 + mpmath.exp(-v)) * (1 - t * t)
            values.append(float(v * t))
            slopes.append(float(t + second))
            terms.append(float(abs(t) + abs(second)))
    return torch.tensor(values, dtype=torch.float64), torch.tensor(slopes, dtype=torch.float64), \
        torch.tensor(terms, dtype=torch.float64)


def _ulps(value: torch.Tensor, reference: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> float:
    """Largest error of ``value`` against ``reference``, in units of ``dtype``'s epsilon times ``scale`` (floored
    where the result is subnormal, whose spacing is fixed)."""
    floor = 1e-30 if dtype == torch.float32 else 1e-300
    error = (value.detach().double() - reference).abs()
    return float((error / (scale.abs().clamp(min=floor) * torch.finfo(dtype).eps)).max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_mish_and_its_gradient_match_the_exact_function_to_a_few_units_in_the_last_place(
        dtype: torch.dtype, chunk: int) -> None:
    """Forward against Mish itself, backward against the size of its derivative's terms (they cancel near the
    derivative's root, x ~ -1.19, where no kernel can do better); ATen's own errors are printed beside ours."""
    x = _wide_inputs(dtype).requires_grad_()
    upstream = torch.linspace(-2, 2, x.numel(), dtype=dtype)
    value, slope, terms = _exact(dtype)
    weight = upstream.double().abs()
    errors = {}
    for name, function in (("ours", mish), ("aten", nn.functional.mish)):
        out = function(x)
        (grad,) = torch.autograd.grad(out, x, upstream)
        errors[name] = (_ulps(out, value, value, dtype), _ulps(grad, slope * upstream.double(), terms * weight, dtype))
    print(errors)
    assert errors["ours"][0] <= 4 and errors["ours"][1] <= max(10.0, errors["aten"][1]), errors


def test_mish_passes_gradcheck() -> None:
    x = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True) * 4
    assert torch.autograd.gradcheck(mish, (x,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_mishs_gradient_is_one_for_large_inputs(dtype: torch.dtype, chunk: int) -> None:
    """Past the cap of 20 Mish's derivative is 1 to both precisions.  Its second term once took the uncapped x
    with the capped exp: a float32 gradient of 1.017 at 1e15, 170.9 at 1e19 and inf at 1e21."""
    x = torch.tensor([20.5, 50.0, 1e4, 1e15, 1e19, 1e21, 1e30, 3e38], dtype=dtype, requires_grad=True)
    upstream = torch.linspace(0.5, 2.0, x.numel(), dtype=dtype)
    (grad,) = torch.autograd.grad(mish(x), x, upstream)
    exact = x.detach().double().requires_grad_()
    (expected,) = torch.autograd.grad(nn.functional.mish(exact), exact, upstream.double())
    assert torch.equal(expected, upstream.double())  # the derivative is 1 there
    assert ((grad.double() - expected).abs() <= 4 * torch.finfo(dtype).eps * expected).all(), grad


def test_mish_keeps_atens_non_finite_results() -> None:
    x = torch.tensor([math.inf, -math.inf, math.nan, 1.0])
    assert torch.equal(mish(x).isnan(), nn.functional.mish(x).isnan())
    assert mish(x)[0] == math.inf


def _pool_inputs() -> list[torch.Tensor]:
    """Continuous values, heavy ties (small integers, ReLU zeros), odd sizes, a batch without channels."""
    generator = torch.Generator().manual_seed(1)
    return [
        torch.randn(5, 3, 12, 12, generator=generator),
        torch.randint(0, 3, (4, 2, 8, 10), generator=generator).float(),
        torch.relu(torch.randn(3, 2, 9, 7, generator=generator)),
        torch.randint(-2, 2, (2, 13, 11), generator=generator).double(),
    ]


@pytest.mark.parametrize("kernel", [2, 3, (2, 3)])
def test_max_pool_equals_atens_bit_for_bit_and_leaves_gradients_to_aten(kernel: int | tuple[int, int],
                                                                          chunk: int) -> None:
    module = nn.MaxPool2d(kernel)
    fast = cpu_kernel(module)
    assert fast is not None
    for x in _pool_inputs():
        with torch.no_grad():
            assert torch.equal(fast(x), module(x))
        ours_in, atens_in = x.clone().requires_grad_(), x.clone().requires_grad_()
        ours, atens = fast(ours_in), module(atens_in)
        assert ours.grad_fn is not None and torch.equal(ours, atens)
        upstream = torch.randn(atens.shape, dtype=x.dtype, generator=torch.Generator().manual_seed(2))
        ours.backward(upstream)
        atens.backward(upstream)
        assert torch.equal(ours_in.grad, atens_in.grad)  # ties go to the window's first maximum, as in ATen


@pytest.mark.parametrize("kernel", [2, 3, (2, 3)])
def test_average_pooling_equals_atens_bit_for_bit_forward_and_backward(kernel: int | tuple[int, int],
                                                                       chunk: int) -> None:
    """ATen adds a window's values in row-major order in the input's dtype, then divides: so do the kernels; the
    backward pass spreads the output gradient over each window (zero on rows and columns no window covers)."""
    module = nn.AvgPool2d(kernel)
    fast = cpu_kernel(module)
    assert fast is not None
    for x in _pool_inputs():
        ours_in, atens_in = x.clone().requires_grad_(), x.clone().requires_grad_()
        ours, atens = fast(ours_in), module(atens_in)
        assert torch.equal(ours, atens)
        upstream = torch.randn(atens.shape, dtype=x.dtype, generator=torch.Generator().manual_seed(2))
        ours.backward(upstream)
        atens.backward(upstream)
        assert torch.equal(ours_in.grad, atens_in.grad)


def test_max_pool_propagates_nan_as_aten_does(chunk: int) -> None:
    x = torch.randn(2, 2, 6, 6)
    x[0, 1, 2, 3] = x[1, 0, 0, 0] = x[1, 0, 1, 1] = math.nan
    module = nn.MaxPool2d(2)
    with torch.no_grad():
        ours, atens = cpu_kernel(module)(x), module(x)
    assert torch.equal(ours.isnan(), atens.isnan())
    assert torch.equal(ours.nan_to_num(), atens.nan_to_num())


@pytest.mark.parametrize("module", [
    nn.MaxPool2d(2, stride=1), nn.MaxPool2d(2, padding=1), nn.MaxPool2d(2, dilation=2), nn.MaxPool2d(2, ceil_mode=True),
    nn.MaxPool2d(2, return_indices=True), nn.MaxPool1d(2), nn.Tanh(), nn.ReLU(), nn.AvgPool2d(2, stride=1),
    nn.AvgPool2d(2, padding=1), nn.AvgPool2d(2, ceil_mode=True), nn.AvgPool2d(2, divisor_override=3),
])
def test_modules_without_a_faster_kernel_keep_their_own(module: nn.Module) -> None:
    assert cpu_kernel(module) is None


def test_other_devices_and_dtypes_use_the_module(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off the CPU (here the meta device) and for half precision the modules' own kernels run."""
    calls: list[str] = []
    monkeypatch.setattr(nn.functional, "mish", lambda x: calls.append(f"{x.device.type} {x.dtype}") or x)
    module = nn.MaxPool2d(2)
    for x in (torch.empty(2, 3, 4, 4, device="meta"), torch.randn(2, 3, 4, 4).to(torch.bfloat16)):
        mish(x)
        with torch.no_grad():
            pooled = max_pool(x, (2, 2), module)
        assert pooled.shape == (2, 3, 2, 2) and pooled.dtype == x.dtype and pooled.device == x.device
        if x.device.type == "cpu":
            assert torch.equal(pooled, module(x))
    assert calls == ["meta torch.float32", "cpu torch.bfloat16"]


@pytest.mark.parametrize("name,shape", [("convnet", (1, 32, 32)), ("lenet5", (1, 28, 28))])
def test_the_stacked_engine_gives_the_same_clipped_sums_with_and_without_the_kernels(
        name: str, shape: tuple[int, int, int], monkeypatch: pytest.MonkeyPatch) -> None:
    """The consensus paper's ConvNet (Mish, max-pooling) and LeNet-5 (average pooling) through the stacked engine:
    the kernels change their clipped gradient sums, norms and predictions by rounding only."""
    model = build_model(name, shape, 10, seed=0)
    fast = StackedModel(model, classification_loss)
    monkeypatch.setattr("decentdp.gradients.stacked_model.cpu_kernel", lambda module: None)
    plain = StackedModel(model, classification_loss)
    generator = torch.Generator().manual_seed(3)
    params = torch.stack([fast.initial_parameters() + 0.05 * torch.randn(fast.dim, generator=generator)
                          for _ in range(3)])
    x = torch.randn(3, 8, *shape, generator=generator)
    y = torch.randint(0, 10, (3, 8), generator=generator)
    mask = torch.ones(3, 8)
    fast_sums, fast_norms = fast.clipped_gradient_sums(params, x, y, mask, 1.0)
    plain_sums, plain_norms = plain.clipped_gradient_sums(params, x, y, mask, 1.0)
    torch.testing.assert_close(fast_sums, plain_sums, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fast_norms, plain_norms, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fast.predict(params, x[0]), plain.predict(params, x[0]), rtol=1e-5, atol=1e-6)
