"""The stacked gradient engine against plain autograd, one sample at a time.

:class:`~decentdp.gradients.stacked_model.StackedModel` never builds per-sample gradients for most
layers: it derives each sample's gradient norm from the layer input and output gradient (outer
product, ghost norm, grouped-convolution or equality-mask rules in :mod:`decentdp.gradients.layers`)
and then takes one weighted gradient per layer.  Every one of those rules is an identity that can
silently go wrong (a transposed stride, a missing bias term, a padding token that trains), and a
wrong norm is a wrong clip factor, i.e. a broken privacy guarantee.  So every fast path is checked
here against the dumbest possible ground truth: a ``deepcopy`` of the template module holding one
agent's parameters, the loss of ONE sample, ``torch.autograd.grad`` (in float64).

For each supported layer type (Linear with and without position dimensions and bias, in its
outer-product, ghost-norm and materialised branches; Conv2d with random channels, kernel, stride,
padding, dilation and bias, in both its ghost and materialised branches; affine GroupNorm;
Embedding with and without ``padding_idx`` on token sequences with repeats), sitting inside a
small real model, hypothesis draws the shapes and seeds and we verify:

1. the per-sample gradient norms (``clipped_gradient_sums`` with a huge clip) equal the
   one-at-a-time norms;
2. the clipped sums with a clip that clips most samples equal ``sum_b min(1, C/||g_b||) g_b``,
   with padding rows (mask 0) excluded;
3. ``batch_gradients`` with random weights equals ``sum_b w_b g_b``;
4. ``predict`` on one shared input equals each agent's module output.

Each check runs twice: in float64, where the rules (identities) must agree with autograd to
rounding, so that even a small systematic error shows; and in float32, the dtype the library
trains in, with ``rtol`` 1e-4 and ``atol`` 1e-5 (see :func:`close` and
:func:`group_norm_well_conditioned` for the rounding both paths share in ill-conditioned draws).

Also: unsupported modules fall back to the ``torch.func`` engine with a logged, named reason (or
raise with ``backend="stacked"``); a non-finite sample contributes nothing and leaves the other
samples alone; the temporaries' chunking does not change results; and the library's models compile
to the stacked engine and agree with the ``vmap`` engine.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.utils import vector_to_parameters

from decentdp.gradients import layers, stacked_model
from decentdp.gradients.clipping import clip_factors, clip_weights
from decentdp.gradients.flat_model import FlatModel
from decentdp.gradients.layers import StackedConv2d, StackedLinear, Unsupported
from decentdp.gradients.stacked_model import StackedModel, gradient_model
from decentdp.models import Residual, build_model, classification_loss

RTOL, ATOL = 1e-4, 1e-5
PROPERTY = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LOGGER = "decentdp.gradients.stacked_model"


# ---------------------------------------------------------------------------------------------
# Ground truth: ordinary autograd on an ordinary module, one sample at a time
# ---------------------------------------------------------------------------------------------


def _seeded(seed: int, build: Any) -> Any:
    """``build()`` under a fixed global seed (module initialisation), leaving the global RNG as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def _as_float(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype) if x.is_floating_point() else x


def agent_module(template: nn.Module, flat: torch.Tensor, dtype: torch.dtype = torch.float64) -> nn.Module:
    """A copy of ``template`` in ``dtype`` holding the parameters ``flat`` (d,)."""
    module = copy.deepcopy(template).to(dtype)
    vector_to_parameters(flat.detach().to(dtype).clone(), module.parameters())
    return module


def reference_gradients(template: nn.Module, params: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
                        dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``(N, B, d)`` gradients of every sample's loss, computed one sample at a time (float64 by default)."""
    n_agents, batch = y.shape
    rows = []
    for n in range(n_agents):
        module = agent_module(template, params[n], dtype)
        wrt = list(module.parameters())
        for b in range(batch):
            loss = classification_loss(module(_as_float(x[n, b:b + 1], dtype)), y[n, b:b + 1]).sum()
            grads = torch.autograd.grad(loss, wrt, allow_unused=True)
            rows.append(torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1)
                                   for p, g in zip(wrt, grads, strict=True)]))
    return torch.stack(rows).view(n_agents, batch, -1).double()


def reference_clipped_sums(grads: torch.Tensor, mask: torch.Tensor, clip: float) -> torch.Tensor:
    """``sum_b c_b g_b``, ``c_b = min(1, C / ||g_b||)``, over real samples with a finite gradient.

    ``c_b`` is the library's :func:`clip_factors` (which adds 1e-6 to the norm), so that the
    float64 comparison can be tight; the rule it implements is that of DP-SGD.
    """
    norms = grads.norm(dim=-1)
    keep = (mask > 0) & torch.isfinite(norms)
    factors = torch.where(keep, clip_factors(norms, clip), torch.zeros_like(norms))
    safe = torch.where(keep[..., None], grads, torch.zeros_like(grads))
    return (factors[..., None] * safe).sum(dim=1)


