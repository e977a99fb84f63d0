"""Gradient inversion against what an agent sends (the DPDL paper's Sec. VI-D), scored by MSE, PSNR and SSIM.

An eavesdropper holds one released message of an agent: the gradient of a model at a known point
``theta`` on a batch of the agent's records (its own model: a gradient; a neighbour's model: a
cross-gradient, the DPDL paper's ND-CG / DPDL-CG), or the difference of the momenta the agent
broadcasts in two consecutive rounds (ND-MM / DPDL-MM, :func:`momentum_difference`).  Without DP the
gradient is the mean gradient; with DP it is the library's release, ``(sum_b clip_C(grad l_b) + sigma
C xi) / B`` with sigma calibrated for the config's epsilon over its planned releases.  Attacks optimise
a dummy batch whose gradient matches the message:

* **DLG** (Zhu et al. 2019): squared distance of gradients, dummy images and soft labels, L-BFGS;
* **iDLG** (Zhao et al. 2020): the label read from the sign of the last layer's bias gradient (one
  image), then DLG on the images alone;
* **Geiping et al. 2020** ("Inverting Gradients"): ``1 - cos(grad, message) + alpha TV(x)``, Adam on
  signed gradients, images boxed to the data range, labels known (iDLG's rule for one image).

Scores compare each reconstruction with its original in pixel space [0, 1] (optimal matching for
batches) using scikit-image's ``mean_squared_error``, ``peak_signal_noise_ratio`` and
``structural_similarity``.  scikit-image is the ``audit`` extra, imported only here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from decentdp.algorithms import algorithm_class
from decentdp.audit.settings import AuditSection
from decentdp.config import ExperimentConfig
from decentdp.data.datasets import Dataset, load_dataset
from decentdp.errors import ConfigError
from decentdp.experiment.build import build_experiment, calibrate, config_topology, planned_releases, sums_per_batch
from decentdp.gradients.flat_model import FlatModel
from decentdp.gradients.stacked_model import gradient_model
from decentdp.models import build_model, classification_loss
from decentdp.privacy.mechanisms import GaussianMechanism, NoiseDraw
from decentdp.rng import AgentRandom


@dataclass(frozen=True)
class Reconstruction:
    """Dummy images (``(B, C, H, W)``, the data's normalised space) and how well their gradient matched."""

    images: torch.Tensor
    labels: torch.Tensor
    objective: float


def _gradient(model: FlatModel, theta: torch.Tensor, x: torch.Tensor, targets: torch.Tensor,
              create_graph: bool) -> torch.Tensor:
    """The mean loss gradient at ``theta`` on ``x``; ``targets`` are labels or, as floats, soft labels."""
    logits = model.forward(theta, x)
    if targets.is_floating_point():
        loss = torch.sum(-targets * F.log_softmax(logits, dim=-1), dim=-1).mean()
    else:
        loss = F.cross_entropy(logits, targets)
    (grad,) = torch.autograd.grad(loss, theta, create_graph=create_graph)
    return grad


def released_message(model: FlatModel, theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
                     mechanism: GaussianMechanism | None, seed: int, round_index: int = 0) -> torch.Tensor:
    """The message an agent sends for the batch ``x, y`` at ``theta``: the mean gradient (no mechanism), or
    the clipped sum plus the mechanism's noise (drawn from the run's keyed streams, keyed by
    ``round_index``) over the batch size."""
    if mechanism is None:
        return model.batch_gradients(theta[None], x[None], y[None],
                                     torch.full((1, len(x)), 1.0 / len(x), device=x.device))[0]
    sums, _ = model.clipped_gradient_sums(theta[None], x[None], y[None], torch.ones(1, len(x), device=x.device),
                                          mechanism.sensitivity)
    owners = torch.zeros(1, dtype=torch.long, device=x.device)
    mechanism.perturb(sums, owners, NoiseDraw(AgentRandom(seed, device=x.device), owners, round_index, 0))
    return sums[0] / len(x)


def momentum_difference(model: FlatModel, theta: torch.Tensor,
                        batches: Sequence[tuple[torch.Tensor, torch.Tensor]], mechanism: GaussianMechanism | None,
                        seed: int, beta: float, lr: float,
                        velocity: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x^t, v^{t+1} - v^t)`` with ``t = len(batches) - 1``: the DPDL paper's ND-MM / DPDL-MM message.

    From ``x^0 = theta`` and ``v^0 = velocity`` (zero unless given: a trained run's momentum) the agent takes a
    momentum step per round ``s`` on its batch ``batches[s - 1]`` (records drawn afresh each round; the last batch
    is the attacked one), each on
    its release ``g^s`` at ``x^{s-1}`` (the mean gradient, or the DP release of
    :func:`released_message`, fresh noise each round), and broadcasts ``(x^s, v^s)``::

        v^s = beta v^{s-1} + g^s          (DPDL eq. 19)
        x^s = x^{s-1} - lr v^s            (DPDL eq. 20)

    The eavesdropper differences two consecutive momenta, ``v^{t+1} - v^t = g^{t+1} - (1 - beta) v^t``:
    the last batch's gradient at the broadcast ``x^t`` plus a share of the earlier batches' gradients,
    and inverts it at ``x^t``.  Mixing with neighbours' momenta (eqs. 21-22) is left out: it only adds
    terms that an eavesdropper on one agent does not know.  (An attacker who knew ``beta`` and ``v^t``
    exactly could take ``v^{t+1} - beta v^t = g^{t+1}``, the "gradient" release; the paper's attack is
    the difference.)
    """
    if len(batches) < 2:
        raise ValueError(f"the momentum difference needs a batch for each of rounds 1..t+1, t >= 1; got "
                         f"{len(batches)} batch(es)")
    params = theta.detach()
    velocity = torch.zeros_like(theta) if velocity is None else velocity.detach()
    for step, (x, y) in enumerate(batches, start=1):
        previous = velocity
        velocity = beta * velocity + released_message(model, params, x, y, mechanism, seed, round_index=step)
        if step == len(batches):
            break
        params = params - lr * velocity
    return params, velocity - previous


def label_from_bias(message: torch.Tensor, classes: int) -> int:
    """iDLG: with softmax cross-entropy, the last layer's bias gradient ``p - onehot(y)`` is negative only at y."""
    return int(torch.argmin(message[-classes:]))


def total_variation(x: torch.Tensor) -> torch.Tensor:
    """Mean absolute difference of neighbouring pixels (the image prior of Geiping et al.)."""
    return (x[..., 1:, :] - x[..., :-1, :]).abs().mean() + (x[..., :, 1:] - x[..., :, :-1]).abs().mean()


def _cosine_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return 1.0 - F.cosine_similarity(a, b, dim=0, eps=1e-12)


def invert(model: FlatModel, theta: torch.Tensor, message: torch.Tensor, shape: tuple[int, ...], classes: int,
           attack: str, iterations: int, lr: float, tv_weight: float, box: tuple[float, float],
           generator: torch.Generator, labels: torch.Tensor | None = None) -> Reconstruction:
    """One reconstruction of a batch of ``shape[0]`` images from ``message``, from a random start.

    ``labels`` are used as known by the Geiping attack (default: iDLG's rule, one image only)."""
    theta = theta.detach().clone().requires_grad_(True)
    batch = shape[0]
    dummy = torch.randn(shape, generator=generator, device=theta.device).requires_grad_(True)
    if attack == "dlg":
        soft = torch.randn(batch, classes, generator=generator, device=theta.device).requires_grad_(True)
        return _lbfgs(model, theta, message, dummy, [dummy, soft], lambda: soft.softmax(dim=-1), iterations, lr)
    if labels is None:
        if batch != 1:
            raise ValueError("labels of a batch cannot be read from the bias gradient; pass them")
        labels = torch.tensor([label_from_bias(message, classes)], device=theta.device)
    if attack == "idlg":
        return _lbfgs(model, theta, message, dummy, [dummy], lambda: labels, iterations, lr)
    return _geiping(model, theta, message, dummy, labels, iterations, lr, tv_weight, box)


def _lbfgs(model: FlatModel, theta: torch.Tensor, message: torch.Tensor, dummy: torch.Tensor,
           variables: list[torch.Tensor], targets: Callable[[], torch.Tensor], iterations: int,
           lr: float) -> Reconstruction:
    """DLG / iDLG: minimise the squared gradient distance with L-BFGS."""
    optimizer = torch.optim.LBFGS(variables, lr=lr, max_iter=iterations, history_size=50,
                                  line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        distance = (_gradient(model, theta, dummy, targets(), True) - message).pow(2).sum()
        distance.backward()
        return distance

    optimizer.step(closure)
    with torch.enable_grad():
        final = (_gradient(model, theta, dummy, targets(), False) - message).pow(2).sum()
    labels = targets()
    return Reconstruction(dummy.detach(), labels.argmax(-1) if labels.is_floating_point() else labels, float(final))


def _geiping(model: FlatModel, theta: torch.Tensor, message: torch.Tensor, dummy: torch.Tensor,
             labels: torch.Tensor, iterations: int, lr: float, tv_weight: float,
             box: tuple[float, float]) -> Reconstruction:
    """Geiping et al.: cosine distance plus TV, Adam on the gradient's sign, step decay, boxed images."""
    optimizer = torch.optim.Adam([dummy], lr=lr)
    milestones = [int(iterations * share) for share in (3 / 8, 5 / 8, 7 / 8)]
    schedule = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=milestones, gamma=0.1)
    for _ in range(iterations):
        optimizer.zero_grad()
        objective = _cosine_distance(_gradient(model, theta, dummy, labels, True), message) + \
            tv_weight * total_variation(dummy)
        objective.backward()
        dummy.grad.sign_()
        optimizer.step()
        schedule.step()
        with torch.no_grad():
            dummy.clamp_(*box)
    with torch.enable_grad():
        final = _cosine_distance(_gradient(model, theta, dummy, labels, False), message)
    return Reconstruction(dummy.detach(), labels, float(final))


def best_of(restarts: int, attempt: Callable[[int], Reconstruction]) -> Reconstruction:
    """The reconstruction with the smallest gradient-matching objective over ``restarts`` random starts."""
    tries = [attempt(index) for index in range(restarts)]
    return min(tries, key=lambda item: item.objective if math.isfinite(item.objective) else math.inf)


# -- scores -------------------------------------------------------------------------------------------------

def to_pixels(x: torch.Tensor, box: tuple[float, float]) -> np.ndarray:
    """Normalised images ``(B, C, H, W)`` as ``(B, H, W, C)`` float64 pixels in [0, 1]."""
    low, high = box
    return ((x.detach().double().clamp(low, high) - low) / (high - low)).permute(0, 2, 3, 1).cpu().numpy()


def image_scores(original: np.ndarray, reconstruction: np.ndarray) -> dict[str, float]:
    """MSE, PSNR and SSIM (scikit-image, data range 1) of one ``(H, W, C)`` image pair in [0, 1]."""
    from skimage.metrics import mean_squared_error, peak_signal_noise_ratio, structural_similarity

    side = min(original.shape[:2])
    window = min(7, side if side % 2 else side - 1)
    mse = float(mean_squared_error(original, reconstruction))
    return {"mse": mse,
            "psnr": float(peak_signal_noise_ratio(original, reconstruction, data_range=1.0)) if mse > 0 else math.inf,
            "ssim": float(structural_similarity(original, reconstruction, data_range=1.0, channel_axis=-1,
                                                win_size=window))}


def matched_scores(originals: np.ndarray, reconstructions: np.ndarray) -> list[dict[str, float]]:
    """Scores of each original against the reconstruction an optimal matching (least total MSE) assigns it:
    a batch's gradient does not say which dummy image stands for which record."""
    from scipy.optimize import linear_sum_assignment

    cost = ((originals[:, None] - reconstructions[None]) ** 2).mean(axis=(2, 3, 4))
    rows, cols = linear_sum_assignment(cost)
    return [image_scores(originals[r], reconstructions[c]) for r, c in zip(rows, cols, strict=True)]


# -- the experiment -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class InversionOutcome:
    """Per-image scores (rows of the CSV), the summary, and the images of the figure."""

    rows: list[dict[str, float]]
    summary: dict[str, float | str | None]
    figure: list[tuple[str, np.ndarray]]   # (row label, (n, H, W, C) pixels) for the first batch size


@dataclass(frozen=True)
class Scene:
    """Where the attacks of one (batch size, epsilon) happen: the sender's records (in order; batch ``k`` is
    records ``k B .. (k + 1) B - 1``, earlier momentum rounds' batches come from the end), the model the attacked
    message is computed at (momentum: ``x^0``), the sender's momentum before it, and its release mechanism."""

    records: torch.Tensor
    theta: torch.Tensor
    velocity: torch.Tensor | None
    mechanism: GaussianMechanism | None


def standalone_scene(config: ExperimentConfig, audit: AuditSection, dataset: Dataset, model: FlatModel,
                     batch: int, epsilon: float) -> Scene:
    """``audit.trained_rounds = 0``: the model's initial parameters (a neighbour's, seeded ``seed + 1``, for a
    cross-gradient or a momentum difference), the whole training set as the sender's records, sigma calibrated as a
    run would for this batch (rate ``B / |D_i|`` with equal agents, the config's planned releases, and the sums
    agent 0 releases per batch on the config's graph: DPDL's and DP-CGA's ``deg + 1``, calibrated jointly)."""
    seed = config.experiment.seed
    theta = model.initial_parameters() if audit.release == "gradient" else torch.cat(
        [p.detach().reshape(-1) for p in build_model(config.model.name, dataset.input_shape, dataset.num_classes,
                                                     seed=seed + 1, **config.model.options).parameters()])
    mechanism = None
    if not math.isinf(epsilon):
        algorithm = algorithm_class(config.algorithm.name).from_settings(config.algorithm.settings)
        rate = min(1.0, batch / (len(dataset.y_train) // config.topology.agents))
        sums = sums_per_batch(config, algorithm, config_topology(config, seed))[:1]
        sigma = calibrate([epsilon], [rate], config, planned_releases(config, algorithm), sums,
                          algorithm.joint_accounting)
        mechanism = GaussianMechanism(torch.tensor(sigma, dtype=torch.float32), config.privacy.clip)
    return Scene(torch.arange(len(dataset.y_train)), theta, None, mechanism)


def trained_scene(config: ExperimentConfig, audit: AuditSection, data_dir: str | Path | None, batch: int,
                  epsilon: float) -> Scene:
    """``audit.trained_rounds = T > 0``: round ``T + 1`` of the config's own run at expected batch ``B`` and this
    epsilon (no noise and no clipping without DP: the paper's ND rows), trained ``T`` rounds by the simulator.  The
    sender is agent 0 and its records are its own partition; a cross-gradient is computed at its first neighbour's
    model, a gradient or momentum at its own (with its momentum, where the algorithm keeps one); the noise is the
    run's per-message multiplier of agent 0 (for DPDL the joint calibration of its ``deg + 1`` sums).  The run
    trains on ``engine.device``; the scene comes back to the host, where the attack runs beside the loaded data."""
    run = config.model_copy(update={
        "algorithm": config.algorithm.model_copy(update={"batch_size": batch}),
        "privacy": config.privacy.model_copy(update={"epsilon": epsilon, "agent_epsilons": None})})
    experiment = build_experiment(run, data_dir)
    simulator = experiment.simulator
    state = simulator.run(simulator.setup(experiment.initial_state()), 0, audit.trained_rounds, lambda _k, _s: True)
    sender = 0
    neighbours = np.flatnonzero(experiment.topology.adjacency()[sender])
    if audit.release == "cross-gradient" and len(neighbours) == 0:
        raise ConfigError("audit.release", "a cross-gradient goes to a neighbour, and agent 0 has none")
    at = int(neighbours[0]) if audit.release == "cross-gradient" else sender
    velocity = state["momentum"][sender] if audit.release == "momentum-difference" and "momentum" in state else None
    mechanism = None if math.isinf(epsilon) else GaussianMechanism(
        experiment.noise_multipliers[sender:sender + 1].float().cpu(), config.privacy.clip)
    return Scene(experiment.data.indices[sender].cpu(), state["params"][at].cpu(),
                 None if velocity is None else velocity.cpu(), mechanism)


def run_inversion(config: ExperimentConfig, audit: AuditSection, data_dir: str | Path | None = None
                  ) -> InversionOutcome:
    """Attack the config's agent messages at every (batch size, epsilon): non-private first, then each of
    ``audit.epsilons`` (:func:`standalone_scene`, or :func:`trained_scene` inside the config's own run)."""
    dataset = load_dataset(config.data.dataset, data_dir if data_dir is not None else config.data.data_dir,
                           image_size=config.data.image_size)
    seed = config.experiment.seed
    module = build_model(config.model.name, dataset.input_shape, dataset.num_classes, seed=seed,
                         **config.model.options)
    model = gradient_model(module, classification_loss, config.engine.gradients)
    box = (float(dataset.x_train.min()), float(dataset.x_train.max()))
    rows: list[dict[str, float]] = []
    figure: list[tuple[str, np.ndarray]] = []
    for batch in audit.batch_sizes:
        for epsilon in [math.inf, *audit.epsilons]:
            scene = (trained_scene(config, audit, data_dir, batch, epsilon) if audit.trained_rounds > 0
                     else standalone_scene(config, audit, dataset, model, batch, epsilon))
            shown: list[np.ndarray] = []
            originals_shown: list[np.ndarray] = []
            for image in range(audit.images):
                x, y = _records(dataset, scene.records, image * batch, batch)
                if audit.release == "momentum-difference":  # earlier rounds: other records, from the end
                    earlier = [_records(dataset, scene.records,
                                        len(scene.records) - (image * audit.momentum_round + s + 1) * batch, batch,
                                        "audit.momentum_round") for s in range(audit.momentum_round)]
                    point, message = momentum_difference(model, scene.theta, [*earlier, (x, y)], scene.mechanism,
                                                         seed + image, audit.momentum, config.algorithm.lr,
                                                         scene.velocity)
                else:
                    point, message = scene.theta, released_message(model, scene.theta, x, y, scene.mechanism,
                                                                   seed + image)
                known = None if batch == 1 else y

                def attempt(restart: int, message: torch.Tensor = message, known: torch.Tensor | None = known,
                            shape: tuple[int, ...] = tuple(x.shape), image: int = image,
                            point: torch.Tensor = point) -> Reconstruction:
                    generator = torch.Generator().manual_seed(seed * 100_003 + image * 101 + restart)
                    return invert(model, point, message, shape, dataset.num_classes, audit.attack, audit.iterations,
                                  audit.attack_lr, audit.tv_weight, box, generator, known)

                found = best_of(audit.restarts, attempt)
                pixels = to_pixels(found.images, box)
                originals = to_pixels(x, box)
                for scores in matched_scores(originals, pixels):
                    rows.append({"batch_size": batch, "epsilon": epsilon, "image": image, **scores})
                if batch == audit.batch_sizes[0]:
                    shown.append(pixels)
                    if math.isinf(epsilon):
                        originals_shown.append(originals)
            if batch == audit.batch_sizes[0]:
                if math.isinf(epsilon):
                    figure.append(("original", np.concatenate(originals_shown)))
                figure.append(("no DP" if math.isinf(epsilon) else f"eps = {epsilon:g}", np.concatenate(shown)))
    return InversionOutcome(rows, _summary(rows, audit), figure)


def _records(dataset: Dataset, records: torch.Tensor, start: int, count: int,
             field: str = "audit.images") -> tuple[torch.Tensor, torch.Tensor]:
    """The sender's records ``start .. start + count - 1`` (positions in ``records``); when it holds too few, a
    clear error naming ``field``, the setting that asked for them."""
    if start < 0 or start + count > len(records):
        raise ConfigError(field, f"the attacked batches and the momentum rounds' earlier batches need more than the "
                                 f"sender's {len(records)} training records")
    chosen = records[start:start + count]
    return dataset.x_train[chosen], dataset.y_train[chosen]


def _summary(rows: list[dict[str, float]], audit: AuditSection) -> dict[str, float | str | None]:
    """Mean scores without DP and at ``audit.epsilons[0]`` (over batch sizes and images), plus per epsilon."""
    def mean(key: str, epsilon: float) -> float:
        return float(np.mean([row[key] for row in rows if row["epsilon"] == epsilon]))

    summary: dict[str, float | str | None] = {"attack": audit.attack, "release": audit.release,
                                              "trained_rounds": audit.trained_rounds,
                                              "epsilon_private": audit.epsilons[0]}
    for key in ("ssim", "psnr", "mse"):
        summary[f"{key}_nonprivate"] = mean(key, math.inf)
        summary[f"{key}_private"] = mean(key, audit.epsilons[0])
        for epsilon in audit.epsilons[1:]:
            summary[f"{key}_eps{epsilon:g}"] = mean(key, epsilon)
    return summary


def save_figure(figure: list[tuple[str, np.ndarray]], path: Path, title: str) -> None:
    """Originals beside reconstructions, one row per release (matplotlib, written atomically by the caller)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = max(len(images) for _, images in figure)
    fig, axes = plt.subplots(len(figure), columns, figsize=(1.3 * columns + 1.2, 1.4 * len(figure)), squeeze=False)
    for row, (label, images) in enumerate(figure):
        for column in range(columns):
            axis = axes[row][column]
            axis.set_xticks([])
            axis.set_yticks([])
            if column < len(images):
                image = images[column]
                axis.imshow(image[..., 0] if image.shape[-1] == 1 else image, cmap="gray", vmin=0.0, vmax=1.0)
            if column == 0:
                axis.set_ylabel(label, fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
