"""The binomial trees, as small policy objects (as in QuantLib): each turns an option's market data
and N into its lattice's numbers, log up/down factors and the up probability.

A tree has a `name`, a `min_steps`, `spot_free` (whether its numbers ignore the spot: then
options that differ only in spot share them) and `probabilities(cols) -> (dt, log_up, log_down, p)`,
arrays over the options in `cols`, with disc = exp(-r*dt) per level (pricer/model/lattice.py builds the
engines' parameters from them). `crr` is the textbook Cox–Ross–Rubinstein tree (the default). The
others are the trees of QuantLib 1.44's BinomialVanillaEngine, defined exactly as QuantLib defines
them (ql/methods/lattices/binomialtree.{hpp,cpp}, bsmlattice.hpp,
pricingengines/vanilla/binomialengine.hpp; docs/numerics.md says where QuantLib differs from the
textbook and how it is reproduced here).
"""

from __future__ import annotations

import math

import numpy as np

from pricer.errors import InputError


class CoxRossRubinstein:
    """The textbook CRR tree: u = exp(sigma*sqrt(dt)), d = 1/u, p = (exp((r-q)dt) - d)/(u - d)."""

    name = "crr"
    min_steps = 1
    spot_free = True

    def probabilities(self, cols: dict):
        dt = cols["maturity"] / cols["steps"]
        log_up = cols["volatility"] * np.sqrt(dt)
        log_down = -log_up
        growth = np.exp((cols["rate"] - cols["dividend"]) * dt)
        up, down = np.exp(log_up), np.exp(log_down)
        p = (growth - down) / (up - down)
        return dt, log_up, log_down, p


# ------------------------------------------------------------------------------ QuantLib's trees

class QuantLibTree:
    """QuantLib's BinomialTree<T> as BinomialVanillaEngine<T> uses it (binomialtree.hpp, class
    BinomialTree): a tree of `tree_steps` steps over the maturity T, with x0 = S0, dt = T/tree_steps
    and driftPerStep = (r - q - sigma^2/2) * dt (GeneralizedBlackScholesProcess::drift on flat
    curves); the per-step variance is sigma^2 * dt (process->variance(0, x0, dt), i.e.
    BlackConstantVol's blackVariance). The engine rolls back N = `steps` levels of it on
    TimeGrid(T, N), discounting each by exp(-r * T/N) (bsmlattice.hpp, BlackScholesLattice), so the
    discount step is always T/N; only lr and joshi4 build the tree with another step count."""

    min_steps = 1
    spot_free = True

    def tree_steps(self, steps: np.ndarray) -> np.ndarray:
        return steps

    def probabilities(self, cols: dict):
        steps = cols["steps"]
        n = self.tree_steps(steps)
        dt = cols["maturity"] / n
        vol = cols["volatility"]
        drift = (cols["rate"] - cols["dividend"] - 0.5 * vol * vol) * dt   # driftPerStep_
        variance = vol * vol * dt                                          # variance(0, x0, dt_)
        with np.errstate(all="ignore"):
            log_up, log_down, p = self.factors(cols, n, dt, drift, variance)
        return cols["maturity"] / steps, log_up, log_down, p

    def factors(self, cols, n, dt, drift, variance):
        raise NotImplementedError


class QuantLibCRR(QuantLibTree):
    """QuantLib's CoxRossRubinstein (an EqualJumpsBinomialTree): dx = sqrt(sigma^2 dt), node price
    x0*exp(j*dx), pu = 1/2 + driftPerStep/(2 dx) — the first-order probability, not the textbook
    (e^{(r-q)dt} - d)/(u - d)."""

    name = "ql-crr"

    def factors(self, cols, n, dt, drift, variance):
        dx = np.sqrt(variance)
        return dx, -dx, 0.5 + 0.5 * drift / dx


class JarrowRudd(QuantLibTree):
    """QuantLib's JarrowRudd (an EqualProbabilitiesBinomialTree): up = sqrt(sigma^2 dt), node
    (i, index) at x0*exp(i*driftPerStep + (2 index - i)*up), p = 1/2."""

    name = "jr"

    def factors(self, cols, n, dt, drift, variance):
        up = np.sqrt(variance)
        return drift + up, drift - up, np.full(np.shape(up), 0.5)


class AdditiveEQP(QuantLibTree):
    """QuantLib's AdditiveEQPBinomialTree: up = -driftPerStep/2 + sqrt(4 sigma^2 dt -
    3 driftPerStep^2)/2, nodes as for jr, p = 1/2."""

    name = "eqp"

    def factors(self, cols, n, dt, drift, variance):
        up = -0.5 * drift + 0.5 * np.sqrt(4.0 * variance - 3.0 * drift * drift)
        return drift + up, drift - up, np.full(np.shape(up), 0.5)


class Trigeorgis(QuantLibTree):
    """QuantLib's Trigeorgis (an EqualJumpsBinomialTree): dx = sqrt(sigma^2 dt + driftPerStep^2),
    node price x0*exp(j*dx), pu = 1/2 + driftPerStep/(2 dx)."""

    name = "trigeorgis"

    def factors(self, cols, n, dt, drift, variance):
        dx = np.sqrt(variance + drift * drift)
        return dx, -dx, 0.5 + 0.5 * drift / dx


