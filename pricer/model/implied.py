"""Implied volatilities on the lattice: per option, the volatility at which its lattice price (its
tree, its N) is its market price. docs/numerics.md, "Implied volatility", derives the method:

- Bounds, without a lattice: a market price at or below what every lattice of the option is
  worth at least (0; an American option's payoff now) has no time value to explain
  (NO_TIME_VALUE), and one at or above what it is worth at most (a call S0 max(1, e^{-qT}); a put
  K max(1, e^{-rT}), or K e^{-rT} if European) has no volatility (ABOVE_BOUND). Tighter
  continuous-time bounds (a European option's discounted forward payoff) are not used: QuantLib's
  trees are not exact martingales, and their lattice prices cross those bounds by up to ~1e-3
  relative, so the search decides.
- Start: the volatility column where the book gives one, else the Black–Scholes implied volatility
  of the market price as if the option were European.
- Iteration on f(sigma) = V(sigma) - market, one lattice per option per round: a secant step
  (the first a Newton step with the closed form's vega), kept inside the bracket of the points
  known below and above the root, bisection where a step leaves it. A tree's lattice exists for
  an interval of volatilities (p in (0, 1), node prices within FP64's range): a sigma without one
  narrows the bracket from its side of the priced points, so the search stays where it exists.
- Converged: |f| <= PRICE_TOLERANCE max(market, 1e-8 K) (min(K, S) for a call, whose value is
  at most S) and the sigma error |f| / slope estimated below SIGMA_TOLERANCE (or the bracket
  narrower than it). A market price below the lattice's
  price at its smallest volatility, or above it at SIGMA_HIGH, has no answer in the search range.
- Options take a round each in a pool of a chunk's size (implied_pool.py): every round prices
  every option still searching (in groups that take their rounds in turn), and an option that is
  done leaves the pool for the next of the queue, so the engine's calls stay full while options
  converge at their own speeds.

An option's rounds depend on its own values only, so its answer does not depend on the pool it
shared, its groups, the chunks or the ranks, on an engine that prices a lattice alike in any call
(every backend but `auto`, which picks the CPU or the GPU by each call's size).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numba
import numpy as np

from pricer import numba_cache  # noqa: F401  (where pricer's kernels below are cached)
from pricer.model.greeks import Analytics

SIGMA_LOW, SIGMA_HIGH = 1e-4, 10.0   # the search range of the volatility

PROBES = (0.25, 1.0, 0.05, 4.0, 0.01, SIGMA_HIGH, 0.002, SIGMA_LOW)   # where a search looks for
                                     # a lattice while none of its sigmas has had one

# Statuses beside pricer/model/validity.py's (1-6: the option could not be solved for at all).
CONVERGED = 0
NO_TIME_VALUE, ABOVE_BOUND, NOT_CONVERGED, NO_LATTICE_FOUND = 20, 21, 22, 23
REASONS = {
    NO_TIME_VALUE: "the market price is at or below 0 or, for an American option, its payoff now, "
                   "or below its lattice price at the smallest volatility the search tries "
                   "(or the tree takes; the search takes the price to rise with volatility)",
    ABOVE_BOUND: "the market price is at or above the no-arbitrage upper bound (a call: "
                 "S0 max(1, e^-qT); a put: K max(1, e^-rT), K e^-rT if European), or above its "
                 "lattice price at the largest "
                 f"volatility the search tries ({SIGMA_HIGH:g}, or the tree takes)",
    NOT_CONVERGED: "the search did not converge in its rounds",
    NO_LATTICE_FOUND: "the option's tree has a lattice (probabilities in (0, 1), node prices "
                      "within FP64's range) at none of the volatilities the search probes "
                      f"(its start and {', '.join(f'{x:g}' for x in PROBES)}): most often its "
                      "rate and dividend are too far apart for its steps",
}

NAMES = {CONVERGED: "converged", NO_TIME_VALUE: "no time value", ABOVE_BOUND: "above the bound",
         NOT_CONVERGED: "not converged", NO_LATTICE_FOUND: "no lattice"}


def statuses_text(status: np.ndarray) -> str:
    """'980 converged, 20 no time value (status 20), 3 skipped (status 2)': a run's statuses."""
    codes, counts = np.unique(status, return_counts=True)
    return ", ".join(f"{count} {NAMES.get(int(code), 'skipped')}"
                     + (f" (status {int(code)})" if code else "")
                     for code, count in zip(codes, counts))


