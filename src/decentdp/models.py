"""Model registry: the networks the experiments train, and the per-sample loss they train with.

Every agent of a simulation runs the same architecture; the engine keeps the agents' parameters
stacked, and the module built here is a template that one of two gradient engines evaluates
(:func:`decentdp.gradients.stacked_model.gradient_model`).  By default it is the stacked engine,
which compiles the module into a program over all agents at once and clips without per-sample
gradients; it knows ``Sequential`` chains, :class:`Residual` blocks, ``Linear``, ``Conv2d``,
``GroupNorm`` and ``Embedding`` layers and a list of parameter-free per-sample modules, by their
exact classes.  A model with anything else is evaluated through
:func:`torch.func.functional_call` under :func:`torch.func.vmap` -- once over agents, and once more
over samples to obtain the per-sample gradients that DP-SGD clips -- with a logged reason.  That
dictates the design rules every model here follows:

* no layer that mixes samples of a batch (BatchNorm and friends): a per-sample gradient is only
  meaningful, and its clipping only bounds one person's influence, if each sample's output
  depends on that sample alone -- :func:`validate_for_dp` enforces this; GroupNorm is used
  instead;
* no in-place operations and no data-dependent Python control flow, so ``vmap`` can batch them
  (and the stacked engine keeps the activations it needs);
* torch's own layer classes in ``Sequential`` chains and :class:`Residual` blocks, so that the
  stacked engine takes the model;
* all sizes are worked out from the input shape ``(C, H, W)`` when the model is built, so the
  same builder serves digits (1x8x8), MNIST (1x28x28 or padded 1x32x32) and CIFAR (3x32x32).

Models are registered with :func:`register_model` and built by name with :func:`build_model`,
which seeds the initialisation without touching the global random state.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from decentdp.errors import ConfigError

ModelBuilder = Callable[[tuple[int, int, int], int], nn.Module]
"""Builds a fresh module from the input shape ``(C, H, W)`` and the number of classes.

