"""Augmentation multiplicity: each sampled record trains as the mean of K randomly augmented copies.

De et al. 2022 ("Unlocking high-accuracy differentially private image classification through
scale", arXiv:2204.13650, Sec. 3.1) average the gradients of ``K`` augmentations of one record
*before* clipping::

    g_b = clip_C( (1/K) sum_{k=1..K} grad l(theta; aug_k(x_b)) )

A record still changes one clipped term of norm at most ``C``, so the mechanism, its noise and its
accounting are exactly those of plain DP-SGD: the copies cost compute (``K`` times the forward and
backward work), not privacy.  Augmenting without multiplicity (one random copy per record) is the
``copies = 1`` case; it is known to hurt DP-SGD, which the average over copies undoes.

The augmentations here are the usual ones for small images: a random translation by up to
``shift`` pixels in each direction (pad by reflection, then crop at a random offset, as for
CIFAR in De et al.), and optionally a random horizontal flip (not for digits).  Their randomness
is each agent's own keyed stream (:data:`~decentdp.rng.Stream.AUGMENTATION`): a run is
reproducible, and an agent's copies do not depend on which other agents share its process.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from decentdp.rng import AgentRandom, Stream

KINDS: tuple[str, ...] = ("none", "shift", "shift-flip")
"""``augmentation.kind``: no augmentation, random translations, or translations and horizontal flips."""


@dataclass(frozen=True)
class Augmentation:
    """``copies`` augmented copies of every sampled image, translated by up to ``shift`` pixels (and
    flipped left-right with probability 1/2 when ``flip``)."""

    copies: int
    shift: int
    flip: bool

    @property
    def draws_per_copy(self) -> int:
        """Uniforms one copy uses: a row offset, a column offset, and a flip when ``flip``."""
        return 3 if self.flip else 2

    def expand(self, x: torch.Tensor, y: torch.Tensor, rng: AgentRandom, owners: Sequence[int], round_index: int,
               step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(N, B, C, H, W)`` images and ``(N, B, ...)`` targets as ``(N, B * K, ...)``: each sample's ``K``
        augmented copies in consecutive rows, row ``n`` drawn from agent ``owners[n]``'s stream for batch
        ``step`` of round ``round_index``."""
        n_agents, batch = x.shape[:2]
        uniforms = rng.normal(list(owners), batch * self.copies * self.draws_per_copy, round_index,
                              Stream.AUGMENTATION, step, uniform=True)
        uniforms = uniforms.to(x.device).view(n_agents * batch * self.copies, self.draws_per_copy)
        images = x.repeat_interleave(self.copies, dim=1).reshape(-1, *x.shape[2:])
        images = translate(images, uniforms[:, :2], self.shift)
        if self.flip:
            images = torch.where((uniforms[:, 2] < 0.5).view(-1, 1, 1, 1), images.flip(-1), images)
        return (images.view(n_agents, batch * self.copies, *x.shape[2:]),
                y.repeat_interleave(self.copies, dim=1))


def translate(images: torch.Tensor, uniforms: torch.Tensor, shift: int) -> torch.Tensor:
    """Each image of ``(M, C, H, W)`` moved by ``(dy, dx)`` pixels, each uniform in ``[-shift, shift]``
    (from ``uniforms``, ``(M, 2)`` in ``[0, 1)``): reflection-padded by ``shift``, then cropped back."""
    if shift == 0:
        return images
    m, _, height, width = images.shape
    offsets = (uniforms * (2 * shift + 1)).long().clamp_(max=2 * shift)  # (M, 2), uniform on 0..2*shift
    padded = F.pad(images, (shift, shift, shift, shift), mode="reflect")
    rows = offsets[:, 0, None] + torch.arange(height, device=images.device)  # (M, H)
    cols = offsets[:, 1, None] + torch.arange(width, device=images.device)   # (M, W)
    index = torch.arange(m, device=images.device)[:, None, None]
    cropped = padded.permute(0, 2, 3, 1)[index, rows[:, :, None], cols[:, None, :]]  # (M, H, W, C)
    return cropped.permute(0, 3, 1, 2).contiguous()