PRICE_TOLERANCE = 1e-10              # |V(sigma) - market| <= this * max(market, 1e-8 K)
PRICE_FLOOR = 1e-8                   # ... relative to K, for market prices near 0
SIGMA_TOLERANCE = 1e-11              # estimated |sigma - root| at convergence ...
FLAT_VEGA = 1e-4                     # ... where dV/dsigma >= this * K
MAX_ROUNDS = 100                     # bisection alone narrows [SIGMA_LOW, SIGMA_HIGH] below
                                     # 1e-15 relative in ~70 rounds
START_HIGH = 1.0                     # the highest start: higher volatilities are reached by
                                     # GROWTH steps, past the lattice prices' rise (a start at
                                     # SIGMA_HIGH would see QuantLib's trees' fall beyond it)
GROWTH = 4.0                         # the most sigma moves a round toward an end not yet priced
EXPECTED_ROUNDS = 6                  # the cost model's lattices per option (measured 4-7)
OUTPUTS = ("price", "implied_volatility", "iterations")


@dataclass(frozen=True)
class ImpliedVolatility(Analytics):
    """A run that solves for the volatility: its outputs per option (the lattice price at the
    answer, the answer, the rounds it took; the status follows them, RunConfig.outputs), and its
    lattices: one per option per round, EXPECTED_ROUNDS of them in the cost model."""

    @property
    def outputs(self) -> tuple:
        return OUTPUTS

    @property
    def implied(self) -> bool:
        return True

    @property
    def rounds(self) -> int:
        return EXPECTED_ROUNDS

    def described_lattices(self, cols: dict) -> list:
        return [("the option's own lattice", cols)]


# ---------------------------------------------------------------- bounds and the European start

def bounds_status(cols: dict, market: np.ndarray) -> np.ndarray:
    """NO_TIME_VALUE or ABOVE_BOUND where the market price is outside the bounds every lattice of
    the option keeps (the module doc), else CONVERGED (to be solved)."""
    f = lambda name: np.ascontiguousarray(cols[name], dtype=np.float64)  # noqa: E731
    return _bounds(f("spot"), f("strike"), f("maturity"), f("rate"), f("dividend"),
                   np.ascontiguousarray(cols["call"], dtype=np.bool_),
                   np.ascontiguousarray(cols["american"], dtype=np.bool_),
                   np.ascontiguousarray(market, dtype=np.float64))


@numba.njit(cache=True, error_model="numpy")
def _bounds(spot, strike, maturity, rate, dividend, call, american, market):
    status = np.empty(spot.shape[0], dtype=np.int8)
    for i in range(spot.shape[0]):        # a few operations an option: serial is fast enough
        payoff = spot[i] - strike[i] if call[i] else strike[i] - spot[i]
        floor = max(payoff, 0.0) if american[i] else 0.0
        growth = math.exp(-(dividend[i] if call[i] else rate[i]) * maturity[i])
        ceiling = (spot[i] if call[i] else strike[i]) * \
            (max(growth, 1.0) if american[i] or call[i] else growth)
        status[i] = NO_TIME_VALUE if market[i] <= floor else \
            ABOVE_BOUND if market[i] >= ceiling else CONVERGED
    return status


@numba.njit(cache=True, error_model="numpy")
def _normal_cdf(x):
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


@numba.njit(cache=True, error_model="numpy")
def _black_scholes(spot, strike, maturity, rate, dividend, sigma, call):
    """(price, vega) of a European option."""
    root = sigma * math.sqrt(maturity)
    forward = spot * math.exp(-dividend * maturity)
    discounted = strike * math.exp(-rate * maturity)
    d1 = (math.log(forward / discounted) + 0.5 * root * root) / root
    d2 = d1 - root
    vega = forward * math.exp(-0.5 * d1 * d1) / math.sqrt(2.0 * math.pi) * math.sqrt(maturity)
    if call:
        return forward * _normal_cdf(d1) - discounted * _normal_cdf(d2), vega
    return discounted * _normal_cdf(-d2) - forward * _normal_cdf(-d1), vega


