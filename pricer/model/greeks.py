"""Sensitivities and Richardson extrapolation around any engine.

- Delta, gamma, theta come from the lattice's first levels, as QuantLib's BinomialVanillaEngine
  computes them (Hull, 6th ed., pp. 397-398): the engines keep V(1, .) and V(2, .) while they price
  (`levels`), so no second pricing pass is needed:
      delta = (V(1,1) - V(1,0)) / (S(1,1) - S(1,0))
      gamma = [(V(2,2) - V(2,1)) / (S(2,2) - S(2,1)) - (V(2,1) - V(2,0)) / (S(2,1) - S(2,0))]
              / ((S(2,2) - S(2,0)) / 2)
      theta = r V - (r - q) S0 delta - sigma^2 S0^2 gamma / 2        (QuantLib's blackScholesTheta)
  with S(t, i) = S0 exp(t log_down + i (log_up - log_down)), the lattice's own node prices. Theta is
  per year. Options with fewer than 2 steps have no second level: Greeks need N >= 2.
- Vega and rho by central bump-and-reprice (volatility and rate +-BUMP, absolute): the four bumped
  copies of the portfolio go into the same engine call as the base one, so on the GPU they run in
  the same launches. Per unit of volatility / rate (divide by 100 for "per point").
- Richardson (two points, N and M ~ N/2): the leading lattice error of a vanilla price falls like
  1/N, so (N V(N) - M V(M)) / (N - M) cancels it. M is N // 2 moved up by one where needed to have
  N's parity: binomial prices oscillate between odd and even N, and lr/joshi4 want odd N
  (QuantLib rolls an N+1-step tree over N levels at even N). N >= 3. The Greeks stay those of the
  N-step lattice. docs/numerics.md measures where this pays (American puts: lr yes, crr no).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from pricer.errors import InputError, first_ids
from pricer.model.lattice import LEVEL_VALUES, LatticeParams, lattice_parameters
from pricer.model.scenarios import ScenarioLattices

BUMP = 1e-4
GREEKS = ("delta", "gamma", "theta", "vega", "rho")
SCENARIO = "scenario:"   # a scenario's price among the outputs: SCENARIO + its number
SCENARIOS = "scenarios"  # price_with_analytics' (options, scenarios) array of them
# --greeks' bumped copies of every option, in the engine call's order after the option itself
BUMPS = (("volatility", 1.0), ("volatility", -1.0), ("rate", 1.0), ("rate", -1.0))


@dataclass(frozen=True)
class Analytics:
    """What to compute besides the price, and so which lattices a run prices per option: the
    option's own, with --greeks its BUMPS copies (N steps each), with --richardson the coarse
    lattice of richardson_steps(N), with a scenario grid one lattice per scenario
    (pricer.model.scenarios, N steps each). lattice_columns and lattices say it, once, for pricing
    (price_with_analytics), checks, memory sizing and node counts (pricer.model.cost)."""
    greeks: bool = False
    richardson: bool = False
    scenarios: object = None     # a ScenarioGrid, or None

    @property
    def outputs(self) -> tuple:
        """The values per option: the price, the Greeks, each scenario's price (SCENARIO + k)."""
        count = self.scenarios.count if self.scenarios is not None else 0
        return ("price",) + (GREEKS if self.greeks else ()) + \
            tuple(f"{SCENARIO}{k}" for k in range(count))

    def lattice_columns(self, cols: dict) -> list[dict]:
        """The columns of every lattice priced per option, in the engine call's order."""
        return [part for _, part in self.described_lattices(cols)]

    def described_lattices(self, cols: dict) -> list[tuple[str, dict]]:
        """lattice_columns, each with why it is priced (for a refusal's message)."""
        parts = [("the option's own lattice", cols)]
        if self.greeks:
            parts += [(f"--greeks reprices each option with volatility and rate bumped by "
                       f"+-{BUMP}", part) for part in bumped(cols)]
        if self.richardson:
            parts.append(("--richardson also prices each option on M ~ N/2 steps",
                          dict(cols, steps=richardson_steps(cols["steps"]))))
        if self.scenarios is not None:
            parts += [(self.scenarios.describe(k), part)
                      for k, part in enumerate(self.scenarios.columns(cols))]
        return parts

    def lattices(self, steps) -> list:
        """[(steps, count)]: the lattices priced per option of `steps`, as lattice_columns."""
        steps = np.asarray(steps, dtype=np.int64)
        kinds = [(steps, 1 + (len(BUMPS) if self.greeks else 0)
                  + (self.scenarios.count if self.scenarios is not None else 0))]
        if self.richardson:
            kinds.append((richardson_steps(steps), 1))
        return kinds

    @property
    def implied(self) -> bool:
        """Whether the run solves for the volatility (pricer.model.implied) rather than prices."""
        return False

    @property
    def rounds(self) -> int:
        """Times each of the lattices is priced per option, as the cost model counts them."""
        return 1

    @property
    def lattice_count(self) -> int:
        """Lattices priced per option."""
        return 1 + (len(BUMPS) if self.greeks else 0) + int(self.richardson) + \
            (self.scenarios.count if self.scenarios is not None else 0)