def reference_outputs(template: nn.Module, params: torch.Tensor, inputs: torch.Tensor,
                      dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Each agent's module output on the shared ``inputs``: ``(N, B, K)``."""
    with torch.no_grad():
        return torch.stack([agent_module(template, row, dtype)(_as_float(inputs, dtype)) for row in params]).double()


def close(actual: torch.Tensor, expected: torch.Tensor, what: str, float32: torch.Tensor | None = None,
          rtol: float = RTOL, atol: float = ATOL) -> None:
    """``actual`` equals the float64 ground truth ``expected`` within ``rtol`` / ``atol``.

    ``float32``, when given, is the same ground truth computed in float32 (plain autograd, one
    sample at a time); the absolute tolerance is widened to 10 times its largest error where that is
    larger, so that rounding the plain float32 path makes too cannot fail the fast path.  In
    well-conditioned cases that error is ~1e-7 and changes nothing; a wrong rule is off by far more.
    """
    slack = 0.0 if float32 is None else 10.0 * float((float32.double() - expected.double()).abs().max())
    torch.testing.assert_close(actual.double(), expected.double(), rtol=rtol, atol=max(atol, slack),
                               msg=lambda m: f"{what}: {m}")


def agent_parameters(template: nn.Module, n_agents: int, seed: int) -> torch.Tensor:
    """``(N, d)`` float32 parameters: the template's, perturbed differently for every agent (so that a
    stacked layer mixing agents up would show)."""
    base = torch.cat([p.detach().reshape(-1) for p in template.parameters()])
    return base + 0.3 * torch.randn(n_agents, base.numel(), generator=torch.Generator().manual_seed(seed))


def assert_matches_reference(template: nn.Module, x: torch.Tensor, y: torch.Tensor, shared: torch.Tensor,
                             seed: int, *, float32: bool = True) -> StackedModel:
    """Checks 1-4 of the module docstring for ``template`` on samples ``x`` (N, B, ...) / ``y`` (N, B).

    First in float64, where the per-sample rules, being identities, must agree with autograd to
    rounding (tolerance 1e-7 relative), then (unless ``float32`` is False) in float32, the dtype
    the library trains in, with ``rtol`` 1e-4 and ``atol`` 1e-5.
    """
    model = gradient_model(template, classification_loss, "stacked")
    assert isinstance(model, StackedModel)
    n_agents, batch = y.shape
    params = agent_parameters(template, n_agents, seed)
    gen = torch.Generator().manual_seed(seed + 2)
    mask = (torch.rand(n_agents, batch, generator=gen) < 0.7).float()
    mask[:, 0] = 1.0
    weights = torch.rand(n_agents, batch, generator=gen) * 2.0 - 0.5
    truth = reference_gradients(template, params, x, y), reference_outputs(template, params, shared)
    _compare(model, params, x, y, shared, mask, weights, torch.float64, truth, None)
    if float32:
        single = (reference_gradients(template, params, x, y, torch.float32),
                  reference_outputs(template, params, shared, torch.float32))
        _compare(model, params, x, y, shared, mask, weights, torch.float32, truth, single)
    return model


def _compare(model: StackedModel, params: torch.Tensor, x: torch.Tensor, y: torch.Tensor, shared: torch.Tensor,
             mask: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype,
             truth: tuple[torch.Tensor, torch.Tensor], single: tuple[torch.Tensor, torch.Tensor] | None) -> None:
    reference, outputs = truth
    tol = {"rtol": RTOL, "atol": ATOL} if dtype == torch.float32 else {"rtol": 1e-7, "atol": 1e-9}
    label = str(dtype).removeprefix("torch.")
    params, x, shared, mask, weights = (_as_float(t, dtype) for t in (params, x, shared, mask, weights))
    n_agents, batch = mask.shape
    ref_norms = reference.norm(dim=-1)
    real = mask > 0

    def also(fn: Any) -> torch.Tensor | None:  # the same quantity from the float32 ground truth
        return None if single is None else fn(single[0])

    # 1. Per-sample norms (and the unclipped masked sum) with a clip nothing reaches.
    sums, norms = model.clipped_gradient_sums(params, x, y, mask, 1e12)
    assert norms.shape == (n_agents, batch) and norms.dtype == dtype and sums.dtype == dtype
    close(norms[real], ref_norms[real], f"per-sample gradient norms ({label})",
          also(lambda g: g.norm(dim=-1)[real]), **tol)
    masked = mask.double()[..., None]
    close(sums, (reference * masked).sum(dim=1), f"unclipped masked gradient sums ({label})",
          also(lambda g: (g * masked).sum(dim=1)), **tol)

    # 2. Clipped sums with most samples clipped; padding rows excluded.
    clip = max(0.5 * float(ref_norms[real].median()), 0.05)
    sums, _ = model.clipped_gradient_sums(params, x, y, mask, clip)
    close(sums, reference_clipped_sums(reference, mask.double(), clip), f"clipped sums, clip {clip:.3g} ({label})",
          also(lambda g: reference_clipped_sums(g, mask.double(), clip)), **tol)

    # 3. Weighted batch gradients.
    w = weights.double()
    close(model.batch_gradients(params, x, y, weights), torch.einsum("nb,nbd->nd", w, reference),
          f"weighted batch gradients ({label})", also(lambda g: torch.einsum("nb,nbd->nd", w, g)), **tol)

    # 4. Predictions on one input shared by all agents.
    predicted = model.predict(params, shared)
    assert predicted.shape[:2] == (n_agents, shared.shape[0])
    close(predicted, outputs, f"shared-input predictions ({label})", None if single is None else single[1], **tol)


def _labels(gen: torch.Generator, classes: int, *shape: int) -> torch.Tensor:
    return torch.randint(0, max(classes, 2), shape, generator=gen)


def _float_inputs(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen)


# ---------------------------------------------------------------------------------------------
# Linear
# ---------------------------------------------------------------------------------------------


def linear_branch(positions: int, in_features: int, out_features: int) -> str:
    if positions == 1:
        return "outer product"
    return "ghost" if positions * (in_features + out_features) < in_features * out_features else "materialised"


def check_linear(case: dict[str, Any]) -> None:
    t = case["positions"]
    template = _seeded(case["seed"], lambda: nn.Sequential(
        nn.Linear(case["in_features"], case["out_features"], bias=case["bias"]), nn.Tanh(), nn.Flatten(),
        nn.Linear((t or 1) * case["out_features"], case["classes"])))
    gen = torch.Generator().manual_seed(case["seed"] + 1)
    n, b = case["agents"], case["batch"]
    sample = (case["in_features"],) if t is None else (t, case["in_features"])
    x = _float_inputs(gen, n, b, *sample)
    y = _labels(gen, case["classes"], n, b)
    assert_matches_reference(template, x, y, _float_inputs(gen, 3, *sample), case["seed"])


@st.composite
def linear_cases(draw: st.DrawFn) -> dict[str, Any]:
    return {
        "agents": draw(st.integers(1, 3)), "batch": draw(st.integers(1, 4)),
        "positions": draw(st.sampled_from([None, 1, 2, 3])),
        "in_features": draw(st.integers(1, 16)), "out_features": draw(st.integers(1, 16)),
        "bias": draw(st.booleans()), "classes": draw(st.integers(1, 4)), "seed": draw(st.integers(0, 2**16)),
    }


_LINEAR_GHOST = {"agents": 2, "batch": 3, "positions": 2, "in_features": 16, "out_features": 16, "bias": True,
                 "classes": 3, "seed": 1}
_LINEAR_MATERIALISED = {"agents": 3, "batch": 2, "positions": 3, "in_features": 2, "out_features": 3,
                        "bias": False, "classes": 2, "seed": 2}
_LINEAR_OUTER = {"agents": 2, "batch": 4, "positions": None, "in_features": 5, "out_features": 4, "bias": True,
                 "classes": 1, "seed": 3}


@PROPERTY
@given(linear_cases())
@example(_LINEAR_GHOST)
@example(_LINEAR_MATERIALISED)
@example(_LINEAR_OUTER)
def test_linear_matches_one_sample_autograd(case: dict[str, Any]) -> None:
    check_linear(case)


@pytest.mark.parametrize(("case", "branch"), [(_LINEAR_GHOST, "ghost"), (_LINEAR_MATERIALISED, "materialised"),
                                              (_LINEAR_OUTER, "outer product")])
def test_linear_branch_selection_is_exercised(case: dict[str, Any], branch: str) -> None:
    t = case["positions"] or 1
    assert linear_branch(t, case["in_features"], case["out_features"]) == branch
    layer = StackedLinear(nn.Linear(case["in_features"], case["out_features"], bias=case["bias"]))
    saved = torch.randn(2, 3, t, case["in_features"])
    _, per_sample = layer.per_sample_sq_norms(saved, torch.randn(2, 3, t, case["out_features"]))
    assert (per_sample is not None) == (branch == "materialised")


# ---------------------------------------------------------------------------------------------
# Conv2d
# ---------------------------------------------------------------------------------------------


def check_conv(case: dict[str, Any]) -> StackedModel:
    sample = (case["in_channels"], *case["image"])

    def build() -> nn.Module:
        conv = nn.Conv2d(case["in_channels"], case["out_channels"], case["kernel"], case["stride"], case["padding"],
                         case["dilation"], bias=case["bias"])
        with torch.no_grad():
            flat = conv(torch.zeros(1, *sample)).numel()
        return nn.Sequential(conv, nn.Mish(), nn.Flatten(), nn.Linear(flat, case["classes"]))

    template = _seeded(case["seed"], build)
    gen = torch.Generator().manual_seed(case["seed"] + 1)
    n, b = case["agents"], case["batch"]
    x = _float_inputs(gen, n, b, *sample)
    y = _labels(gen, case["classes"], n, b)
    return assert_matches_reference(template, x, y, _float_inputs(gen, 2, *sample), case["seed"])


@st.composite
def conv_cases(draw: st.DrawFn) -> dict[str, Any]:
    kernel = (draw(st.integers(1, 5)), draw(st.integers(1, 5)))
    stride = (draw(st.integers(1, 2)), draw(st.integers(1, 2)))
    padding = (draw(st.integers(0, 2)), draw(st.integers(0, 2)))
    dilation = (draw(st.integers(1, 2)), draw(st.integers(1, 2)))
    image = []
    for k, p, d in zip(kernel, padding, dilation, strict=True):
        smallest = max(1, d * (k - 1) + 1 - 2 * p)  # keeps the output at least 1 pixel
        image.append(draw(st.integers(smallest, smallest + 4)))
    return {
        "agents": draw(st.integers(1, 3)), "batch": draw(st.integers(1, 3)),
        "in_channels": draw(st.integers(1, 4)), "out_channels": draw(st.integers(1, 6)),
        "kernel": kernel, "stride": stride, "padding": padding, "dilation": dilation, "image": tuple(image),
        "bias": draw(st.booleans()), "classes": draw(st.integers(1, 3)), "seed": draw(st.integers(0, 2**16)),
    }


# in 8, out 16, 3x3 kernel on 4x4: 4 positions * (72 + 16) < 72 * 16, the ghost norm is cheaper.
_CONV_GHOST = {"agents": 2, "batch": 3, "in_channels": 8, "out_channels": 16, "kernel": 3, "stride": 1,
               "padding": 0, "dilation": 1, "image": (4, 4), "bias": True, "classes": 3, "seed": 4}
# Strided, dilated and padded with an image size the stride does not divide: the cropping matters.
_CONV_MATERIALISED = {"agents": 3, "batch": 2, "in_channels": 2, "out_channels": 3, "kernel": 3, "stride": 2,
                      "padding": 1, "dilation": 2, "image": (8, 7), "bias": True, "classes": 2, "seed": 5}
_CONV_GHOST_STRIDED = {"agents": 1, "batch": 2, "in_channels": 4, "out_channels": 8, "kernel": (5, 3),
                       "stride": (2, 1), "padding": (2, 0), "dilation": (1, 2), "image": (5, 6), "bias": False,
                       "classes": 1, "seed": 6}


def conv_branch(case: dict[str, Any]) -> str:
    conv = nn.Conv2d(case["in_channels"], case["out_channels"], case["kernel"], case["stride"], case["padding"],
                     case["dilation"])
    positions = conv(torch.zeros(1, case["in_channels"], *case["image"])).shape[-2:].numel()
    p = case["in_channels"] * conv.kernel_size[0] * conv.kernel_size[1]
    return "ghost" if positions * (p + case["out_channels"]) < p * case["out_channels"] else "materialised"


@PROPERTY
@given(conv_cases())
@example(_CONV_GHOST)
@example(_CONV_MATERIALISED)
@example(_CONV_GHOST_STRIDED)
def test_conv2d_matches_one_sample_autograd(case: dict[str, Any]) -> None:
    check_conv(case)


@pytest.mark.parametrize(("case", "branch"), [(_CONV_GHOST, "ghost"), (_CONV_MATERIALISED, "materialised"),
                                              (_CONV_GHOST_STRIDED, "ghost")])
def test_conv2d_branch_selection_is_exercised(case: dict[str, Any], branch: str) -> None:
    assert conv_branch(case) == branch
    conv = nn.Conv2d(case["in_channels"], case["out_channels"], case["kernel"], case["stride"], case["padding"],
                     case["dilation"])
    layer = StackedConv2d(conv)
    params = [p.detach().unsqueeze(0) for p in conv.parameters()]
    saved, out = layer.forward(params, torch.randn(1, 2, case["in_channels"], *case["image"]), False)
    _, per_sample = layer.per_sample_sq_norms(saved, torch.randn_like(out))
    assert (per_sample is not None) == (branch == "materialised")


# ---------------------------------------------------------------------------------------------
# GroupNorm
# ---------------------------------------------------------------------------------------------


@st.composite
def group_norm_cases(draw: st.DrawFn) -> dict[str, Any]:
    per_group, height = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    # A group needs at least 2 values (torch refuses to normalise a single one).
    width = draw(st.integers(2 if per_group * height == 1 else 1, 4))
    return {
        "agents": draw(st.integers(1, 3)), "batch": draw(st.integers(1, 4)),
        "groups": draw(st.integers(1, 3)), "per_group": per_group,
        "image": (height, width), "after_conv": draw(st.booleans()),
        "classes": draw(st.integers(1, 3)), "seed": draw(st.integers(0, 2**16)),
    }


@PROPERTY
@given(group_norm_cases())
@example({"agents": 2, "batch": 3, "groups": 2, "per_group": 3, "image": (3, 2), "after_conv": True,
          "classes": 3, "seed": 7})
def test_group_norm_matches_one_sample_autograd(case: dict[str, Any]) -> None:
    check_group_norm(case)


def check_group_norm(case: dict[str, Any]) -> None:
    groups, channels = case["groups"], case["groups"] * case["per_group"]
    height, width = case["image"]
    template = _seeded(case["seed"], lambda: nn.Sequential(
        *([nn.Conv2d(channels, channels, 1)] if case["after_conv"] else []), nn.GroupNorm(groups, channels),
        nn.Mish(), nn.Flatten(), nn.Linear(channels * height * width, case["classes"])))
    gen = torch.Generator().manual_seed(case["seed"] + 1)
    n, b = case["agents"], case["batch"]
    x = _float_inputs(gen, n, b, channels, height, width) + 0.5  # the mean removal matters
    y = _labels(gen, case["classes"], n, b)
    shared = _float_inputs(gen, 2, channels, height, width)
    assert_matches_reference(template, x, y, shared, case["seed"],
                             float32=group_norm_well_conditioned(template, x, shared, groups, case["seed"]))


def group_norm_well_conditioned(template: nn.Module, x: torch.Tensor, shared: torch.Tensor, groups: int,
                                seed: int) -> bool:
    """Whether float32 group norm is accurate on every group the model normalises.

    torch's float32 kernels (which the plain path uses too) lose about ``2**-24 * rms**2 / var``
    of the variance and divide by ``sqrt(var + eps)``; a group of nearly equal values (two pixels,
    or a small 1x1 convolution in front) leaves the float32 gradients with errors far above 1e-5
    in both paths.  Such draws are checked in float64 only, which is exact for any conditioning.
    """
    params = agent_parameters(template, x.shape[0], seed)
    for agent, row in enumerate(params):
        front = agent_module(template, row)[:-4]  # the layers before the GroupNorm
        with torch.no_grad():
            for inputs in (x[agent], shared):
                values = front(inputs.double()).reshape(inputs.shape[0], groups, -1)
                std, rms = values.std(dim=-1, unbiased=False), values.pow(2).mean(dim=-1).sqrt()
                if bool((std < 0.1).any() or (std < 0.1 * rms).any()):
                    return False
    return True


# ---------------------------------------------------------------------------------------------
# Embedding
# ---------------------------------------------------------------------------------------------


@st.composite
def embedding_cases(draw: st.DrawFn) -> dict[str, Any]:
    vocabulary = draw(st.integers(2, 5))
    return {
        "agents": draw(st.integers(1, 3)), "batch": draw(st.integers(1, 4)), "vocabulary": vocabulary,
        "dim": draw(st.integers(1, 4)), "positions": draw(st.integers(1, 6)),
        "padding_idx": draw(st.none() | st.integers(0, vocabulary - 1)),
        "hidden": draw(st.none() | st.integers(1, 4)), "classes": draw(st.integers(1, 3)),
        "seed": draw(st.integers(0, 2**16)),
    }


@PROPERTY
@given(embedding_cases())
@example({"agents": 2, "batch": 3, "vocabulary": 2, "dim": 3, "positions": 5, "padding_idx": 1, "hidden": None,
          "classes": 3, "seed": 8})  # 5 tokens out of 2: repeats (and padding) guaranteed
@example({"agents": 3, "batch": 2, "vocabulary": 3, "dim": 2, "positions": 6, "padding_idx": None, "hidden": 3,
          "classes": 2, "seed": 9})
def test_embedding_matches_one_sample_autograd(case: dict[str, Any]) -> None:
    check_embedding(case)


def check_embedding(case: dict[str, Any]) -> None:
    t, dim = case["positions"], case["dim"]
    # Optionally a Linear over the positions' embeddings, i.e. a Linear layer with inputs (N, B, T, in).
    middle = [] if case["hidden"] is None else [nn.Linear(dim, case["hidden"]), nn.ReLU()]
    width = dim if case["hidden"] is None else case["hidden"]
    template = _seeded(case["seed"], lambda: nn.Sequential(
        nn.Embedding(case["vocabulary"], dim, padding_idx=case["padding_idx"]), *middle, nn.Flatten(),
        nn.Linear(t * width, case["classes"])))
    gen = torch.Generator().manual_seed(case["seed"] + 1)
    n, b = case["agents"], case["batch"]
    tokens = torch.randint(0, case["vocabulary"], (n, b, t), generator=gen)
    y = _labels(gen, case["classes"], n, b)
    shared = torch.randint(0, case["vocabulary"], (3, t), generator=gen)
    assert_matches_reference(template, tokens, y, shared, case["seed"])


# ---------------------------------------------------------------------------------------------
# Compositions: residual blocks, parameter-free norms, the temporaries' chunking
# ---------------------------------------------------------------------------------------------


def _residual_net() -> tuple[nn.Module, tuple[int, ...]]:
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        Residual(nn.Sequential(nn.GroupNorm(2, 4), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1, bias=False))),
        nn.AvgPool2d(2), nn.Flatten(), nn.Linear(4 * 2 * 2, 3),
    ), (2, 4, 4)


