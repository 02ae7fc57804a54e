"""Which options of a book can be priced, and why not: the status of each option under
`--invalid skip` (pricing.invalid = "skip"; pricer.price(..., invalid="skip")).

The reasons are the value checks a run refuses the whole book for by default (docs/formats.md,
"Validation"), option by option: first the value rules, pricer/model/option_rules.py's table (the
one the refusal follows too: a row's status is the code of the first rule it breaks), then its
lattice's and those of the extra lattices --greeks/--richardson price. Structural faults (a
missing column, a wrong dtype, duplicate ids, an unreadable file) refuse the whole book in
either mode. The rank that checks a row computes its status (rank 0 for the whole book, or every
rank for its own rows with --distribute read), the same function on the same values.
"""

from __future__ import annotations

import numpy as np

from pricer.model import option_rules
from pricer.model.greeks import Analytics, unsupported
from pricer.model.lattice import TREE_NAMES, TREES, lattice_faults, tree_named
from pricer.model.option_rules import (BAD_STEPS, IMPLIED, NOT_FINITE, NOT_POSITIVE,  # noqa: F401
                                       PRICE, PRICED, UNKNOWN_TREE, UNKNOWN_TREE_CODE)

# the value rules' codes are option_rules' (imported above, named here too); the lattices' after
# them (results files carry them)
NO_LATTICE, NO_ANALYTICS = 5, 6
REASONS = {
    PRICED: "priced",
    **option_rules.REASONS,
    NO_LATTICE: "its lattice cannot be priced: p outside (0, 1), d >= u, fewer steps than its "
                "tree needs, or node prices beyond FP64's range where its paths carry weight "
                "(for implied volatilities: fewer steps than its tree needs)",
    NO_ANALYTICS: "--greeks, --richardson or a scenario cannot be computed for it: too few steps, "
                  "a volatility not above the bump, or a bumped, coarse or scenario lattice that "
                  "cannot be priced",
}


def statuses(cols: dict, tree: str, analytics: Analytics, max_steps: int) -> np.ndarray:
    """Each option's status (int8): PRICED, or the first reason it cannot be priced: the first
    value rule it breaks (option_rules.statuses), else its lattice's faults."""
    status = option_rules.statuses(cols, IMPLIED if analytics.implied else PRICE, max_steps)
    steps = np.asarray(cols["steps"])
    rows = np.flatnonzero(status == PRICED)     # the later checks only where the values are sane
    if rows.size and analytics.implied:   # a lattice exists at some volatility: steps enough
        status[(status == PRICED) & (steps < min_steps(cols, tree))] = NO_LATTICE
    elif rows.size:
        part = {key: np.asarray(value)[rows] for key, value in cols.items()}
        no_lattice = lattice_faults(part, tree)
        status[rows[no_lattice]] = NO_LATTICE
        keep = ~no_lattice
        rows, part = rows[keep], {key: value[keep] for key, value in part.items()}
        if rows.size and (analytics.greeks or analytics.richardson or analytics.scenarios):
            status[rows[analytics_faults(part, tree, analytics)]] = NO_ANALYTICS
    return status


def min_steps(cols: dict, tree: str) -> np.ndarray:
    """Per option, the fewest steps its tree takes (the tree column's, else the run's `tree`)."""
    n = int(np.shape(cols["steps"])[0])
    least = np.array([TREES[name].min_steps for name in TREE_NAMES])
    default = TREE_NAMES.index(tree_named(tree).name)
    codes = np.asarray(cols.get("tree", np.full(n, -1)), dtype=np.int64)
    return least[np.where(codes < 0, default, codes)]


def analytics_faults(cols: dict, tree: str, analytics: Analytics) -> np.ndarray:
    """Per option, whether the Greeks or Richardson it asks for cannot be computed: greeks.check's
    rules (greeks.unsupported), and the extra lattices they price (bumped, coarse) must exist."""
    faulty = np.zeros(np.shape(cols["steps"])[0], dtype=bool)
    for mask, _, _ in unsupported(cols, analytics):
        faulty |= mask
    ok = np.flatnonzero(~faulty)
    sub = {key: np.asarray(value)[ok] for key, value in cols.items()}
    for _, part in analytics.described_lattices(sub)[1:]:
        faulty[ok[lattice_faults(part, tree)]] = True
    return faulty


def reasons_text(status: np.ndarray, reasons: dict = REASONS) -> str:
    """'1 with status 3: a value is NaN ...; ...': the skipped rows by reason (`reasons`: the
    family's codes, these of options by default)."""
    codes, counts = np.unique(status[status != PRICED], return_counts=True)
    return "; ".join(f"{count} with status {code}: {reasons[int(code)]}"
                     for code, count in zip(codes, counts))