A builder may also accept keyword-only options (e.g. ``hidden`` for ``mlp``); :func:`build_model`
passes them through and rejects any option the builder does not declare.
"""

MODELS: dict[str, ModelBuilder] = {}
"""Registered builders by name; populated by :func:`register_model`."""

_B = TypeVar("_B", bound=ModelBuilder)


def register_model(name: str) -> Callable[[_B], _B]:
    """Register a builder under ``name`` in :data:`MODELS`.

    Parameters
    ----------
    name : str
        The name configs use (``model.name``). Must not be registered already.

    Returns
    -------
    Callable
        A decorator that records the builder and returns it unchanged.

    Raises
    ------
    ValueError
        If ``name`` is already taken; two builders under one name is a bug, not a user error.
    """

    def decorator(builder: _B) -> _B:
        if name in MODELS:
            raise ValueError(f"model {name!r} is already registered")
        MODELS[name] = builder
        return builder

    return decorator


def build_model(
    name: str,
    input_shape: tuple[int, int, int],
    num_classes: int,
    *,
    seed: int,
    **options: object,
) -> nn.Module:
    """Build the registered model ``name`` with a reproducible initialisation.

    Parameters
    ----------
    name : str
        A key of :data:`MODELS`.
    input_shape : tuple of int
        Shape ``(C, H, W)`` of one input sample.
    num_classes : int
        Number of classes of the task.
    seed : int
        Seed of the initialisation: the same seed gives bit-identical parameters. The global
        torch RNG is saved and restored around the build, so building a model never perturbs
        data shuffling or noise drawn elsewhere.
    **options
        Keyword options of the builder (e.g. ``hidden=(256, 128)`` for ``mlp``).

    Returns
    -------
    torch.nn.Module
        The freshly initialised float32 model on the CPU.

    Raises
    ------
    ConfigError
        ``model.name`` for an unknown name (the message lists the registered ones) or a model
        that cannot handle ``input_shape`` / ``num_classes``; ``model.<option>`` for an option
        the builder does not accept or an invalid option value.
    """
    builder = _builder_taking(name, options)
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):
        # Seed only the CPU generator (torch.manual_seed would also reseed CUDA, which fork_rng
        # with devices=[] does not restore); the model is created on the CPU even under another
        # default device, so that every device starts from the same parameters (moved there after).
        torch.default_generator.manual_seed(seed)
        return builder(tuple(input_shape), num_classes, **options)  # type: ignore[call-arg]


def check_model_options(name: str, options: Mapping[str, object]) -> None:
    """Refuse, naming ``model.options.<option>``, an option model ``name`` does not take or a value its builder
    refuses, before any data is read (so that ``--dry-run`` and a sweep's first trial catch it).  The builder runs
    on the meta device (no memory, no initialisation) for 32x32 three-channel inputs and ten classes; whether the
    model fits the data's shape and classes is checked when :func:`build_model` builds it for them."""
    builder = _builder_taking(name, options)
    try:
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            builder((3, 32, 32), 10, **options)  # type: ignore[call-arg]
    except ConfigError as error:
        if error.field.startswith("model.options."):
            raise
    except (TypeError, ValueError) as error:  # a value the builder passed on to torch unchecked
        raise ConfigError("model.options", f"model {name!r} cannot be built with {dict(options)}: {error}") from None


def _builder_taking(name: str, options: Mapping[str, object]) -> ModelBuilder:
    """The builder of model ``name``, after refusing an unknown name or an option it does not take."""
    if name not in MODELS:
        raise ConfigError("model.name", f"unknown model {name!r}; choose one of: {', '.join(sorted(MODELS))}")
    builder = MODELS[name]
    accepted = [
        p.name
        for p in inspect.signature(builder).parameters.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    ]
    for option in options:
        if option not in accepted:
            allowed = f"accepted options: {', '.join(accepted)}" if accepted else "it takes no options"
            raise ConfigError(f"model.options.{option}", f"model {name!r} has no option {option!r}; {allowed}")
    return builder


def count_parameters(model: nn.Module) -> int:
    """Return the number of scalar parameters of ``model`` (all of them, trainable or not).

    This is the dimension of the vector each agent stores and gossips, which sets the
    communication cost and the memory of the stacked engine state.
    """
    return sum(p.numel() for p in model.parameters())


def validate_for_dp(model: nn.Module) -> None:
    """Reject models whose layers couple the samples of a batch.

    DP-SGD clips each sample's gradient to bound that sample's influence; this requires every
    sample's loss to depend only on that sample. BatchNorm (any ``_BatchNorm``, including
    ``SyncBatchNorm``) normalises with batch statistics, and InstanceNorm with
    ``track_running_stats=True`` accumulates running statistics across samples into buffers, so
    both break the per-sample independence the privacy analysis relies on.

    Parameters
    ----------
    model : torch.nn.Module
        The model to check.

    Raises
    ------
    ConfigError
        ``model.name``, naming each offending submodule and suggesting GroupNorm.
    """
    offending = [
        f"{path or '<root>'} ({type(module).__name__})"
        for path, module in model.named_modules()
        if isinstance(module, nn.modules.batchnorm._BatchNorm)
        or (isinstance(module, nn.modules.instancenorm._InstanceNorm) and module.track_running_stats)
    ]
    if offending:
        raise ConfigError(
            "model.name",
            "the model contains layers that mix samples of a batch: "
            + ", ".join(offending)
            + ". Per-sample gradients (DP-SGD clipping) need every sample to be processed "
            "independently; replace these layers with GroupNorm (or InstanceNorm without "
            "running statistics).",
        )


def classification_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-sample classification loss (no reduction).

    Parameters
    ----------
    logits : torch.Tensor
        Model outputs of shape ``(..., K)``. With ``K == 1`` the single column is the logit of
        class 1 of a binary task (the ``logistic`` model); otherwise the ``K`` class scores.
    targets : torch.Tensor
        Integer class labels of shape ``logits.shape[:-1]`` (in ``{0, 1}`` when ``K == 1``).

    Returns
    -------
    torch.Tensor
        Losses of shape ``logits.shape[:-1]``: binary cross-entropy with logits when ``K == 1``,
        softmax cross-entropy otherwise. Unreduced so the caller can take per-sample gradients
        and choose its own averaging.
    """
    if logits.shape[-1] == 1:
        return F.binary_cross_entropy_with_logits(
            logits.squeeze(-1), targets.to(logits.dtype), reduction="none"
        )
    if logits.dim() > 2:
        return F.cross_entropy(logits.flatten(0, -2), targets.flatten(), reduction="none").view(targets.shape)
    return F.cross_entropy(logits, targets, reduction="none")


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def _flat_size(input_shape: tuple[int, int, int]) -> int:
    channels, height, width = input_shape
    return channels * height * width


def _after_conv_pool(size: int, kernel: int, padding: int = 0, pool: int = 1) -> int:
    """Spatial size after a stride-1 convolution followed by a ``pool`` x ``pool`` pooling."""
    return (size + 2 * padding - kernel + 1) // pool


def _require_size(name: str, input_shape: tuple[int, int, int], ok: bool, need: str) -> None:
    if not ok:
        raise ConfigError(
            "model.name",
            f"model {name!r} needs inputs of {need}; got input shape {tuple(input_shape)}",
        )


def _group_norm(channels: int) -> nn.GroupNorm:
    """GroupNorm with up to 32 groups, the usual BatchNorm replacement in DP training."""
    return nn.GroupNorm(min(32, channels), channels)


class Residual(nn.Module):
    """``x + block(x)``, written out-of-place so ``vmap`` can batch it."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.block(x)


# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------


_CONVNET_ACTIVATIONS: dict[str, type[nn.Module]] = {"mish": nn.Mish, "tanh": nn.Tanh, "relu": nn.ReLU}


@register_model("convnet")
def convnet(input_shape: tuple[int, int, int], num_classes: int, *, activation: str = "mish",
            norm: str = "none") -> nn.Module:
    """The small MNIST ConvNet of the DP consensus experiments (Bayrooti et al., App. B).

    ``Conv2d(C -> 3, 5x5) -> Mish -> MaxPool2d(2) -> Flatten -> Linear(-> 64) -> Mish ->
    Linear(64 -> num_classes)``. For 1x32x32 inputs the flattened size is 3*14*14 = 588 and
    the model has 38,424 parameters, as in the paper; other input sizes only change the first
    linear layer.  Options that often suit DP-SGD (Papernot et al. 2021: bounded activations; De et
    al. 2022: group normalisation): ``activation`` = ``"mish"`` (the paper's, default), ``"tanh"`` or
    ``"relu"``; ``norm = "group"`` adds a GroupNorm (one group per channel) after the convolution.
    The defaults build the paper's model, with the same initial weights.
    """
    if activation not in _CONVNET_ACTIVATIONS:
        raise ConfigError("model.options.activation", f"unknown activation {activation!r}; choose one of: "
                                                      f"{', '.join(_CONVNET_ACTIVATIONS)}")
    if norm not in ("none", "group"):
        raise ConfigError("model.options.norm", f"expected 'none' or 'group', got {norm!r}")
    channels, height, width = input_shape
    _require_size("convnet", input_shape, min(height, width) >= 6, "at least 6x6 pixels")
    flat = 3 * _after_conv_pool(height, 5, pool=2) * _after_conv_pool(width, 5, pool=2)
    act = _CONVNET_ACTIVATIONS[activation]
    return nn.Sequential(
        nn.Conv2d(channels, 3, kernel_size=5),
        *([_group_norm(3)] if norm == "group" else []),
        act(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(flat, 64),
        act(),
        nn.Linear(64, num_classes),
    )


@register_model("mlp")
def mlp(
    input_shape: tuple[int, int, int], num_classes: int, *, hidden: int | Sequence[int] = 100
) -> nn.Module:
    """Fully connected ReLU network: ``Flatten -> [Linear -> ReLU] per hidden layer -> Linear``.

    ``hidden`` is one width (default 100, one hidden layer) or a sequence of widths, one per
    hidden layer, e.g. ``(256, 128)``.
    """
    # Configs deliver a list (TOML array) or an int; anything else is rejected below as empty.
    widths = [hidden] if isinstance(hidden, int) else list(hidden) if isinstance(hidden, list | tuple) else []
    if not widths or not all(isinstance(w, int) and not isinstance(w, bool) and w > 0 for w in widths):
        raise ConfigError(
            "model.options.hidden", f"expected a positive integer or a non-empty list of them; got {hidden!r}"
        )
    layers: list[nn.Module] = [nn.Flatten()]
    fan_in = _flat_size(input_shape)
    for width in widths:
        layers += [nn.Linear(fan_in, width), nn.ReLU()]
        fan_in = width
    layers.append(nn.Linear(fan_in, num_classes))
    return nn.Sequential(*layers)


_LENET_ACTIVATIONS: dict[str, type[nn.Module]] = {"tanh": nn.Tanh, "relu": nn.ReLU}


@register_model("lenet5")
def lenet5(input_shape: tuple[int, int, int], num_classes: int, *, activation: str = "tanh") -> nn.Module:
    """LeNet-5 (LeCun et al., 1998) with average pooling.

    ``Conv 6@5x5 -> act -> AvgPool 2 -> Conv 16@5x5 -> act -> AvgPool 2 -> Flatten -> 120 ->
    act -> 84 -> act -> num_classes``. Inputs smaller than 32x32 (MNIST's 28x28) get a padding
    of 2 in the first convolution, as the original network saw 28x28 digits centred in a 32x32
    field; both cases flatten to 16*5*5 = 400 features (61,706 parameters for 10 classes).
    ``activation`` is ``"tanh"`` (classic, default) or ``"relu"``.
    """
    if activation not in _LENET_ACTIVATIONS:
        raise ConfigError(
            "model.options.activation",
            f"unknown activation {activation!r}; choose one of: {', '.join(_LENET_ACTIVATIONS)}",
        )
    act = _LENET_ACTIVATIONS[activation]
    channels, height, width = input_shape
    padding = 2 if min(height, width) < 32 else 0
    _require_size("lenet5", input_shape, min(height, width) + 2 * padding >= 16, "at least 12x12 pixels")
    out_h = _after_conv_pool(_after_conv_pool(height, 5, padding, pool=2), 5, pool=2)
    out_w = _after_conv_pool(_after_conv_pool(width, 5, padding, pool=2), 5, pool=2)
    return nn.Sequential(
        nn.Conv2d(channels, 6, kernel_size=5, padding=padding),
        act(),
        nn.AvgPool2d(2),
        nn.Conv2d(6, 16, kernel_size=5),
        act(),
        nn.AvgPool2d(2),
        nn.Flatten(),
        nn.Linear(16 * out_h * out_w, 120),
        act(),
        nn.Linear(120, 84),
        act(),
        nn.Linear(84, num_classes),
    )


@register_model("cifar-cnn")
def cifar_cnn(input_shape: tuple[int, int, int], num_classes: int) -> nn.Module:
    """Small CIFAR CNN: two ``Conv 3x3 -> GroupNorm -> ReLU -> MaxPool 2`` blocks (32 and 64
    channels) and a linear classifier.

    GroupNorm (8 groups) replaces the BatchNorm such networks usually carry, since BatchNorm
    mixes samples and rules out per-sample gradients.
    """
    channels, height, width = input_shape
    _require_size("cifar-cnn", input_shape, min(height, width) >= 4, "at least 4x4 pixels")
    return nn.Sequential(
        nn.Conv2d(channels, 32, kernel_size=3, padding=1),
        nn.GroupNorm(8, 32),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, kernel_size=3, padding=1),
        nn.GroupNorm(8, 64),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * (height // 4) * (width // 4), num_classes),
    )


@register_model("cga-cnn")
def cga_cnn(input_shape: tuple[int, int, int], num_classes: int, *, activation: str = "none") -> nn.Module:
    """The CNN of CGA (Esfandiari et al. 2021, ``models.py`` ``CNN(ch, fc)``; DPDL specs A.5.1 item 7):
    ``Conv(32) -> Conv(32) -> MaxPool 2 -> Conv(64) -> MaxPool 2 -> Conv(64) -> MaxPool 2 -> Linear``,
    all convolutions 3x3 with padding 1; ``fc`` is 576 for 28x28 inputs and 1024 for 32x32.

    ``activation = "none"`` is the authors' network exactly (it has no ReLU); ``"relu"`` adds one after
    each convolution.  The authors' ``Dropout(0.25)`` is left out: gradients are evaluated with
    deterministic functional calls, where dropout would draw unkeyed randomness."""
    if activation not in ("none", "relu"):
        raise ConfigError("model.options.activation", f"expected 'none' or 'relu', got {activation!r}")
    channels, height, width = input_shape
    _require_size("cga-cnn", input_shape, min(height, width) >= 8, "at least 8x8 pixels")

    def act() -> list[nn.Module]:
        return [nn.ReLU()] if activation == "relu" else []

    return nn.Sequential(
        nn.Conv2d(channels, 32, kernel_size=3, padding=1), *act(),
        nn.Conv2d(32, 32, kernel_size=3, padding=1), *act(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, kernel_size=3, padding=1), *act(),
        nn.MaxPool2d(2),
        nn.Conv2d(64, 64, kernel_size=3, padding=1), *act(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * (height // 8) * (width // 8), num_classes),
    )


def _conv_norm_relu(in_channels: int, out_channels: int, pool: bool = False) -> nn.Sequential:
    layers: list[nn.Module] = [
        nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1, bias=False),
        _group_norm(out_channels),
        nn.ReLU(),
    ]
    if pool:
        layers.append(nn.MaxPool2d(2))
    return nn.Sequential(*layers)


@register_model("resnet9")
def resnet9(input_shape: tuple[int, int, int], num_classes: int) -> nn.Module:
    """ResNet-9 (Page's DAWNBench network) with GroupNorm, as used for DP training on CIFAR-10
    (e.g. Klause et al., 2022, arXiv:2203.00324).

    ``prep 64 -> [128, pool, residual(128, 128)] -> [256, pool] -> [512, pool,
    residual(512, 512)] -> global max pool -> Linear(512 -> num_classes)``, where each unit is
    ``Conv 3x3 (no bias) -> GroupNorm(min(32, C) groups) -> ReLU``. Designed for 3x32x32 inputs;
    the global pooling window is sized from ``input_shape`` so any input of at least 8x8 works.
    """
    channels, height, width = input_shape
    _require_size("resnet9", input_shape, min(height, width) >= 8, "at least 8x8 pixels")
    return nn.Sequential(
        _conv_norm_relu(channels, 64),
        _conv_norm_relu(64, 128, pool=True),
        Residual(nn.Sequential(_conv_norm_relu(128, 128), _conv_norm_relu(128, 128))),
        _conv_norm_relu(128, 256, pool=True),
        _conv_norm_relu(256, 512, pool=True),
        Residual(nn.Sequential(_conv_norm_relu(512, 512), _conv_norm_relu(512, 512))),
        nn.MaxPool2d((height // 8, width // 8)),
        nn.Flatten(),
        nn.Linear(512, num_classes),
    )


@register_model("linear")
def linear(input_shape: tuple[int, int, int], num_classes: int) -> nn.Module:
    """Multiclass logistic regression: ``Flatten -> Linear(in -> num_classes)``.

    The model outputs logits; the softmax is part of :func:`classification_loss`.
    """
    return nn.Sequential(nn.Flatten(), nn.Linear(_flat_size(input_shape), num_classes))


@register_model("logistic")
def logistic(input_shape: tuple[int, int, int], num_classes: int) -> nn.Module:
    """Binary logistic regression: ``Flatten -> Linear(in -> 1)``, one logit per sample.

    Only for two-class tasks; :func:`classification_loss` applies binary cross-entropy to the
    single output column.
    """
    if num_classes != 2:
        raise ConfigError(
            "model.name",
            f"model 'logistic' is binary and needs num_classes == 2, got {num_classes}; "
            "use 'linear' for multiclass logistic regression",
        )
    return nn.Sequential(nn.Flatten(), nn.Linear(_flat_size(input_shape), 1))