def _normalised_mlp() -> tuple[nn.Module, tuple[int, ...]]:
    return nn.Sequential(
        nn.Flatten(), nn.Linear(6, 5), nn.LayerNorm(5, elementwise_affine=False), nn.GELU(),
        Residual(nn.Sequential(nn.Linear(5, 5), nn.Tanh())), nn.Linear(5, 3),
    ), (2, 3)


def _residual_first() -> tuple[nn.Module, tuple[int, ...]]:
    """Residual blocks before any parameter layer: ``predict`` adds a shared input to per-agent outputs."""
    return nn.Sequential(
        Residual(nn.Tanh()), Residual(nn.Sequential(nn.Linear(6, 6), nn.Tanh())), nn.Linear(6, 3),
    ), (6,)


@pytest.mark.parametrize("build", [_residual_net, _normalised_mlp, _residual_first],
                         ids=["residual-convnet", "layernorm-mlp", "residual-first"])
@pytest.mark.parametrize("seed", [0, 1])
def test_composite_models_match_one_sample_autograd(build: Any, seed: int) -> None:
    template, sample = _seeded(seed, build)
    gen = torch.Generator().manual_seed(seed + 10)
    x = _float_inputs(gen, 2, 3, *sample)
    y = _labels(gen, 3, 2, 3)
    assert_matches_reference(template, x, y, _float_inputs(gen, 2, *sample), seed)