def node_prices(params: LatticeParams, level: int) -> np.ndarray:
    """S(level, i) for i = 0..level, shape (n, level + 1)."""
    i = np.arange(level + 1)
    return params.spot[:, None] * np.exp(level * params.log_down[:, None]
                                         + i * (params.log_up - params.log_down)[:, None])


def lattice_greeks(params: LatticeParams, price: np.ndarray, levels: np.ndarray, cols: dict):
    """Delta, gamma and theta from the kept first levels (QuantLib's formulas)."""
    s1, s2 = node_prices(params, 1), node_prices(params, 2)
    v1, v2 = levels[:, 0:2], levels[:, 2:5]
    delta = (v1[:, 1] - v1[:, 0]) / (s1[:, 1] - s1[:, 0])
    delta_up = (v2[:, 2] - v2[:, 1]) / (s2[:, 2] - s2[:, 1])
    delta_down = (v2[:, 1] - v2[:, 0]) / (s2[:, 1] - s2[:, 0])
    gamma = (delta_up - delta_down) / ((s2[:, 2] - s2[:, 0]) / 2.0)
    r, q, sigma, spot = cols["rate"], cols["dividend"], cols["volatility"], cols["spot"]
    theta = r * price - (r - q) * spot * delta - 0.5 * sigma * sigma * spot * spot * gamma
    return delta, gamma, theta


def bumped(cols: dict) -> list[dict]:
    """The portfolio with volatility +-BUMP and rate +-BUMP, in that order (BUMPS)."""
    return [dict(cols, **{key: cols[key] + sign * BUMP}) for key, sign in BUMPS]


def concatenate(parts: list[dict]) -> dict:
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def richardson_steps(steps: np.ndarray) -> np.ndarray:
    """The coarse lattice M ~ N/2 of the same parity as N (N >= 3)."""
    steps = np.asarray(steps, dtype=np.int64)
    half = steps // 2
    return np.where(half % 2 == steps % 2, half, half + 1)


def unsupported(cols: dict, analytics: Analytics) -> list[tuple[np.ndarray, str, str]]:
    """The options the requested analytics cannot handle, rule by rule in the order check refuses
    them: [(mask, column, reason)] (pricer.model.validity skips them instead)."""
    steps, rules = np.asarray(cols["steps"]), []
    for wanted, flag, least, why in ((analytics.greeks, "--greeks", 2, "a second lattice level"),
                                     (analytics.richardson, "--richardson", 3,
                                      "a coarser lattice of the same parity")):
        if wanted:
            short = steps < least
            rules.append((short, "steps", f"{flag} needs steps >= {least} ({why}); option id(s) "
                          "{ids} have steps {value}"))
    if analytics.greeks:
        rules.append((np.asarray(cols["volatility"]) <= BUMP, "volatility",
                      f"--greeks bumps the volatility by {BUMP}: option id(s) {{ids}} have "
                      f"volatility <= {BUMP}"))
    grid = analytics.scenarios
    if grid is not None:     # a scenario's option must be an option: S0, sigma, T > 0
        for column, shifted, shift in (
                ("spot", np.asarray(cols["spot"]) * (1.0 + min(grid.spot)), min(grid.spot)),
                ("volatility", np.asarray(cols["volatility"]) + min(grid.volatility),
                 min(grid.volatility)),
                ("maturity", np.asarray(cols["maturity"]) - max(grid.days) / 365.0,
                 max(grid.days))):
            what = "days passed" if column == "maturity" else f"{column} shift"
            rules.append((~(shifted > 0.0), column,
                          f"the scenarios' {what} {shift:g} leaves {column} <= 0 for option "
                          f"id(s) {{ids}}"))
    return rules


