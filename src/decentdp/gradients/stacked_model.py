"""The fast gradient engine: a model run layer by layer for all agents at once, clipped without per-sample gradients.

:class:`StackedModel` compiles an ``nn.Module`` tree (``Sequential`` chains, residual blocks, the
parameter layers of :mod:`decentdp.gradients.layers` and per-sample parameter-free modules) into a
small program over stacked agent tensors.  A private gradient then costs one forward pass, one
backward pass that stops at the layers' outputs (no parameter gradients), the per-sample norms
from each layer's input and output gradient, and one weighted parameter gradient per layer::

    c_{i,b} = min(1, C / ||grad l(theta_i; x_{i,b})||)          (flat clipping, DP-SGD)
    S_i     = sum_b c_{i,b} grad l(theta_i; x_{i,b})             (the clipped sum the noise is added to)

which is the book-keeping form of ghost clipping (Bu et al. 2023): the ``(N, B, d)`` per-sample
gradients of the ``torch.func`` path are never built, except for small layers where building them
is the cheaper way to the norm (then they also give the weighted sum).

Per-sample modules with a faster CPU kernel (Mish, pooling; :mod:`decentdp.gradients.cpu_kernels`) run
through it on CPU tensors.  Models with a module outside this vocabulary keep the ``torch.func`` path of
:class:`FlatModel`; :func:`gradient_model` logs the reason.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from decentdp.gradients.clipping import UNDERFLOW_SHARE, clip_weights, dropped, ieee_float32
from decentdp.gradients.cpu_kernels import cpu_kernel
from decentdp.gradients.flat_model import FlatModel, LossFn, check_copies, empty_clipped_sums, saved_bytes_per_sample
from decentdp.gradients.layers import (
    PER_SAMPLE_MODULES,
    ParamLayer,
    Recorded,
    StackedLinear,
    Unsupported,
    stacked_layer,
)
from decentdp.models import Residual

logger = logging.getLogger(__name__)

#: On the CPU, agents are evaluated in groups whose activations take about this many bytes (see
#: :func:`agent_groups`).  Measured for the ConvNet at N = 1500 Poisson batches of 32 of 100
#: records (benchmarks/audit_blocks.py): 107-146 us per real sample in one call, 46-48 us in groups
#: of 16-32 MiB, 52 at 64 MiB, 80 at 2 MiB (per-call overheads); cifar-cnn N = 10: 2.5 times faster.
GROUP_ACTIVATION_BYTES = 24 * 2**20
#: ... but only for models whose activations per sample are at least this many times the input's
#: bytes (convolutional ones): for linear models and MLPs the input dominates, and regrouping would
#: copy it for nothing (the logistic model at N = 1000 took 1.6 times as long grouped).
GROUP_MIN_ACTIVATION_RATIO = 4

Tensor = torch.Tensor


@dataclass(frozen=True)
class _Slot:
    """Where one parameter lives in the flat vector."""

    offset: int
    numel: int
    shape: tuple[int, ...]


@dataclass(frozen=True)
class _Params:
    layer: ParamLayer
    slots: tuple[_Slot, ...]


@dataclass(frozen=True)
class _PerSample:
    """A module that acts on each sample alone, as it is applied: its faster CPU kernel if it has one, else itself."""

    apply: Callable[[Tensor], Tensor]


@dataclass(frozen=True)
class _Chain:
    nodes: tuple[_Node, ...]


@dataclass(frozen=True)
class _Residual:
    body: _Node


_Node = _Params | _PerSample | _Chain | _Residual


def _compile(module: nn.Module, prefix: str, slots: dict[str, _Slot]) -> _Node:
    """The program of ``module`` (named ``prefix`` inside the root); raises :class:`Unsupported`."""
    where = prefix or "the model"
    if type(module) is nn.Sequential:
        # _modules, not named_children(): a module listed twice runs twice.
        return _Chain(tuple(_compile(child, f"{prefix}{name}.", slots) for name, child in module._modules.items()
                            if child is not None))
    if type(module) is Residual:
        return _Residual(_compile(module.block, f"{prefix}block.", slots))
    own = list(module.named_parameters(recurse=False))
    if getattr(module, "inplace", False):
        raise Unsupported(f"{where.rstrip('.')} ({type(module).__name__}) works in place, which would overwrite "
                          "the activations kept for the per-sample norms")
    if not own and not list(module.children()):
        # Exact types, not isinstance: a subclass may override forward with something that mixes samples (x -
        # x.mean(0)), which applied to agents and samples merged into one batch would mix agents too.
        if type(module) in PER_SAMPLE_MODULES or type(module) in (nn.GroupNorm, nn.LayerNorm):
            return _PerSample(cpu_kernel(module) or module)
        raise Unsupported(f"{where.rstrip('.')} ({type(module).__name__}) is not known to act on each sample alone")
    if list(module.children()):
        raise Unsupported(f"{where.rstrip('.')} ({type(module).__name__}) is a container without a stacked rule")
    try:
        layer = stacked_layer(module)
    except Unsupported as exc:
        raise Unsupported(f"{where.rstrip('.')}: {exc}") from None
    names = [name for name, _ in own]
    if sorted(names) != sorted(layer.param_names):
        raise Unsupported(f"{where.rstrip('.')} has parameters {names}, the rule expects {list(layer.param_names)}")
    missing = [prefix + name for name in layer.param_names if prefix + name not in slots]
    if missing:  # e.g. weights tied to another layer's, which named_parameters() lists once
        raise Unsupported(f"{where.rstrip('.')} uses parameters shared with another layer ({', '.join(missing)})")
    return _Params(layer, tuple(slots[prefix + name] for name in layer.param_names))


def _param_layers(node: _Node) -> Iterator[_Params]:
    if isinstance(node, _Params):
        yield node
    elif isinstance(node, _Chain):
        for child in node.nodes:
            yield from _param_layers(child)
    elif isinstance(node, _Residual):
        yield from _param_layers(node.body)


class StackedModel(FlatModel):
    """A :class:`FlatModel` whose gradients are computed layer by layer over stacked agents.

    Raises :class:`~decentdp.gradients.layers.Unsupported` when the module cannot be compiled.
    """

    backend = "stacked"
    #: See :attr:`FlatModel.activation_headroom`: measured the same way, the allocator's peak was 0.8 to 1.24 times
    #: the accounted bytes for the convolutional models (the excess, at small batches: per-agent temporaries of the
    #: weighted passes, of the size of a layer's parameters); an MLP's excess, its first layer's float64 copies, is
    #: counted on its own (:meth:`activation_bytes_per_sample`).
    activation_headroom = 1.3

    def __init__(self, module: nn.Module, loss: LossFn) -> None:
        super().__init__(module, loss)
        if self.buffers:
            raise Unsupported(f"the model has buffers ({', '.join(self.buffers)}); stacked layers are stateless")
        slots, offset = {}, 0
        for name, numel, shape in zip(self.names, self.numels, self.shapes, strict=True):
            slots[name] = _Slot(offset, numel, shape)
            offset += numel
        self.program = _compile(module, "", slots)
        self._sample_bytes: dict[tuple[object, ...], int] = {}
        covered = sum(slot.numel for node in _param_layers(self.program) for slot in node.slots)
        if covered != self.dim:
            raise Unsupported("some parameters are used outside the layers the program knows")

    # -- the program ------------------------------------------------------------------------

    def _run(self, node: _Node, params: Tensor, x: Tensor, shared: bool,
             tape: list[Recorded] | None) -> tuple[Tensor, bool]:
        """Run ``node`` on ``x``; returns the output and whether it is still shared by all agents."""
        if isinstance(node, _Chain):
            for child in node.nodes:
                x, shared = self._run(child, params, x, shared, tape)
            return x, shared
        if isinstance(node, _Residual):
            body, body_shared = self._run(node.body, params, x, shared, tape)
            return x + body, shared and body_shared  # a shared x broadcasts over the agent dimension
        if isinstance(node, _PerSample):
            if shared:
                return node.apply(x), True
            return _per_sample_apply(node.apply, x), False
        n_agents = params.shape[0]
        layer_params = [params[:, s.offset:s.offset + s.numel].view(n_agents, *s.shape) for s in node.slots]
        saved, out = node.layer.forward(layer_params, x, shared)
        if tape is not None:
            if not out.requires_grad:  # the first layer: its output starts the graph
                out.requires_grad_()
            tape.append(Recorded(node.layer, saved, out))
        return out, False

    # -- gradients ----------------------------------------------------------------------------

    def clipped_gradient_sums(self, params: Tensor, x: Tensor, y: Tensor, mask: Tensor, clip: float,
                              out: Tensor | None = None, copies: int = 1) -> tuple[Tensor, Tensor]:
        """See :meth:`FlatModel.clipped_gradient_sums`.

        On the CPU the agents are evaluated in groups (:func:`agent_groups`): agents of similar batch
        size together, each group cut to its own largest batch and small enough for its activations
        to stay in cache.  Agents are independent, so this changes nothing but the work: a Poisson
        round pads every agent to the largest batch of all (about 1.5 times the mean for thousands
        of agents at 32 of 100 records), and activations of thousands of agents at once stream
        through memory at a fraction of the speed of cached ones.
        """
        check_copies(x, y, mask, copies)
        if mask.numel() == 0:
            return empty_clipped_sums(params, mask, out)
        sums = torch.empty(params.shape, dtype=params.dtype, device=params.device) if out is None else out
        if params.device.type != "cpu":  # a GPU prefers one wide call, without host reads
            return self._clipped_group(params, x, y, mask, clip, copies, sums)
        per_copy = self._bytes_per_sample(x, y)
        if per_copy < GROUP_MIN_ACTIVATION_RATIO * x[0, 0].numel() * x.element_size():
            # Little beyond the input itself (linear models, MLPs): grouping would mostly copy the input.
            return self._clipped_group(params, x, y, mask, clip, copies, sums)
        groups = agent_groups(mask, copies * per_copy, GROUP_ACTIVATION_BYTES)
        if len(groups) == 1 and groups[0][1] == mask.shape[1]:
            return self._clipped_group(params, x, y, mask, clip, copies, sums)
        norms = torch.zeros(mask.shape, dtype=params.dtype, device=params.device)
        for rows, width in groups:
            rows_of_copies = width * copies
            group_sums, group_norms = self._clipped_group(params[rows], x[rows, :rows_of_copies],
                                                          y[rows, :rows_of_copies], mask[rows, :width], clip, copies)
            sums[rows] = group_sums
            norms[rows, :width] = group_norms  # columns beyond the group's width are padding: norm 0
        return sums, norms

    def _bytes_per_sample(self, x: Tensor, y: Tensor) -> int:
        """The accounted activation bytes per sample for this input shape (without the headroom, which
        :data:`GROUP_ACTIVATION_BYTES` was measured without), measured once."""
        key = (tuple(x.shape[2:]), x.dtype, tuple(y.shape[2:]), y.dtype)
        cached = self._sample_bytes.get(key)
        if cached is None:
            sample, scale = x[0, 0], 1.0
            template = self.initial_parameters().dtype
            if sample.is_floating_point() and sample.dtype != template:  # measured in the template's dtype
                sample, scale = sample.to(template), sample.element_size() / template.itemsize
            measured = self._accounted_bytes_per_sample(sample.cpu(), y[0, 0].cpu())
            cached = self._sample_bytes[key] = max(1, int(measured * scale))
        return cached

    def _clipped_group(self, params: Tensor, x: Tensor, y: Tensor, mask: Tensor, clip: float, copies: int,
                       out: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """The clipped sums and norms of all of ``params``' agents in one pass of the program."""
        tape: list[Recorded] = []
        with torch.enable_grad():
            logits, _ = self._run(self.program, params.detach(), x, False, tape)
            # Padding contributes no gradient; a sample's copies each weigh 1/K, so its gradient is their mean.
            weights = mask if copies == 1 else mask.repeat_interleave(copies, dim=1) / copies
            total = (self.loss(logits, y) * weights).sum()
            output_grads = list(torch.autograd.grad(total, [record.output for record in tape]))
        layers = [(record.layer, record.saved.detach()) for record in tape]
        del tape, logits, total  # the layers' outputs are no longer needed
        # float64 throughout: a layer's squared norm (a certified bound for ghost norms) must not be
        # rounded down on its way to the clip factor
        squared = torch.zeros(mask.shape, dtype=torch.float64, device=params.device)
        underflow = torch.zeros_like(squared)
        materialised = []
        for (layer, inputs), grad_out in zip(layers, output_grads, strict=True):
            layer_sq, per_sample = layer.per_sample_sq_norms(inputs, grad_out, copies)
            squared += layer_sq
            if per_sample is None:  # the weighted pass will work from the activations
                bound = layer.underflow_error(inputs, grad_out, copies)
                if bound is not None:
                    underflow += bound
            materialised.append(per_sample)
        norms = squared.sqrt()
        # A dropped row (a non-finite gradient, from a real sample or from padding re-reading a bad record;
        # a norm or activations of absurd size) must contribute exactly nothing: its factor, output gradients
        # and inputs are zeroed, since 0 * inf and 0 * NaN are NaN.  Other padding rows have zero output
        # gradients (their loss is masked).  (A NaN underflow bound fails the comparison: dropped.)
        broken = dropped(norms, clip) | ~(underflow <= UNDERFLOW_SHARE * clip)
        any_broken = bool(broken.any())
        factors = clip_weights(norms, (mask > 0) & ~broken, clip, params.dtype)
        sums = torch.empty(params.shape, dtype=params.dtype, device=params.device) if out is None else out
        slots = {id(node.layer): node.slots for node in _param_layers(self.program)}
        keep_copies = ~broken if copies == 1 else (~broken).repeat_interleave(copies, dim=1)
        with ieee_float32():  # the rounding bounds of the layers' rules take float32 arithmetic, not TF32
            for (layer, inputs), grad_out, per_sample in zip(layers, output_grads, materialised, strict=True):
                if any_broken:
                    grad_out, inputs = _zero_rows(grad_out, keep_copies), _zero_rows(inputs, keep_copies)
                    per_sample = None if per_sample is None else [_zero_rows(g, ~broken) for g in per_sample]
                targets = [sums[:, s.offset:s.offset + s.numel].view(len(sums), *s.shape) for s in slots[id(layer)]]
                layer.weighted_gradients(inputs, grad_out, factors, per_sample, targets, copies)
        return sums, norms.to(params.dtype)

    def batch_gradients(self, params: Tensor, x: Tensor, y: Tensor, weights: Tensor) -> Tensor:
        with torch.enable_grad():
            leaf = params.detach().requires_grad_()
            logits, _ = self._run(self.program, leaf, x, False, None)
            total = (self.loss(logits, y) * weights).sum()
            (grads,) = torch.autograd.grad(total, leaf)
        return grads

    @torch.no_grad()
    def predict(self, params: Tensor, inputs: Tensor) -> Tensor:
        outputs, shared = self._run(self.program, params, inputs, True, None)
        return outputs.expand(params.shape[0], *outputs.shape) if shared else outputs

    # -- memory -------------------------------------------------------------------------------

    def activation_bytes_per_sample(self, sample: Tensor, target: Tensor) -> int:
        """Bytes one training sample keeps alive during a private gradient (the memory plan's figure): what autograd
        saves, plus each parameter layer's output and output gradient (kept until the clip factors are known),
        times :attr:`activation_headroom` for the temporaries this leaves out, plus the float64 copies that a
        linear layer's per-sample norms take of its input and output gradient (8 bytes an element, for the
        largest such layer: for an MLP on images, whose first layer's input is not an activation, the largest
        term; a convolution's norms work through chunks of bounded size,
        :data:`~decentdp.gradients.layers.MAX_TEMPORARY_BYTES`)."""
        records = self._records_of_one(sample)
        float64_copies = max((8 * (record.saved.numel() + record.output.numel()) for record in records
                              if isinstance(record.layer, StackedLinear)), default=0)
        return math.ceil(self.activation_headroom * self._accounted_bytes_per_sample(sample, target, records)
                         + float64_copies)

    def _records_of_one(self, sample: Tensor) -> list[Recorded]:
        """The parameter layers' inputs and outputs for one sample of one agent (at the template's parameters)."""
        records: list[Recorded] = []
        with torch.no_grad():
            self._run(self.program, self.initial_parameters().unsqueeze(0), sample.reshape(1, 1, *sample.shape),
                      False, records)
        return records

    def _accounted_bytes_per_sample(self, sample: Tensor, target: Tensor,
                                    records: list[Recorded] | None = None) -> int:
        """What autograd saves per sample plus the parameter layers' outputs and output gradients (``records`` from
        :meth:`_records_of_one`, computed when not given): :meth:`activation_bytes_per_sample` before the
        headroom, and the figure the CPU's agent groups are sized by."""
        params = self.initial_parameters().unsqueeze(0)

        def run(inputs: Tensor, targets: Tensor) -> None:
            tape: list[Recorded] = []
            logits, _ = self._run(self.program, params, inputs.unsqueeze(0), False, tape)
            self.loss(logits, targets.unsqueeze(0)).sum()

        records = self._records_of_one(sample) if records is None else records
        outputs = sum(record.output.numel() * record.output.element_size() for record in records)
        return saved_bytes_per_sample(run, sample, target) + 2 * outputs