@pytest.mark.parametrize("case", [_CONV_GHOST, _CONV_MATERIALISED, _CONV_GHOST_STRIDED])
def test_conv2d_as_one_grouped_convolution_matches_one_sample_autograd(case: dict[str, Any],
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Few agents run one convolution each; many run one grouped convolution: check the grouped path too."""
    monkeypatch.setattr(layers, "LOOP_CONV_MAX_AGENTS", 0)
    check_conv(case)


def test_results_do_not_depend_on_the_temporaries_chunking(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the temporary budget at one byte every chunked rule runs one sample per chunk."""
    monkeypatch.setattr(layers, "MAX_TEMPORARY_BYTES", 1)
    check_linear(_LINEAR_GHOST)
    check_conv(_CONV_GHOST)
    check_conv(_CONV_MATERIALISED)
    check_embedding(
        {"agents": 2, "batch": 3, "vocabulary": 2, "dim": 3, "positions": 5, "padding_idx": 0, "hidden": 2,
         "classes": 3, "seed": 8})


def test_results_do_not_depend_on_the_agent_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a one-byte group budget every agent runs alone, cut to its last real sample (the masks of
    these checks have padding anywhere, not only at the end): the results are the one-call results."""
    monkeypatch.setattr(stacked_model, "GROUP_ACTIVATION_BYTES", 1)
    monkeypatch.setattr(stacked_model, "GROUP_MIN_ACTIVATION_RATIO", 0)
    check_linear(_LINEAR_GHOST)
    check_conv(_CONV_GHOST)
    check_conv(_CONV_MATERIALISED)
    for name in ("conv-ghost", "group-norm"):  # non-finite samples inside groups
        test_non_finite_sample_contributes_nothing_and_leaves_others_alone(name)


def test_grouped_convnet_equals_one_call_on_poisson_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ConvNet of the audits on Poisson-sized padded batches: groups give the one-call sums and norms."""
    template = build_model("convnet", (1, 12, 12), 3, seed=0)
    model = gradient_model(template, classification_loss, "stacked")
    gen = torch.Generator().manual_seed(3)
    sizes = torch.tensor([1, 7, 3, 7, 5, 2])
    mask = (torch.arange(7)[None, :] < sizes[:, None]).float()
    params = agent_parameters(template, len(sizes), 4)
    x, y = _float_inputs(gen, len(sizes), 7, 1, 12, 12), _labels(gen, 3, len(sizes), 7)
    monkeypatch.setattr(stacked_model, "GROUP_ACTIVATION_BYTES", 2**62)
    one_call = model.clipped_gradient_sums(params, x, y, mask, 0.5)
    per_sample = model._bytes_per_sample(x, y)
    monkeypatch.setattr(stacked_model, "GROUP_ACTIVATION_BYTES", 3 * 4 * per_sample)  # 3 agents of width 4
    assert len(stacked_model.agent_groups(mask, per_sample, stacked_model.GROUP_ACTIVATION_BYTES)) > 1
    out = torch.full_like(params, float("nan"))
    grouped = model.clipped_gradient_sums(params, x, y, mask, 0.5, out=out)
    assert grouped[0] is out
    torch.testing.assert_close(grouped[0], one_call[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grouped[1], one_call[1], rtol=1e-5, atol=1e-6)


def test_agent_groups_cover_every_agent_once_within_the_budget() -> None:
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.float32)
    groups = stacked_model.agent_groups(mask, bytes_per_sample=10, budget=40)
    seen = torch.cat([rows for rows, _ in groups]).sort().values
    assert seen.tolist() == [0, 1, 2, 3, 4]
    last_real = {0: 2, 1: 3, 2: 1, 3: 4, 4: 1}  # an agent without samples still takes one column
    for rows, width in groups:
        assert rows.tolist() == sorted(rows.tolist())
        assert all(last_real[r] <= width for r in rows.tolist())
        assert len(rows) == 1 or len(rows) * width * 10 <= 40
    assert [width for _, width in groups] == sorted(width for _, width in groups)


# ---------------------------------------------------------------------------------------------
# Non-finite samples
# ---------------------------------------------------------------------------------------------


NON_FINITE_MODELS = {
    "linear-first": (lambda: nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)), (5,)),
    "linear-ghost": (lambda: nn.Sequential(nn.Linear(16, 16), nn.Flatten(), nn.Linear(32, 3)), (2, 16)),
    "linear-materialised": (lambda: nn.Sequential(nn.Linear(2, 3), nn.Flatten(), nn.Linear(9, 3)), (3, 2)),
    "conv-ghost": (lambda: nn.Sequential(nn.Conv2d(8, 16, 3), nn.Flatten(), nn.Linear(64, 3)), (8, 4, 4)),
    "conv-materialised": (lambda: nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.Flatten(), nn.Linear(48, 3)),
                          (2, 4, 4)),
    "group-norm": (lambda: nn.Sequential(nn.GroupNorm(2, 4), nn.Flatten(), nn.Linear(36, 3)), (4, 3, 3)),
    "hidden-layers": (lambda: nn.Sequential(nn.Flatten(), nn.Linear(12, 6), nn.ReLU(), nn.Linear(6, 3)), (3, 4)),
}