def check(cols: dict, analytics: Analytics, ids: np.ndarray) -> None:
    """Inputs the requested analytics cannot handle, refused by id before any pricing."""
    for mask, column, reason in unsupported(cols, analytics):
        if mask.any():
            raise InputError(reason.format(ids=first_ids(ids, mask),
                                           value=int(np.asarray(cols[column])[mask][0])
                                           if column == "steps" else ""),
                             column=column, ids=np.asarray(ids)[mask])


@dataclass
class PreparedLattices:
    """The host's side of pricing a set of options with analytics, done before the engine's
    (prepare_lattices): the checked columns, the lattice parameters of the options' own lattices
    and their Greeks' and Richardson's (params; None where the scenarios carry the options' own),
    and the scenario grid's lattices (a ScenarioLattices, or None)."""
    cols: dict
    analytics: Analytics
    params: LatticeParams | None
    lattices: ScenarioLattices | None


def prepare_lattices(cols: dict, tree: str, ids: np.ndarray,
                     analytics: Analytics = Analytics()) -> PreparedLattices:
    """The checks and every lattice's parameters that need no engine (InputError by id); the
    options' own lattices alone (no Greeks, no Richardson) go first among a grid's scenarios."""
    check(cols, analytics, ids)
    grid = analytics.scenarios
    parts = replace(analytics, scenarios=None).lattice_columns(cols)   # scenarios: below
    alone = grid is not None and len(parts) == 1
    params = lattices = None
    if not alone:
        every = concatenate(parts) if len(parts) > 1 else cols
        params = lattice_parameters(every, tree, ids=np.tile(ids, len(parts)))
    if grid is not None:     # contiguous columns: the rows are shifted per scenario
        solid = {key: np.ascontiguousarray(value) for key, value in cols.items()}
        lattices = ScenarioLattices(solid, grid, tree, ids, base=alone)
    return PreparedLattices(cols, analytics, params, lattices)


def price_with_analytics(engine, cols: dict, tree: str, ids: np.ndarray,
                         analytics: Analytics = Analytics()) -> dict:
    """Prices (and Greeks) of the options in `cols` with `engine`, as a dict of float64 arrays
    named by Analytics.outputs, but for the scenarios' prices: one (options, scenarios) array,
    SCENARIOS."""
    return price_prepared(engine, prepare_lattices(cols, tree, ids, analytics))


def price_prepared(engine, prepared: PreparedLattices) -> dict:
    """price_with_analytics' outputs of options prepared by prepare_lattices."""
    cols, analytics, params = prepared.cols, prepared.analytics, prepared.params
    n = len(cols["spot"])
    levels = prices = None
    if params is not None:
        levels = np.empty((len(params), LEVEL_VALUES)) if analytics.greeks else None
        prices = engine.price(params, levels) if levels is not None else engine.price(params)
    lattices = prepared.lattices
    if lattices is not None and lattices.base and engine.sizes_by_call:
        # an engine that picks CPU or GPU by a call's size prices the options' own alone
        prices, lattices = engine.price(lattices.build(0, 1)), lattices.without_base()
    if lattices is not None:
        priced = engine.price_lattices(lattices)
        prices = priced if prices is None else np.concatenate([prices, priced])
    base = prices[:n]
    out = {"price": base.copy()}
    after = 1 + (len(BUMPS) if analytics.greeks else 0)     # lattice_columns' order
    if analytics.richardson:
        fine = np.asarray(cols["steps"], dtype=np.float64)
        coarse = richardson_steps(cols["steps"]).astype(np.float64)
        out["price"] = (fine * base - coarse * prices[after * n:(after + 1) * n]) / (fine - coarse)
        after += 1
    if prepared.lattices is not None:     # (options, scenarios), a view of the engine's order
        out[SCENARIOS] = prices[after * n:].reshape(-1, n).T
    if analytics.greeks:
        first = params.take(np.arange(n))
        out["delta"], out["gamma"], out["theta"] = lattice_greeks(first, base, levels[:n], cols)
        up_v, down_v, up_r, down_r = (prices[k * n:(k + 1) * n] for k in range(1, 5))
        out["vega"] = (up_v - down_v) / (2.0 * BUMP)
        out["rho"] = (up_r - down_r) / (2.0 * BUMP)
    return out
