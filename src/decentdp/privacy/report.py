"""A run's privacy report: every epsilon it prints, the observer each one names, and what it assumes.

One place builds ``privacy.json``'s privacy content for every kind of run (:func:`privacy_report`) and the
statement of what the epsilons mean (:func:`privacy_statement`): the neighbouring relation, whether the
noise is secret, and whether the metrics a run logs are computed from private records.  The run
writers only add their files around it; no writer branches on an algorithm or a ledger class.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from decentdp.privacy.ledger import PrivacyLedger
from decentdp.results.files import epsilon_json
from decentdp.rng import SIMULATION_NOTICE

NEIGHBOURING_ASSUMPTIONS = {
    "add-remove": "neighbouring datasets differ by adding or removing one record of one agent; the run publishes "
                  "each agent's dataset size |D_i| (setup.json's agent_sizes, on which a Poisson sample rate "
                  "q_i = L/|D_i| depends), so this assumes dataset sizes are not secret (the DP-SGD papers' relation; "
                  "use replace-one when sizes must be covered)",
    "replace-one": "neighbouring datasets differ by replacing one record of one agent (sizes public, as the run "
                   "publishes them); about twice the epsilon of add-remove for the same noise",
}

#: What the per-receiver composition of a run's per-receiver messages assumes (``paper_epsilon_per_receiver``).
PER_RECEIVER_VIEW = ("each receiver's messages composed alone, as if it knew no noise it was not sent and never saw "
                     "another copy of the same sum (TOP-DP's view (a), eq. 5a): the papers' argument, below the "
                     "truth when messages share or reuse noise; reported, never enforced")

#: What every ``epsilon`` budgets hold on names: the observer who sees all of an agent's messages.
AGENT_VIEW = ("everyone together: every message of the agent, every other agent's noise and data known; each batch's "
              "noisy copies priced as one joint release, rounds composed with Poisson amplification where the "
              "ledger's events are sampled ones (an algorithm that prices its releases unsampled, as Li18 does, "
              "takes none; privacy.json's ledger lists each event)")

#: What every ``epsilon`` budgets hold on names under cyclic participation (``data.sampling = 'cyclic'``).
CYCLIC_AGENT_VIEW = ("everyone together: every message of the agent, every other agent's noise and data known; each "
                     "agent charged once per pass over its b fixed batches (a record is in one batch, so in "
                     "ceil(T / b) rounds at most), every release unsampled: no amplification")

#: Said by a run whose metrics are measured on records held out of the agents' private data.
PRIVATE_EVALUATION_NOTICE = ("data.validation_fraction > 0: the metrics are measured on records held out of the "
                             "agents' private training data, not on the public test set; they are not DP releases, "
                             "so choosing settings by them (a sweep without selection = 'private') spends privacy "
                             "that no epsilon here counts")


def privacy_statement(private: bool, relation: str, noise: str, private_evaluation: bool = False) -> dict[str, Any]:
    """What a run's epsilons mean: the neighbouring relation and its assumption, the noise mode and, where it
    applies, that the noise is recomputable and that the metrics read private records."""
    statement: dict[str, Any] = {
        "private": private,
        "neighbouring": relation,
        "neighbouring_assumption": NEIGHBOURING_ASSUMPTIONS[relation],
        "noise": noise,
        "evaluation_records": "private (held out of training)" if private_evaluation else "public",
    }
    if noise == "simulation" and private:
        statement["noise_notice"] = SIMULATION_NOTICE
    if private_evaluation:
        statement["evaluation_notice"] = PRIVATE_EVALUATION_NOTICE
    return statement


@dataclass(frozen=True)
class AlgorithmPrivacy:
    """An algorithm's own privacy results of a finished run, beyond its ledger's
    (:meth:`~decentdp.algorithms.base.Algorithm.privacy_results`).

    ``report``: entries for ``privacy.json``, in order (each epsilon named with the observer it is about);
    ``headline``: the names of those that ``summary.json`` repeats (a run's one-line figures, such as the
    largest pairwise epsilon); ``pairwise``: each sender's epsilon (rows) towards each single agent
    (columns), drawn as ``pairwise_epsilon.png``."""

    report: dict[str, Any] = field(default_factory=dict)
    headline: tuple[str, ...] = ()
    pairwise: np.ndarray | None = None

    def summary(self) -> dict[str, Any]:
        """The headline entries, in the report's order."""
        return {key: value for key, value in self.report.items() if key in self.headline}


def privacy_report(ledger: PrivacyLedger, delta: float, statement: dict[str, Any],
                   paper_accounting: dict[str, Any] | None = None, extras: AlgorithmPrivacy | None = None,
                   observer: str = AGENT_VIEW) -> dict[str, Any]:
    """``privacy.json``'s content: each agent's epsilon on the view budgets hold on (and by RDP), the charges its
    ledger took and refused (``releases``: one per release, one per pass under cyclic sampling, one for a
    prepaid mechanism's whole run), the ledger, the statement; the per-receiver composition when messages went
    to single receivers (a paper's view, labelled); an algorithm's own results (``extras``, e.g. Muffliato's
    pairwise network DP) and the paper's own accounting, labelled; ``observer`` names who the budgets' epsilon
    is about (every observer together unless the run's mechanism was calibrated for a narrower view, e.g.
    DECOR's)."""
    epsilons, accountant = ledger.reported_epsilon()
    report: dict[str, Any] = {
        "delta": delta,
        "epsilon": epsilon_json(epsilons),
        "epsilon_accountant": accountant,
        "epsilon_observer": observer,
        **statement,
        "releases": ledger.releases().tolist(),
        "refused_releases": ledger.refused.tolist(),
        "ledger": ledger.state_dict(),
    }
    if ledger.relation == "add-remove":  # RDP has no replace-one bound for sampled releases
        report["epsilon_rdp"] = epsilon_json(ledger.epsilon("rdp"))
    if ledger.has_receiver_releases:
        if ledger.relation == "add-remove":
            report["paper_epsilon_pairwise_rdp"] = epsilon_json(ledger.pairwise_epsilon("rdp"))
        report["paper_epsilon_per_receiver"] = epsilon_json(ledger.pairwise_epsilon(accountant).max(axis=1))
        report["paper_epsilon_per_receiver_view"] = PER_RECEIVER_VIEW
    if paper_accounting is not None:
        report["paper_accounting"] = paper_accounting
    report.update(extras.report if extras is not None else {})
    return report