@pytest.mark.parametrize("name", list(NON_FINITE_MODELS))
def test_non_finite_sample_contributes_nothing_and_leaves_others_alone(name: str) -> None:
    build, sample = NON_FINITE_MODELS[name]
    template = _seeded(0, build)
    model = gradient_model(template, classification_loss, "stacked")
    gen = torch.Generator().manual_seed(1)
    params = model.initial_parameters() + 0.1 * torch.randn(2, model.dim, generator=gen)
    x = _float_inputs(gen, 2, 3, *sample)
    y = _labels(gen, 3, 2, 3)
    mask = torch.ones(2, 3)
    clean = x.clone()
    x.view(2, 3, -1)[0, 1, 0] = float("inf")
    x.view(2, 3, -1)[1, 2, -1] = float("nan")
    bad = torch.zeros(2, 3, dtype=torch.bool)
    bad[0, 1] = bad[1, 2] = True

    reference = reference_gradients(template, params, x, y)
    assert not torch.isfinite(reference.norm(dim=-1)[bad]).any()  # the ground truth's gradient is non-finite
    for clip in (1e12, 0.1):
        sums, norms = model.clipped_gradient_sums(params, x, y, mask, clip)
        assert torch.isfinite(sums).all(), f"a non-finite sample leaked into the clipped sums (clip {clip})"
        assert not torch.isfinite(norms[bad]).any()
        close(norms[~bad], reference.norm(dim=-1)[~bad], "norms of the finite samples")
        close(sums, reference_clipped_sums(reference, mask, clip), f"clipped sums without the bad samples ({clip})")
        # The same as if the bad samples had been padding with ordinary values.
        without, _ = model.clipped_gradient_sums(params, clean, y, (~bad).float(), clip)
        close(sums, without, "clipped sums against the bad samples masked out")


@pytest.mark.parametrize("name", list(NON_FINITE_MODELS))
def test_a_non_finite_padding_row_contributes_nothing(name: str) -> None:
    """Padding re-reads one of the agent's records; if that record is broken, the release must not be NaN."""
    build, sample = NON_FINITE_MODELS[name]
    template = _seeded(0, build)
    model = gradient_model(template, classification_loss, "stacked")
    gen = torch.Generator().manual_seed(2)
    params = model.initial_parameters() + 0.1 * torch.randn(2, model.dim, generator=gen)
    x = _float_inputs(gen, 2, 3, *sample)
    y = _labels(gen, 3, 2, 3)
    mask = torch.ones(2, 3)
    mask[0, 2] = 0.0
    clean = x.clone()
    x.view(2, 3, -1)[0, 2, 0] = float("inf")
    sums, _ = model.clipped_gradient_sums(params, x, y, mask, 0.5)
    assert torch.isfinite(sums).all()
    expected, _ = model.clipped_gradient_sums(params, clean, y, mask, 0.5)
    close(sums, expected, "clipped sums with a broken padding row")


def test_group_norm_on_features_without_spatial_dimensions() -> None:
    template = _seeded(0, lambda: nn.Sequential(nn.Linear(6, 4), nn.GroupNorm(2, 4), nn.Tanh(), nn.Linear(4, 3)))
    gen = torch.Generator().manual_seed(3)
    assert_matches_reference(template, _float_inputs(gen, 2, 3, 6), _labels(gen, 3, 2, 3),
                             _float_inputs(gen, 2, 6), 0)


def test_a_module_listed_twice_runs_twice() -> None:
    shared_activation = nn.Tanh()
    template = _seeded(0, lambda: nn.Sequential(nn.Linear(5, 5), shared_activation, nn.Linear(5, 5),
                                               shared_activation, nn.Linear(5, 3)))
    gen = torch.Generator().manual_seed(4)
    assert_matches_reference(template, _float_inputs(gen, 2, 3, 5), _labels(gen, 3, 2, 3),
                             _float_inputs(gen, 2, 5), 0)


# ---------------------------------------------------------------------------------------------
# Unsupported modules: the vmap fallback
# ---------------------------------------------------------------------------------------------


class Scale(nn.Module):
    """A custom layer with a parameter: no stacked rule can know what it does."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class Doubling(nn.Module):
    """A custom parameter-free layer: it might mix samples, so the compiler refuses it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2.0 * x


class Centre(nn.Identity):
    """A subclass of a per-sample module whose forward mixes the samples of its batch: by its type, it is not
    the module it derives from."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(dim=0)


class BatchLayerNorm(nn.LayerNorm):
    """A parameter-free LayerNorm subclass that normalises over the batch too."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x - x.mean(dim=0))


def _with_buffer() -> nn.Module:
    model = nn.Sequential(nn.Flatten(), nn.Linear(4, 2))
    model.register_buffer("offset", torch.zeros(4))
    return model


def _tied_weights() -> nn.Module:
    first, second = nn.Linear(4, 4), nn.Linear(4, 4)
    second.weight = first.weight
    return nn.Sequential(nn.Flatten(), first, nn.Tanh(), second, nn.Linear(4, 2))


