"""Stage 2: per-option lattice parameters for each tree type, vectorised over the portfolio.

Tree types are small policy objects (as in QuantLib): they turn an option's market data and N into
the numbers every engine consumes — log up/down factors and discounted branch probabilities. The
engines never see the tree type, so a new tree needs no new kernel.

Node (t, i) (t steps taken, i of them up) has asset price S0 * exp(t*log_down + i*(log_up - log_down)).
Backward step: V(t, i) = pu * V(t+1, i+1) + pd * V(t+1, i), with pu = disc*p, pd = disc*(1-p);
American options take max(hold, exercise) at every node, t = 0 included.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pricer.errors import InputError, first_ids


@dataclass
class LatticeParams:
    """Everything an engine needs per option (struct of arrays, float64 unless noted)."""

    spot: np.ndarray
    strike: np.ndarray
    steps: np.ndarray      # int64
    call: np.ndarray       # bool
    american: np.ndarray   # bool
    log_up: np.ndarray
    log_down: np.ndarray
    pu: np.ndarray         # discounted up probability, disc * p
    pd: np.ndarray         # discounted down probability, disc * (1 - p)

    def __len__(self) -> int:
        return int(self.spot.shape[0])

    def take(self, index) -> "LatticeParams":
        return LatticeParams(**{k: v[index] for k, v in self.__dict__.items()})


class CoxRossRubinstein:
    """The textbook CRR tree: u = exp(sigma*sqrt(dt)), d = 1/u, p = (exp((r-q)dt) - d)/(u - d)."""

    name = "crr"

    def probabilities(self, cols: dict):
        dt = cols["maturity"] / cols["steps"]
        log_up = cols["volatility"] * np.sqrt(dt)
        log_down = -log_up
        growth = np.exp((cols["rate"] - cols["dividend"]) * dt)
        up, down = np.exp(log_up), np.exp(log_down)
        p = (growth - down) / (up - down)
        return dt, log_up, log_down, p


TREES = {tree.name: tree for tree in (CoxRossRubinstein(),)}


def tree_named(name: str):
    try:
        return TREES[name]
    except KeyError:
        raise InputError(f"unknown tree {name!r}; known trees: {', '.join(TREES)}") from None


def lattice_parameters(cols: dict, tree: str = "crr", ids: np.ndarray | None = None) -> LatticeParams:
    """Per-option parameters; options whose p is not in (0, 1) are rejected by id, never priced."""
    dt, log_up, log_down, p = tree_named(tree).probabilities(cols)
    bad = ~((p > 0.0) & (p < 1.0))
    if bad.any():
        who = first_ids(ids if ids is not None else np.arange(p.size), bad)
        first = int(np.flatnonzero(bad)[0])
        raise InputError(
            f"the {tree} lattice is not arbitrage-free for option id(s) {who}: "
            f"p = {float(p[first])!r} is outside (0, 1) (rate {float(cols['rate'][first])!r}, "
            f"dividend {float(cols['dividend'][first])!r}, volatility "
            f"{float(cols['volatility'][first])!r}, "
            f"steps {int(cols['steps'][first])}); use more steps or check the inputs")
    disc = np.exp(-cols["rate"] * dt)
    return LatticeParams(
        spot=np.ascontiguousarray(cols["spot"], dtype=np.float64),
        strike=np.ascontiguousarray(cols["strike"], dtype=np.float64),
        steps=np.ascontiguousarray(cols["steps"], dtype=np.int64),
        call=np.ascontiguousarray(cols["call"], dtype=np.bool_),
        american=np.ascontiguousarray(cols["american"], dtype=np.bool_),
        log_up=np.ascontiguousarray(log_up),
        log_down=np.ascontiguousarray(log_down),
        pu=disc * p,
        pd=disc * (1.0 - p),
    )