@numba.njit(parallel=True, cache=True, error_model="numpy")
def _european_start(spot, strike, maturity, rate, dividend, call, market, low, high):
    """Per option, the Black–Scholes implied volatility of `market` (Newton kept in a bisection
    bracket, in [low, high]): a start, so a few correct digits are enough."""
    n = spot.shape[0]
    out = np.empty(n)
    for i in numba.prange(n):
        lo, hi = low, high
        x = 0.3
        for _ in range(40):
            value, vega = _black_scholes(spot[i], strike[i], maturity[i], rate[i], dividend[i],
                                         x, call[i])
            diff = value - market[i]
            if diff > 0.0:
                hi = x
            else:
                lo = x
            if abs(diff) <= 1e-6 * market[i]:
                break
            step = x - diff / vega if vega > 0.0 else -1.0
            x = step if lo < step < hi else 0.5 * (lo + hi)
        out[i] = x
    return out


def european_start(cols: dict, market: np.ndarray) -> np.ndarray:
    """The Black–Scholes implied volatility of each market price, as if European, in
    [SIGMA_LOW, SIGMA_HIGH] (the search's start)."""
    f = lambda name: np.ascontiguousarray(cols[name], dtype=np.float64)  # noqa: E731
    return _european_start(f("spot"), f("strike"), f("maturity"), f("rate"), f("dividend"),
                           np.ascontiguousarray(cols["call"], dtype=np.bool_),
                           np.ascontiguousarray(market, dtype=np.float64), SIGMA_LOW, SIGMA_HIGH)


# -------------------------------------------------------------------------------- the search

# how a bracket's end is known: the search range's end (not priced), a priced point, a sigma whose
# lattice does not exist
EDGE, PRICED, NO_LATTICE = 0, 1, 2


class Search:
    """The searches of a pool of options, a row per option (struct of arrays). `cols` are the
    options' columns (pricer.io.portfolio.Portfolio.columns), `market` their market prices,
    `start` their first volatility."""

    def __init__(self, cols: dict, market: np.ndarray, start: np.ndarray):
        n = market.shape[0]
        self.cols, self.market = cols, market
        # the scale of the option's value: at most K, and a call is worth at most S (a call of an
        # absurd K must not have a tolerance of its K's size: its market price would "converge"
        # at any sigma)
        call = np.asarray(cols["call"]) != 0
        self.scale = np.where(call, np.minimum(cols["strike"], cols["spot"]), cols["strike"])
        self.tolerance = PRICE_TOLERANCE * np.maximum(market, PRICE_FLOOR * self.scale)
        self.x = np.clip(start, SIGMA_LOW, START_HIGH)
        self.lo, self.hi = np.full(n, SIGMA_LOW), np.full(n, SIGMA_HIGH)
        self.lo_kind, self.hi_kind = np.full(n, EDGE, np.int8), np.full(n, EDGE, np.int8)
        self.xp, self.fp = np.full(n, np.nan), np.full(n, np.nan)   # the last priced point
        self.rounds = np.zeros(n, dtype=np.int64)
        self.status = np.full(n, -1, dtype=np.int8)                 # -1: searching
        self.price = np.full(n, np.nan)

    def step(self, rows: np.ndarray, values: np.ndarray, exists: np.ndarray):
        """One round of the options `rows` (searching), priced at self.x[rows]: `values` their
        lattice prices (NaN where no lattice), `exists` where there was one. Sets the next x, or
        a status (_step)."""
        c = self.cols
        _step(rows, values, exists, self.x, self.market, self.tolerance, self.scale, self.lo,
              self.hi, self.lo_kind, self.hi_kind, self.xp, self.fp, self.rounds, self.status,
              self.price, c["spot"], c["strike"], c["maturity"], c["rate"], c["dividend"],
              c["call"])