UNSUPPORTED = {
    "affine-layernorm": (lambda: nn.Sequential(nn.Flatten(), nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2)),
                         "LayerNorm"),
    "grouped-conv": (lambda: nn.Sequential(nn.Conv2d(2, 4, 1, groups=2), nn.Flatten(), nn.Linear(4, 2)),
                     "groups=2"),
    "custom-parametrised": (lambda: nn.Sequential(nn.Flatten(), Scale(4), nn.Linear(4, 2)), "Scale"),
    "custom-parameter-free": (lambda: nn.Sequential(nn.Flatten(), Doubling(), nn.Linear(4, 2)), "Doubling"),
    "embedding-max-norm": (lambda: nn.Sequential(nn.Embedding(4, 2, max_norm=1.0), nn.Flatten(), nn.Linear(2, 2)),
                           "max_norm"),
    # torch divides each token's gradient by its count in the whole batch: a cross-sample effect
    "embedding-scale-grad-by-freq": (lambda: nn.Sequential(nn.Embedding(4, 2, scale_grad_by_freq=True), nn.Flatten(),
                                                           nn.Linear(2, 2)), "scale_grad_by_freq"),
    "buffers": (_with_buffer, "offset"),
    "inplace-activation": (lambda: nn.Sequential(nn.Flatten(), nn.Linear(4, 4), nn.ReLU(inplace=True),
                                                 nn.Linear(4, 2)), "in place"),
    "tied-weights": (_tied_weights, "shared with another layer"),
    "subclassed-per-sample-module": (lambda: nn.Sequential(nn.Flatten(), nn.Linear(4, 4), Centre(), nn.Linear(4, 2)),
                                     "Centre"),
    "subclassed-parameter-free-norm": (lambda: nn.Sequential(nn.Flatten(), nn.Linear(4, 4),
                                                             BatchLayerNorm(4, elementwise_affine=False),
                                                             nn.Linear(4, 2)), "BatchLayerNorm"),
}