def agent_groups(mask: Tensor, bytes_per_sample: int, budget: int) -> list[tuple[Tensor, int]]:
    """Agents ``(rows, width)`` grouped for :meth:`StackedModel.clipped_gradient_sums`.

    Each agent needs the columns up to its last real sample (``mask > 0``), wherever the padding is.
    Agents are taken in order of that width, and a group grows while ``agents x width x
    bytes_per_sample`` stays within ``budget`` (at least one agent per group), so that each group
    pads only to its own largest batch and its activations fit in ``budget`` bytes.  ``rows`` are
    ascending within a group.  One host read of ``N`` widths.
    """
    n_agents, columns = mask.shape
    real = mask > 0
    position = torch.arange(1, columns + 1, device=mask.device)
    widths = torch.where(real, position, torch.zeros_like(position)).amax(dim=1).clamp_(min=1).cpu()
    order = torch.argsort(widths, stable=True)
    ordered = widths[order].tolist()
    groups, start = [], 0
    for end in range(1, n_agents + 1):
        if end == n_agents or (end + 1 - start) * ordered[end] * bytes_per_sample > budget:
            rows, _ = order[start:end].sort()
            groups.append((rows.to(mask.device), int(ordered[end - 1])))
            start = end
    return groups


def _per_sample_apply(module: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """``module`` on activations ``(N, B, ...)`` with agents and samples merged into one batch dimension.

    Any order of the merged samples will do, since the module treats them independently; so the
    order that is free in memory is used (a convolution leaves its output sample-major), instead of
    copying the activations into agent-major order.
    """
    n_agents, batch = x.shape[:2]
    if not x.is_contiguous() and x.transpose(0, 1).is_contiguous():
        out = module(x.transpose(0, 1).reshape(batch * n_agents, *x.shape[2:]))
        return out.view(batch, n_agents, *out.shape[1:]).transpose(0, 1)
    out = module(x.reshape(n_agents * batch, *x.shape[2:]))
    return out.view(n_agents, batch, *out.shape[1:])


def _zero_rows(tensor: Tensor, keep: Tensor) -> Tensor:
    """``tensor`` (``(N, B, ...)``) with the samples where ``keep`` is False set to zero."""
    return torch.where(keep.view(*keep.shape, *([1] * (tensor.dim() - 2))), tensor, torch.zeros_like(tensor))


def gradient_model(module: nn.Module, loss: LossFn, backend: str = "auto") -> FlatModel:
    """The fastest gradient engine that supports ``module``.

    ``backend`` is ``"auto"`` (stacked if the model compiles, else ``torch.func`` with a logged
    reason), ``"stacked"`` (error if it does not compile) or ``"vmap"`` (always ``torch.func``).
    """
    if backend == "vmap":
        return FlatModel(module, loss)
    try:
        return StackedModel(module, loss)
    except Unsupported as exc:
        if backend == "stacked":
            raise
        logger.warning("per-sample gradients use the slower torch.func path: %s", exc)
        model = FlatModel(module, loss)
        model.fallback_reason = str(exc)
        return model