class Tian(QuantLibTree):
    """QuantLib's Tian (third-moment matching): q = exp(sigma^2 dt), r = exp(driftPerStep)*sqrt(q)
    (= e^{(r-q)dt}), up/down = r q (q + 1 ± sqrt(q^2 + 2q - 3))/2, pu = (r - down)/(up - down)."""

    name = "tian"

    def factors(self, cols, n, dt, drift, variance):
        q = np.exp(variance)
        r = np.exp(drift) * np.sqrt(q)
        root = np.sqrt(q * q + 2 * q - 3)
        up = 0.5 * r * q * (q + 1 + root)
        down = 0.5 * r * q * (q + 1 - root)
        return np.log(up), np.log(down), (r - down) / (up - down)


def _odd(steps: np.ndarray) -> np.ndarray:
    return np.where(steps % 2 == 1, steps, steps + 1)


class _StrikeCentred(QuantLibTree):
    spot_free = False        # centred on the strike: ln(S0/K) is in d2

    """Leisen–Reimer and Joshi's trees (binomialtree.cpp): built for the odd step count
    n = N (N odd) or N + 1 (N even) and centred on the strike. With V = sigma^2 T,
    ermqdt = exp(driftPerStep + V/(2n)), d2 = (ln(x0/K) + n*driftPerStep)/sqrt(V),
    pu = h(d2), p' = h(d2 + sqrt(V)), up = ermqdt p'/pu, down = (ermqdt - pu up)/(1 - pu).
    The engine still rolls back N levels with the discount exp(-r T/N) (docs/numerics.md)."""

    def tree_steps(self, steps):
        return _odd(steps)

    def factors(self, cols, n, dt, drift, variance):
        total = cols["volatility"] * cols["volatility"] * cols["maturity"]  # variance(0, x0, end)
        nf = n.astype(np.float64)
        ermqdt = np.exp(drift + 0.5 * total / nf)
        d2 = (np.log(cols["spot"] / cols["strike"]) + drift * nf) / np.sqrt(total)
        pu = self.inversion(d2, nf)
        pdash = self.inversion(d2 + np.sqrt(total), nf)
        up = ermqdt * pdash / pu
        down = (ermqdt - pu * up) / (1.0 - pu)
        return np.log(up), np.log(down), pu


class LeisenReimer(_StrikeCentred):
    """h = PeizerPrattMethod2Inversion (ql/math/distributions/binomialdistribution.hpp):
    h(z, n) = 1/2 ± sqrt(1/4 - exp(-(z/(n + 1/3 + 0.1/(n+1)))^2 (n + 1/6))/4), sign of z."""

    name = "lr"

    @staticmethod
    def inversion(z, n):
        result = z / (n + 1.0 / 3.0 + 0.1 / (n + 1.0))
        result = result * result
        # the C library's exp, as QuantLib's: near the strike 1 - exp(-x) cancels (x ~ 1e-10), and
        # numpy's own exp, one ulp away there, moved p by 1e-12 and a price by 1.2e-9
        result = np.fromiter(map(math.exp, -result * (n + 1.0 / 6.0)), np.float64, count=result.size)
        return 0.5 + np.where(z > 0, 1.0, -1.0) * np.sqrt(0.25 * (1.0 - result))


class Joshi4(_StrikeCentred):
    """h = Joshi4::computeUpProb((n - 1)/2, z): with a = z/sqrt(8) and k = (n - 1)/2,
    p = 1/2 + a/k^0.5 + b/k^1.5 + c/k^2.5 + e/k^3.5, b = -3a/8 - a^3,
    c = 5a^5/6 + 13a^3/12 + 25a/128, e = -0.1025a - 0.9285a^3 - 1.43a^5 - 0.5a^7.
    Undefined at N = 1 (k = 0), so it needs N >= 2."""

    name = "joshi4"
    min_steps = 2

    @staticmethod
    def inversion(z, n):
        k = (n - 1.0) / 2.0
        alpha = z / np.sqrt(8.0)
        alpha2 = alpha * alpha
        alpha3 = alpha * alpha2
        alpha5 = alpha3 * alpha2
        alpha7 = alpha5 * alpha2
        beta = -0.375 * alpha - alpha3
        gamma = (5.0 / 6.0) * alpha5 + (13.0 / 12.0) * alpha3 + (25.0 / 128.0) * alpha
        delta = -0.1025 * alpha - 0.9285 * alpha3 - 1.43 * alpha5 - 0.5 * alpha7
        rootk = np.sqrt(k)
        p = 0.5 + alpha / rootk
        p = p + beta / (k * rootk)
        p = p + gamma / (k * k * rootk)
        p = p + delta / (k * k * k * rootk)
        return p


TREES = {tree.name: tree for tree in (CoxRossRubinstein(), QuantLibCRR(), JarrowRudd(),
                                      AdditiveEQP(), Trigeorgis(), Tian(), LeisenReimer(), Joshi4())}
# A tree's code (its position here) is how a portfolio's `tree` column travels between MPI ranks.
TREE_NAMES = tuple(TREES)


def tree_named(name: str):
    try:
        return TREES[name]
    except (KeyError, TypeError):
        raise InputError(f"unknown tree {name!r}; known trees: {', '.join(TREES)}") from None


def tree_codes(names: np.ndarray, unknown: int | None = None) -> np.ndarray:
    """Tree names -> int64 codes, their positions in TREE_NAMES (portfolio.validate has checked
    that every name is known; else `unknown`, where given, is the code of a name that is not)."""
    names = np.asarray(names, dtype=str)
    codes = np.full(names.shape, -1, dtype=np.int64)
    for code, name in enumerate(TREE_NAMES):
        codes[names == name] = code
    if unknown is not None:
        codes[codes < 0] = unknown
    if (codes < 0).any() and unknown is None:
        raise InputError(f"unknown tree {str(names[codes < 0][0])!r}; known trees: {', '.join(TREES)}")
    return codes