@pytest.mark.parametrize("name", list(UNSUPPORTED))
def test_unsupported_module_falls_back_to_vmap_with_a_logged_reason(name: str, caplog: pytest.LogCaptureFixture
                                                                     ) -> None:
    build, culprit = UNSUPPORTED[name]
    module = build()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        model = gradient_model(module, classification_loss, "auto")
    assert type(model) is FlatModel
    assert model.backend == "vmap"
    assert model.fallback_reason and culprit in model.fallback_reason
    warnings = [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and culprit in warnings[0].getMessage()
    with pytest.raises(Unsupported, match=culprit):
        gradient_model(module, classification_loss, "stacked")


def test_a_subclass_that_mixes_samples_cannot_mix_agents() -> None:
    """The stacked engine applies a per-sample module to all agents' samples merged into one batch; a subclass
    that mixes its batch (here ``x - x.mean(0)``) there would let one agent's data into another's clipped sum
    (a reviewer measured a change of 6.38 in agent 0's sum from agent 1's inputs).  It takes the vmap engine,
    where each agent's sums depend on its own inputs alone."""
    template = _seeded(0, lambda: nn.Sequential(nn.Flatten(), nn.Linear(4, 4), Centre(), nn.Linear(4, 2)))
    model = gradient_model(template, classification_loss, "auto")
    gen = torch.Generator().manual_seed(0)
    params = model.initial_parameters() + 0.1 * torch.randn(2, model.dim, generator=gen)
    x, y, mask = _float_inputs(gen, 2, 3, 4), _labels(gen, 2, 2, 3), torch.ones(2, 3)
    sums, _ = model.clipped_gradient_sums(params, x, y, mask, 10.0)
    other = x.clone()
    other[1] = 100.0 * _float_inputs(gen, 3, 4)
    changed, _ = model.clipped_gradient_sums(params, other, y, mask, 10.0)
    assert torch.equal(sums[0], changed[0]), "agent 1's inputs changed agent 0's clipped sum"


def test_supported_module_compiles_silently_and_vmap_backend_is_respected(caplog: pytest.LogCaptureFixture) -> None:
    module = nn.Sequential(nn.Flatten(), nn.Linear(4, 3))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        auto = gradient_model(module, classification_loss, "auto")
    assert isinstance(auto, StackedModel) and auto.backend == "stacked" and auto.fallback_reason is None
    assert not [r for r in caplog.records if r.name == LOGGER]
    forced = gradient_model(module, classification_loss, "vmap")
    assert type(forced) is FlatModel and forced.backend == "vmap" and forced.fallback_reason is None


# ---------------------------------------------------------------------------------------------
# The library's models: stacked engine against the vmap engine
# ---------------------------------------------------------------------------------------------


LIBRARY_MODELS = [
    ("convnet", (1, 32, 32), 10),
    ("mlp", (1, 8, 8), 10),
    ("lenet5", (1, 28, 28), 10),
    ("cifar-cnn", (3, 8, 8), 10),
    ("resnet9", (3, 8, 8), 10),
    ("linear", (1, 8, 8), 10),
    ("logistic", (1, 8, 8), 2),
]


@pytest.mark.parametrize(("name", "shape", "classes"), LIBRARY_MODELS, ids=[case[0] for case in LIBRARY_MODELS])
def test_library_model_compiles_to_stacked_and_matches_vmap(name: str, shape: tuple[int, int, int],
                                                            classes: int) -> None:
    module = build_model(name, shape, classes, seed=0)
    stacked = gradient_model(module, classification_loss, "auto")
    assert isinstance(stacked, StackedModel), getattr(stacked, "fallback_reason", None)
    flat = FlatModel(module, classification_loss)
    gen = torch.Generator().manual_seed(0)
    n_agents, batch = 2, 3
    params = stacked.initial_parameters() + 0.01 * torch.randn(n_agents, stacked.dim, generator=gen)
    x = _float_inputs(gen, n_agents, batch, *shape)
    y = torch.randint(0, classes, (n_agents, batch), generator=gen)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    real = mask > 0

    _, flat_norms = flat.clipped_gradient_sums(params, x, y, mask, 1e12)
    clip = 0.5 * float(flat_norms[real].median())
    flat_sums, flat_norms = flat.clipped_gradient_sums(params, x, y, mask, clip)
    sums, norms = stacked.clipped_gradient_sums(params, x, y, mask, clip)
    close(norms[real], flat_norms[real], f"{name} per-sample norms", atol=0.0)
    # Relative to each agent's sum (ResNet-9's gradients are large and have millions of entries).
    error = (sums - flat_sums).norm(dim=1) / flat_sums.norm(dim=1)
    assert (error < 1e-4).all(), f"{name}: relative error of the clipped sums {error.tolist()}"
    if name != "resnet9":
        close(sums, flat_sums, f"{name} clipped sums")
    close(stacked.predict(params, x[0]), flat.predict(params, x[0]), f"{name} predictions", rtol=1e-4, atol=1e-4)


def test_a_clipped_float32_gradient_stays_within_the_clip_norm() -> None:
    """The noise is calibrated to a sensitivity of exactly C, so a clipped per-sample gradient's true norm (in
    float64) must not exceed C even where its float32 norm is off by rounding (a reviewer measured clipped
    norms up to 9e-7 above C through the flat path before the margin)."""
    from decentdp.gradients.clipping import clipped_sum

    generator = torch.Generator().manual_seed(0)
    per_sample = torch.randn(64, 1, 500_000, generator=generator) * torch.logspace(-2, 2, 64)[:, None, None]
    for clip in (0.1, 1.0, 10.0):  # one sample per "agent": each sum is one clipped gradient
        totals, _ = clipped_sum(per_sample, torch.ones(64, 1), clip)
        assert (totals.double().norm(dim=1) <= clip).all()


def test_the_flat_path_sums_norms_in_float64() -> None:
    """A float32 sum of many equal squares falls short of the true norm by far more than the clipping margin
    (a reviewer measured clipped vectors of 4M equal entries at 1.0027 C, and ResNet-9 samples on the vmap
    engine at 1.0004 C)."""
    from decentdp.gradients.clipping import clipped_sum

    for value in (0.3, 0.7, 1.1):  # float32 norms of 1M such entries clipped to 1.00008-1.0007 C
        per_sample = torch.full((1, 1, 1_000_000), value)
        totals, _ = clipped_sum(per_sample, torch.ones(1, 1), 1.0)
        assert float(totals.double().norm()) <= 1.0


@pytest.mark.parametrize("backend", ["stacked", "vmap"])
@pytest.mark.parametrize("clip", [1e-2, 1e-3])
def test_a_record_of_extreme_magnitude_stays_within_the_clip_norm(backend: str, clip: float) -> None:
    """One pixel between 1e38 and 3.4e38 (one agent per value, one sample each): the clip factor C'/||g||
    (||g|| ~ 1e38) was subnormal in float32, rounded to nearest, and the clipped sums reached 1.0003 C
    (a reviewer's sweep, both engines).  Such a sample is now dropped: its norm is above 2^100 C."""
    model = gradient_model(build_model("linear", (1, 8, 8), 10, seed=0), classification_loss, backend)
    values = torch.linspace(1e38, 3.4e38, 400)
    x = torch.zeros(len(values), 1, 1, 8, 8)
    x[:, 0, 0, 3, 3] = values
    params = model.initial_parameters().repeat(len(values), 1)
    top = model.predict(params[:1], x[0])[0, 0].argmax()
    y = torch.full((len(values), 1), int(top + 1) % 10)  # any label but the top class: a gradient of size ~1e38
    sums, norms = model.clipped_gradient_sums(params, x, y, torch.ones(len(values), 1), clip)
    assert float(sums.double().norm(dim=1).max()) <= clip
    assert (norms >= 1e38).all()  # those beyond float32's range come back as inf (and count as clipped)


@pytest.mark.parametrize("clip", [1e-2, 1e-3, 1e-4])
def test_underflow_in_the_weighted_pass_cannot_lift_a_contribution_above_the_clip_norm(clip: float) -> None:
    """Inputs near 3e38 under zero weights and a bias that favours the label by 30: the output gradient is
    ~1e-13, the norm ~1e26 (the clip factor a normal float32), but ``c g`` is subnormal and the weighted pass
    multiplies its rounding by the input (without the underflow rule: up to 1.0076 C at C = 1e-4, 1.0005 C at
    C = 1e-2).  The sample is dropped where its underflow bound exceeds ``UNDERFLOW_SHARE`` of C."""
    model = gradient_model(build_model("linear", (1, 8, 8), 10, seed=0), classification_loss, "stacked")
    values = torch.logspace(36, 38.5, 300)
    values = values[values < 3.4e38]
    params = torch.zeros(len(values), model.dim)
    params[:, -10] = 30.0  # the bias of class 0
    x = values.view(-1, 1, 1, 1, 1).expand(-1, 1, 1, 8, 8).contiguous()
    y = torch.zeros(len(values), 1, dtype=torch.long)
    sums, _ = model.clipped_gradient_sums(params, x, y, torch.ones(len(values), 1), clip)
    assert float(sums.double().norm(dim=1).max()) <= clip


@pytest.mark.parametrize("name", ["linear-first", "conv-ghost", "conv-materialised"])
def test_a_dropped_sample_of_absurd_size_leaves_the_others_alone(name: str) -> None:
    """A finite sample that is dropped for its size contributes nothing, as a non-finite one does, and the other
    samples' sums are those with it masked out."""
    build, sample = NON_FINITE_MODELS[name]
    model = gradient_model(_seeded(0, build), classification_loss, "stacked")
    gen = torch.Generator().manual_seed(1)
    params = model.initial_parameters() + 0.1 * torch.randn(2, model.dim, generator=gen)
    x, y = _float_inputs(gen, 2, 3, *sample), _labels(gen, 3, 2, 3)
    huge = x.clone()
    huge[0, 1] = 3e38
    sums, _ = model.clipped_gradient_sums(params, huge, y, torch.ones(2, 3), 0.5)
    keep = torch.ones(2, 3)
    keep[0, 1] = 0.0
    expected, _ = model.clipped_gradient_sums(params, x, y, keep, 0.5)
    close(sums, expected, f"{name}: clipped sums with a sample of absurd size")


def test_clip_weights_never_exceed_their_float64_factors() -> None:
    """The float64 clip factor is rounded toward zero into float32, subnormal factors included."""
    norms = torch.logspace(-3, 60, 20_001, dtype=torch.float64)
    keep = torch.ones_like(norms, dtype=torch.bool)
    weights = clip_weights(norms, keep, 1.0, torch.float32)
    factors = clip_factors(norms, 1.0)
    assert (weights.double() <= factors).all()
    assert (weights.double() < factors).any()  # some do round (the check is not vacuous)
    normal = factors >= 2**-126  # a normal float32 keeps 24 bits; a subnormal one fewer
    assert (weights.double()[normal] >= factors[normal] * (1 - 2**-23)).all()


def _cancelling_ghost_conv(delta: float) -> nn.Sequential:
    """A conv that takes the ghost rule (16 positions, 576 x 64 weights) under a classifier whose weights
    alternate in sign over the positions, so a constant image's per-position terms ``g_t a_t^T`` cancel to
    ``16 delta`` of their size: the true gradient is tiny and the float32 ghost norm all rounding."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(64, 64, 3), nn.Flatten(), nn.Linear(64 * 16, 2))
    with torch.no_grad():
        model[0].weight.mul_(1e-3)
        model[0].bias.zero_()
        signs = torch.ones(16)
        signs[1::2] = -1
        model[2].weight.copy_((torch.randn(2, 64, 1) * (signs + delta)).reshape(2, 64 * 16))
    return model


@pytest.mark.parametrize("delta", [1e-2, 1e-3, 3e-4])
def test_a_ghost_norm_bounds_the_computed_gradient_when_positions_cancel(delta: float) -> None:
    """Each agent holds one sample, so its clipped sum is that sample's contribution: at most C, however the
    per-position terms cancel.  With float32 grams a reviewer's crafted record reached 22 C at delta = 3e-4
    (the ghost norm rounded to zero, so the sample went in unclipped)."""
    template = _cancelling_ghost_conv(delta)
    assert StackedConv2d(template[0])._cost_ghost_over_materialised(16) < 1.0  # the ghost rule is what runs
    model = gradient_model(template, classification_loss, "stacked")
    agents = 8
    params = model.initial_parameters().repeat(agents, 1)
    x = torch.ones(agents, 1, 64, 6, 6) * torch.linspace(1, 50, agents).view(agents, 1, 1, 1, 1)
    y = torch.zeros(agents, 1, dtype=torch.long)
    sums, norms = model.clipped_gradient_sums(params, x, y, torch.ones(agents, 1), 1.0)
    assert float(sums.double().norm(dim=1).max()) <= 1.0
    exact = FlatModel(template, classification_loss)
    _, true_norms = exact.clipped_gradient_sums(params.double(), x.double(), y, torch.ones(agents, 1,
                                                                                          dtype=torch.float64), 1.0)
    assert (norms.double() >= true_norms * (1 - 1e-6)).all()  # a bound, never the rounded-down norm


def _cudnn_would_use_tf32() -> bool:
    """Whether cuDNN would compute a float32 convolution in TF32 under the current settings."""
    if hasattr(torch.backends.cudnn, "conv"):  # torch >= 2.9: the per-operation setting decides
        return torch.backends.cudnn.conv.fp32_precision == "tf32"
    return bool(torch.backends.cudnn.allow_tf32)


def _to_tf32(tensor: torch.Tensor) -> torch.Tensor:
    """Float32 values rounded to TF32's 10-bit mantissa (to nearest), as tensor cores read their operands."""
    bits = tensor.contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)


