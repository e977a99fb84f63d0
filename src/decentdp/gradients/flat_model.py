"""A model as a function of one flat parameter vector, vectorised over agents and samples.

The simulator stores the parameters of all N agents as one ``(N, d)`` matrix.  Mixing is then a
single matrix product, noise a single draw, an optimizer step a few element-wise kernels, and the
model itself is called through ``torch.func.functional_call`` on *views* of a row, under
``torch.func.vmap`` over agents (and over samples for per-sample gradients).  The model's
forward and backward passes never loop over agents in Python.  This path materialises every
per-sample gradient ``(N, B, d)``; :mod:`decentdp.gradients.stacked_model` avoids that for the layers
it knows and is the default.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from decentdp.gradients.clipping import clipped_sum

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class FlatModel:
    """Wraps an ``nn.Module`` so that it is evaluated at a flat parameter vector of length ``dim``.

    The module itself is only a template: its parameters are read once (``initial_parameters``) and
    never updated; buffers are passed through unchanged (DP models have no running statistics).
    This class is the general gradient engine, for any module ``torch.func`` can batch; the faster
    :class:`~decentdp.gradients.stacked_model.StackedModel` overrides the gradient methods for the
    layers it knows.
    """

    #: Which gradient engine this is (reported in run logs and profiles).
    backend = "vmap"
    #: Why the faster stacked engine was not used, when it was tried and refused the model.
    fallback_reason: str | None = None
    #: :meth:`activation_bytes_per_sample` is what it accounts for times this: the allocator's peak during a private
    #: gradient (measured with torch's profiler on the CPU, torch 2.13, LeNet-5, ConvNet, CIFAR-CNN, MLP and
    #: ResNet-9, batches of 8 to 128) grew by 1.27 to 1.49 times the accounted bytes per sample, for temporaries
    #: the accounting leaves out (about a third copy of the per-sample gradients).
    activation_headroom = 1.6

    def __init__(self, module: nn.Module, loss: LossFn) -> None:
        self.module = module
        self.loss = loss
        named = list(module.named_parameters())
        self.names = [name for name, _ in named]
        self.shapes = [tuple(p.shape) for _, p in named]
        self.numels = [p.numel() for _, p in named]
        self.dim = sum(self.numels)
        self.buffers = {name: b.detach() for name, b in module.named_buffers()}

    def initial_parameters(self) -> torch.Tensor:
        """The template module's parameters as one flat vector."""
        return torch.cat([p.detach().reshape(-1) for p in self.module.parameters()])

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of ``flat`` shaped like the module's parameters (no copy)."""
        return {name: chunk.view(shape)
                for name, chunk, shape in zip(self.names, flat.split(self.numels), self.shapes, strict=True)}

    def forward(self, flat: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        """Outputs of the model at parameters ``flat`` (d,) for a batch ``inputs``."""
        return functional_call(self.module, (self.unflatten(flat), self.buffers), (inputs,))

    def _sample_loss(self, flat: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.loss(self.forward(flat, x.unsqueeze(0)), y.unsqueeze(0)).squeeze(0)

    def per_sample_gradients(self, params: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Gradients of every sample's loss at its agent's parameters: ``(N, B, d)``.

        ``params`` is ``(N, d)``, ``x`` is ``(N, B, ...)`` and ``y`` is ``(N, B)``.
        """
        per_sample = vmap(grad(self._sample_loss), in_dims=(None, 0, 0))
        return vmap(per_sample, in_dims=(0, 0, 0))(params, x, y)

    def clipped_gradient_sums(self, params: torch.Tensor, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor,
                              clip: float, out: torch.Tensor | None = None,
                              copies: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Each agent's sum of clipped per-sample gradients ``(N, d)`` and the norms before clipping ``(N, B)``.

        Padding (``mask == 0``) and samples with a non-finite gradient or one of absurd size (above
        ``2^100 C``; :func:`~decentdp.gradients.clipping.dropped`) contribute nothing; norms beyond
        float32's range come back as inf.  The sums are written into ``out`` (an ``(N, d)`` tensor,
        possibly a view) when it is given.  With ``copies = K`` (augmentation multiplicity, De et al.
        2022), ``x`` and ``y`` hold ``K`` consecutive rows per column of ``mask``, augmented copies of
        one record, and the gradient that is clipped is the mean of the copies' gradients.  No agents
        (``N = 0``) or empty batches (``B = 0``) give ``(N, d)`` zeros and empty ``(N, B)`` norms.
        """
        check_copies(x, y, mask, copies)
        if mask.numel() == 0:
            return empty_clipped_sums(params, mask, out)
        per_sample = self.per_sample_gradients(params, x, y)
        if copies > 1:
            per_sample = per_sample.view(per_sample.shape[0], -1, copies, per_sample.shape[-1]).mean(dim=2)
        sums, norms = clipped_sum(per_sample, mask, clip)
        if out is None:
            return sums, norms
        return out.copy_(sums), norms

    def batch_gradients(self, params: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
                        weights: torch.Tensor) -> torch.Tensor:
        """Gradient of each agent's weighted loss sum ``sum_b w_b l(x_b)``: ``(N, d)``."""

        def weighted_loss(flat: torch.Tensor, xb: torch.Tensor, yb: torch.Tensor, wb: torch.Tensor) -> torch.Tensor:
            return (self.loss(self.forward(flat, xb), yb) * wb).sum()

        return vmap(grad(weighted_loss))(params, x, y, weights)

    def activation_bytes_per_sample(self, sample: torch.Tensor, target: torch.Tensor) -> int:
        """Bytes one training sample keeps alive while private gradients are computed (the memory plan's figure).

        What autograd saves for the backward pass (measured on a dry run, see
        :func:`saved_bytes_per_sample`) plus the sample's flat per-sample gradient and its copy, times
        :attr:`activation_headroom` for the temporaries this leaves out.
        """
        def run(batch: torch.Tensor, targets: torch.Tensor) -> None:
            self.loss(self.module(batch), targets).sum()

        return math.ceil(self.activation_headroom * (saved_bytes_per_sample(run, sample, target) + 2 * 4 * self.dim))

    @torch.no_grad()
    def forward_flops_per_sample(self, sample: torch.Tensor) -> int:
        """Floating-point operations of one sample's forward pass through the model's weight layers (a
        multiply and an add per weight use in every linear and convolution layer), to size a round's work
        before choosing its threads.  Counted with forward hooks on one pass: ``torch.utils.flop_counter``
        would count the same products but takes seconds to import."""
        counted = 0

        def count(layer: nn.Module, _inputs: object, output: torch.Tensor) -> None:
            nonlocal counted
            weight = layer.weight  # (out, in) or (out_channels, in_channels / groups, *kernel)
            counted += 2 * output.numel() * (weight.numel() // weight.shape[0])

        layers = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
        handles = [m.register_forward_hook(count) for m in self.module.modules() if isinstance(m, layers)]
        try:
            with torch.random.fork_rng(devices=[]):  # a layer that draws (dropout) leaves the global stream as it was
                self.module(sample.unsqueeze(0))
        finally:
            for handle in handles:
                handle.remove()
        return counted

    @torch.no_grad()
    def predict(self, params: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        """Outputs of every agent's model on one shared batch: ``(N, B, outputs)``."""
        return vmap(self.forward, in_dims=(0, None))(params, inputs)


def empty_clipped_sums(params: torch.Tensor, mask: torch.Tensor,
                       out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``clipped_gradient_sums`` returns for a ``mask`` without entries (no agents, or batches of no samples):
    zero sums (written into ``out`` when it is given) and no norms.  The model is not run: its layers refuse
    empty batches (a grouped convolution of zero groups, a reshape of zero elements)."""
    sums = torch.zeros(params.shape, dtype=params.dtype, device=params.device) if out is None else out.zero_()
    return sums, torch.zeros(mask.shape, dtype=params.dtype, device=params.device)


def check_copies(x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, copies: int) -> None:
    """``x`` and ``y`` must hold ``copies`` rows for each column of ``mask`` (see ``clipped_gradient_sums``)."""
    if copies < 1 or x.shape[:2] != (mask.shape[0], mask.shape[1] * copies) or y.shape[:2] != x.shape[:2]:
        raise ValueError(f"{copies} copies per sample: x {tuple(x.shape[:2])} and y {tuple(y.shape[:2])} should "
                         f"have {mask.shape[1] * copies} rows per agent for a mask of shape {tuple(mask.shape)}")


def saved_bytes_per_sample(run: Callable[[torch.Tensor, torch.Tensor], None], sample: torch.Tensor,
                           target: torch.Tensor) -> int:
    """Bytes autograd saves per sample when ``run(inputs, targets)`` builds a graph.

    Measured with saved-tensor hooks on batches of one and two copies of ``sample``; the
    difference removes what does not grow with the batch (parameters).
    """
    def measure(batch: int) -> int:
        saved = 0

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            nonlocal saved
            saved += tensor.numel() * tensor.element_size()
            return tensor

        inputs = sample.unsqueeze(0).expand(batch, *sample.shape).contiguous()
        targets = target.reshape(1).expand(batch).contiguous()
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            run(inputs, targets)
        return saved

    return max(0, measure(2) - measure(1))