@numba.njit(parallel=True, nogil=True, cache=True, error_model="numpy")
def _step(rows, values, exists, x, market, tolerance, scale, lo, hi, lo_kind, hi_kind, xp, fp,
          rounds, status, price, spot, strike, maturity, rate, dividend, call):
    """Search.step, option by option (the searches are independent: one pass in parallel). A
    division by zero gives inf or NaN (error_model "numpy"), which the steps' guards send to
    bisection."""
    for k in numba.prange(rows.shape[0]):
        i = rows[k]
        xi = x[i]
        rounds[i] += 1
        last = rounds[i] >= MAX_ROUNDS
        seen = math.isfinite(xp[i])
        if not exists[k]:
            # a tree's lattice exists for the volatilities of an interval: a sigma without one
            # is beyond the interval's end on its side of a priced point (neither its fault nor
            # sigma says which: QuantLib's trees lose p in (0, 1) at large volatilities too, lr's
            # nodes leave FP64's range at tiny ones); before any point is priced, it probes
            if not seen:
                if last or rounds[i] > len(PROBES):
                    status[i] = NO_LATTICE_FOUND
                else:
                    x[i] = PROBES[rounds[i] - 1]
                continue
            if xi > xp[i]:
                hi[i], hi_kind[i] = xi, NO_LATTICE
            else:
                lo[i], lo_kind[i] = xi, NO_LATTICE
            f = slope = math.nan
        else:
            f = values[k] - market[i]
            # the slope of f near x: the secant through the last two priced points, else the
            # closed form's vega (the lattice's is close to it)
            secant = (f - fp[i]) / (xi - xp[i]) if seen and xi != xp[i] else math.nan
            slope = secant
            if not (math.isfinite(secant) and secant > 0.0):
                slope = _black_scholes(spot[i], strike[i], maturity[i], rate[i], dividend[i], xi,
                                       call[i])[1]
            # sigma is pinned where the slope is; below FLAT_VEGA K (min(K, S) for a call), a
            # band of sigmas prices within the tolerance, and the price is what it promises
            if abs(f) <= tolerance[i] and (abs(f) <= SIGMA_TOLERANCE * slope
                                           or slope < FLAT_VEGA * scale[i]
                                           or hi[i] - lo[i] <= SIGMA_TOLERANCE or last):
                status[i], price[i] = CONVERGED, values[k]
                continue
            # the bracket; the range's ends priced and still beyond the root: no answer in it
            if f < 0.0:
                lo[i], lo_kind[i] = xi, PRICED
                if xi >= SIGMA_HIGH:
                    status[i] = ABOVE_BOUND
                    continue
            else:
                hi[i], hi_kind[i] = xi, PRICED
                if xi <= SIGMA_LOW:
                    status[i] = NO_TIME_VALUE
                    continue
            xp[i], fp[i] = xi, f
        # ... or the bracket closed on the edge of the lattice's existence, the root beyond it
        if hi[i] - lo[i] <= SIGMA_TOLERANCE * max(hi[i], 1.0):
            if lo_kind[i] == NO_LATTICE:
                status[i] = NO_TIME_VALUE
                continue
            if hi_kind[i] == NO_LATTICE:
                status[i] = ABOVE_BOUND
                continue
        if last:
            status[i] = NOT_CONVERGED
            continue
        # where two priced points show f flat (a deep out-of-the-money lattice worth 0 over a
        # range of sigmas) or falling, a Newton step with the closed form's vega would crawl:
        # bisect (or grow toward an end not yet priced) instead
        if seen and not (secant > 0.0):
            slope = math.nan
        x[i] = _next(xi, f, slope, lo[i], hi[i], lo_kind[i], hi_kind[i], rounds[i])


@numba.njit(cache=True, error_model="numpy")
def _next(x, f, slope, lo, hi, lo_kind, hi_kind, rounds):
    """The next sigma: a secant (or Newton) step where it stays inside the bracket, else
    bisection (geometric while the bracket is wide); toward an end of the range not yet priced,
    at most a factor GROWTH a round (the range's end at most): a lattice price need not rise with
    sigma far from the root (QuantLib's trees' fall again at volatilities of several hundred per
    cent). A secant that keeps landing on one side shrinks the bracket slowly: every third round
    of a bracketed search bisects."""
    middle = math.sqrt(lo * hi) if hi > 4.0 * lo else 0.5 * (lo + hi)
    if rounds % 3 == 0 and lo_kind == PRICED and hi_kind == PRICED:
        return middle
    step = x - f / slope
    want = step if math.isfinite(step) else middle
    if math.isfinite(f) and want <= x and lo_kind == EDGE and hi_kind != EDGE:
        return max(want, x / GROWTH, SIGMA_LOW)
    if math.isfinite(f) and want >= x and hi_kind == EDGE and lo_kind != EDGE:
        return min(want, x * GROWTH, SIGMA_HIGH)
    return step if math.isfinite(step) and lo < step < hi else middle