@pytest.fixture
def tf32_requested() -> Any:
    """TF32 asked for everywhere it can be: cuDNN's default, and ``set_float32_matmul_precision("medium")``
    (TF32 for cuBLAS, bfloat16 for oneDNN on CPUs that have it); the caller's settings come back after."""
    before = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("medium")
    torch.backends.cudnn.allow_tf32 = True
    yield
    torch.set_float32_matmul_precision(before[0])
    torch.backends.cudnn.allow_tf32 = before[1]


@pytest.mark.parametrize("delta", [1e-2, 1e-3, 3e-4])
def test_a_cancelling_ghost_conv_stays_within_the_clip_norm_where_cudnn_would_use_tf32(
        delta: float, tf32_requested: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The weighted pass's convolution behaves as cuDNN's would: TF32 operands (unit roundoff 2^-11) whenever
    the settings let cuDNN use TF32, float32 otherwise.  The ghost bound takes float32's 2^-24; with TF32 a
    reviewer's emulation reached 1.0066, 1.0608 and 1.1652 C on these records."""
    original = torch.nn.grad.conv2d_weight

    def as_cudnn(inputs: torch.Tensor, weight_size: Any, grad_output: torch.Tensor, *args: Any,
                 **kwargs: Any) -> torch.Tensor:
        if inputs.dtype == torch.float32 and _cudnn_would_use_tf32():
            return original(_to_tf32(inputs).double(), weight_size, _to_tf32(grad_output).double(), *args,
                            **kwargs).float()
        return original(inputs, weight_size, grad_output, *args, **kwargs)

    monkeypatch.setattr(torch.nn.grad, "conv2d_weight", as_cudnn)
    template = _cancelling_ghost_conv(delta)
    model = gradient_model(template, classification_loss, "stacked")
    agents = 8
    params = model.initial_parameters().repeat(agents, 1)
    x = torch.ones(agents, 1, 64, 6, 6) * torch.linspace(1, 50, agents).view(agents, 1, 1, 1, 1)
    sums, _ = model.clipped_gradient_sums(params, x, torch.zeros(agents, 1, dtype=torch.long),
                                          torch.ones(agents, 1), 1.0)
    assert float(sums.double().norm(dim=1).max()) <= 1.0
    assert _cudnn_would_use_tf32()  # the caller's settings are back


def _precisions() -> dict[str, object]:
    """The float32 precision settings of torch's products and convolutions, both interfaces."""
    settings: dict[str, object] = {"cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
                                   "float32_matmul_precision": torch.get_float32_matmul_precision()}
    if hasattr(torch.backends.cudnn, "conv"):  # torch >= 2.9
        for owner, operation in (("cuda", "matmul"), ("cudnn", "conv"), ("mkldnn", "matmul"), ("mkldnn", "conv")):
            settings[f"{owner}.{operation}"] = getattr(getattr(torch.backends, owner), operation).fp32_precision
    return settings


@pytest.mark.parametrize("backend", ["stacked", "vmap"])
def test_clipped_sums_are_formed_in_ieee_float32_and_the_callers_settings_come_back(
        backend: str, tf32_requested: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every weighted pass (stacked engine) and the weighted sum of the vmap engine see IEEE float32 settings for
    cuDNN, cuBLAS and oneDNN, even where the caller asked for TF32 or bfloat16; after the call the caller's
    settings are as they were."""
    expected = {"cudnn.allow_tf32": False, "float32_matmul_precision": "highest", "cuda.matmul": "ieee",
                "cudnn.conv": "ieee", "mkldnn.matmul": "ieee", "mkldnn.conv": "ieee"}
    before = _precisions()
    seen: list[dict[str, object]] = []
    weighted_gradients, einsum = layers.ParamLayer.weighted_gradients, torch.einsum

    def recording_pass(self: layers.ParamLayer, *args: Any, **kwargs: Any) -> None:
        seen.append(_precisions())
        weighted_gradients(self, *args, **kwargs)

    def recording_einsum(equation: str, *operands: Any) -> torch.Tensor:
        if equation == "nb,nbd->nd":  # the vmap engine's clipped sum
            seen.append(_precisions())
        return einsum(equation, *operands)

    monkeypatch.setattr(layers.ParamLayer, "weighted_gradients", recording_pass)
    monkeypatch.setattr(torch, "einsum", recording_einsum)
    template = _seeded(0, lambda: nn.Sequential(nn.Conv2d(8, 16, 3), nn.GroupNorm(4, 16), nn.Tanh(),
                                               nn.Conv2d(16, 4, 1), nn.Flatten(), nn.Linear(16, 3)))
    model = gradient_model(template, classification_loss, backend)
    gen = torch.Generator().manual_seed(0)
    params = model.initial_parameters() + 0.1 * torch.randn(2, model.dim, generator=gen)
    model.clipped_gradient_sums(params, _float_inputs(gen, 2, 3, 8, 4, 4), _labels(gen, 3, 2, 3), torch.ones(2, 3),
                                0.5)
    assert len(seen) == (4 if backend == "stacked" else 1)
    for during in seen:
        assert during == {key: value for key, value in expected.items() if key in during}
    assert _precisions() == before


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here: cuDNN's TF32 convolutions are "
                                                          "tested where torch sees one")
@pytest.mark.parametrize("delta", [1e-2, 1e-3, 3e-4])
def test_a_cancelling_ghost_conv_stays_within_the_clip_norm_on_cuda(delta: float) -> None:
    """On a GPU, with torch's default settings (cuDNN allowed TF32): the records of
    :func:`_cancelling_ghost_conv` stay within C."""
    template = _cancelling_ghost_conv(delta)
    model = gradient_model(template, classification_loss, "stacked")
    agents, device = 8, torch.device("cuda")
    params = model.initial_parameters().to(device).repeat(agents, 1)
    x = torch.ones(agents, 1, 64, 6, 6, device=device) * torch.linspace(1, 50, agents, device=device).view(
        agents, 1, 1, 1, 1)
    sums, _ = model.clipped_gradient_sums(params, x, torch.zeros(agents, 1, dtype=torch.long, device=device),
                                          torch.ones(agents, 1, device=device), 1.0)
    assert float(sums.double().norm(dim=1).max()) <= 1.0


# ---------------------------------------------------------------------------------------------
# Empty batches
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["stacked", "vmap"])
@pytest.mark.parametrize(("agents", "batch"), [(3, 0), (0, 4), (0, 0)])
@pytest.mark.parametrize("name", ["linear-first", "conv-ghost"])
def test_no_agents_or_empty_batches_give_zero_sums(backend: str, agents: int, batch: int, name: str) -> None:
    """An empty mask is a zero clipped sum per agent (a grouped convolution of zero groups and reshapes of zero
    elements used to raise), written into ``out`` when it is given."""
    build, sample = NON_FINITE_MODELS[name]
    model = gradient_model(_seeded(0, build), classification_loss, backend)
    params = model.initial_parameters().repeat(agents, 1)
    x, y = torch.zeros(agents, batch, *sample), torch.zeros(agents, batch, dtype=torch.long)
    out = torch.full((agents, model.dim), 7.0)
    sums, norms = model.clipped_gradient_sums(params, x, y, torch.zeros(agents, batch), 1.0, out=out)
    assert sums is out and torch.equal(out, torch.zeros(agents, model.dim))
    assert norms.shape == (agents, batch)
