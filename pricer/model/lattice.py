"""Stage 2: per-option lattice parameters for each tree type, vectorised over the portfolio.

Tree types are small policy objects (as in QuantLib): they turn an option's market data and N into
the numbers every engine consumes — log up/down factors and discounted branch probabilities. The
engines never see the tree type, so a new tree needs no new kernel.

Node (t, i) (t steps taken, i of them up) has asset price S0 * exp(t*log_down + i*(log_up - log_down)).
Backward step: V(t, i) = pu * V(t+1, i+1) + pd * V(t+1, i), with pu = disc*p, pd = disc*(1-p);
American options take max(hold, exercise) at every node, t = 0 included.

A tree has a `name`, a `min_steps` and `probabilities(cols) -> (dt, log_up, log_down, p)`, arrays
over the options in `cols`, with disc = exp(-r*dt) per level. `crr` is the textbook
Cox–Ross–Rubinstein tree (the default). The others are the trees of
QuantLib 1.44's BinomialVanillaEngine, defined exactly as QuantLib defines them
(ql/methods/lattices/binomialtree.{hpp,cpp}, bsmlattice.hpp, pricingengines/vanilla/binomialengine.hpp;
docs/numerics.md says where QuantLib differs from the textbook and how it is reproduced here).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np

from pricer.errors import InputError, first_ids


@dataclass
class LatticeParams:
    """Everything an engine needs per option (struct of arrays, float64 unless noted).

    The nine arrays are views of one buffer, `packed` (PACKED_ROWS rows of n float64 slots), so
    that a kernel can take all of them as one argument: numba's dispatch cost grows with every
    array argument, a measurable share of a small option's time. Writing into an array writes
    into `packed`; assigning another array to a field packs them all again."""

    spot: np.ndarray
    strike: np.ndarray
    steps: np.ndarray      # int64
    call: np.ndarray       # bool
    american: np.ndarray   # bool
    log_up: np.ndarray
    log_down: np.ndarray
    pu: np.ndarray         # discounted up probability, disc * p
    pd: np.ndarray         # discounted down probability, disc * (1 - p)

    def __post_init__(self):
        self._pack()

    def _pack(self):
        n = int(np.shape(self.spot)[0])
        packed = np.empty((PACKED_ROWS, n))
        views = packed_views(packed)
        for name, view in views.items():
            view[...] = getattr(self, name)
        object.__setattr__(self, "packed", packed)
        object.__setattr__(self, "count", n)   # len(self), as a plain attribute for the hot path
        for name, view in views.items():
            object.__setattr__(self, name, view)

    def __setattr__(self, name, value):
        object.__setattr__(self, name, value)
        if name in PACKED_FIELDS and "packed" in self.__dict__:
            self._pack()

    def __reduce__(self):
        return LatticeParams, tuple(getattr(self, name) for name in PACKED_FIELDS)

    def __len__(self) -> int:
        return int(self.spot.shape[0])

    def take(self, index) -> "LatticeParams":
        return LatticeParams(*(getattr(self, name)[index] for name in PACKED_FIELDS))


# Greeks need the option values of the lattice's first levels: LEVEL_VALUES numbers per option,
# V(1, 0), V(1, 1), V(2, 0), V(2, 1), V(2, 2) (NaN for an option with fewer than 2 steps); every
# engine's price(params, levels) writes them in this order.
LEVEL_VALUES = 5

# LatticeParams.packed: a row per float64 field, steps as int64 in the next, and the two flags as
# bytes of the last (call in its first n bytes, american in the next n).
FLOAT_ROWS = {"spot": 0, "strike": 1, "log_up": 2, "log_down": 3, "pu": 4, "pd": 5}
STEPS_ROW, FLAGS_ROW, PACKED_ROWS = 6, 7, 8
PACKED_FIELDS = tuple(f.name for f in fields(LatticeParams))


def packed_views(packed: np.ndarray) -> dict:
    """The fields of LatticeParams as views of its packed buffer."""
    n = packed.shape[1]
    flags = packed[FLAGS_ROW].view(np.bool_)
    views = {name: packed[row] for name, row in FLOAT_ROWS.items()}
    views.update(steps=packed[STEPS_ROW].view(np.int64), call=flags[:n], american=flags[n:2 * n])
    return views


class CoxRossRubinstein:
    """The textbook CRR tree: u = exp(sigma*sqrt(dt)), d = 1/u, p = (exp((r-q)dt) - d)/(u - d)."""

    name = "crr"
    min_steps = 1

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


def lattice_parameters(cols: dict, tree: str = "crr", ids: np.ndarray | None = None) -> LatticeParams:
    """Per-option parameters; options whose p is not in (0, 1) are rejected by id, never priced.

    `tree` is the run's tree; where `cols` has a "tree" column (codes into TREE_NAMES, from a
    portfolio's tree column), each option with a code >= 0 uses that tree instead."""
    dt, log_up, log_down, p = _tree_parameters(cols, tree, ids)
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


def check_lattices(cols: dict, tree: str = "crr", ids: np.ndarray | None = None) -> None:
    """lattice_parameters' refusals (InputError by id), without building the parameters."""
    _tree_parameters(cols, tree, ids)


def _tree_parameters(cols: dict, tree: str, ids: np.ndarray | None):
    """(dt, log_up, log_down, p) of every option, each by its tree, checked."""
    n = int(np.shape(cols["steps"])[0])
    ids = ids if ids is not None else np.arange(n)
    default = TREE_NAMES.index(tree_named(tree).name)
    codes = np.asarray(cols["tree"], dtype=np.int64) if "tree" in cols else np.full(n, default)
    codes = np.where(codes < 0, default, codes)
    if n == 0 or (codes == codes[0]).all():
        dt, log_up, log_down, p = _parameters(cols, TREE_NAMES[int(codes[0]) if n else default], ids)
    else:
        present = np.unique(codes)
        dt, log_up, log_down, p = (np.empty(n) for _ in range(4))
        for code in present:
            rows = np.flatnonzero(codes == code)
            sub = {key: np.asarray(value)[rows] for key, value in cols.items()}
            dt[rows], log_up[rows], log_down[rows], p[rows] = _parameters(
                sub, TREE_NAMES[int(code)], ids[rows])
    return dt, log_up, log_down, p


def lattice_faults(cols: dict, tree: str = "crr") -> np.ndarray:
    """Per option, whether its lattice cannot be priced — the faults lattice_parameters refuses:
    too few steps for its tree, p outside (0, 1), d >= u, node prices beyond FP64's range.
    (Columns that are NaN or out of range come out as faults too.)"""
    n = int(np.shape(cols["steps"])[0])
    default = TREE_NAMES.index(tree_named(tree).name)
    codes = np.asarray(cols.get("tree", np.full(n, -1)), dtype=np.int64)
    codes = np.where(codes < 0, default, codes)
    faulty = np.zeros(n, dtype=bool)
    for code in np.unique(codes):
        rows = np.flatnonzero(codes == code)
        sub = {key: np.asarray(value)[rows] for key, value in cols.items()}
        _, masks = _conditions(sub, TREE_NAMES[int(code)])
        faulty[rows] = np.logical_or.reduce(masks)
    return faulty


def _conditions(cols: dict, name: str):
    """One tree's (dt, log_up, log_down, p) for the options in cols, and the masks of its faults in
    the order they are refused: too few steps, p outside (0, 1), u and d undefined, clamped node
    prices that could move the price (_clamp_matters)."""
    tree = TREES[name]
    few = np.asarray(cols["steps"]) < tree.min_steps
    with np.errstate(all="ignore"):
        dt, log_up, log_down, p = tree.probabilities(cols)
        no_p = ~((p > 0.0) & (p < 1.0))
        undefined = ~(np.isfinite(log_up) & np.isfinite(log_down) & (log_up > log_down))
        wide = _clamp_matters(cols, log_up, log_down, p)
    return (dt, log_up, log_down, p), (few, no_p, undefined, wide)


def _parameters(cols: dict, name: str, ids: np.ndarray):
    """One tree's (dt, log_up, log_down, p) for the options in cols, checked."""
    (dt, log_up, log_down, p), (few, bad, undefined, wide) = _conditions(cols, name)
    if few.any():
        raise InputError(f"the {name} tree needs steps >= {TREES[name].min_steps}; option id(s) "
                         f"{first_ids(ids, few)} have fewer (first value "
                         f"{int(np.asarray(cols['steps'])[few][0])})", column="steps",
                         ids=np.asarray(ids)[few])
    if bad.any():
        first = int(np.flatnonzero(bad)[0])
        raise InputError(
            f"the {name} lattice is not arbitrage-free for option id(s) {first_ids(ids, bad)}: "
            f"p = {float(p[first])!r} is outside (0, 1) "
            f"({_inputs(cols, first, 'rate', 'dividend', 'volatility', 'steps')}); "
            f"use more steps or check the inputs", ids=np.asarray(ids)[bad])
    if undefined.any():
        bad = undefined
        first = int(np.flatnonzero(bad)[0])
        raise InputError(
            f"the {name} lattice is undefined for option id(s) {first_ids(ids, bad)}: its up and "
            f"down factors are u = {float(np.exp(log_up[first]))!r}, d = "
            f"{float(np.exp(log_down[first]))!r} (need 0 < d < u; "
            f"{_inputs(cols, first, *INPUT_NAMES)})", ids=np.asarray(ids)[bad])
    if wide.any():
        _refuse_node_range(cols, name, ids, log_up, log_down, wide)
    return dt, log_up, log_down, p


INPUT_NAMES = ("spot", "strike", "rate", "dividend", "volatility", "maturity", "steps")


def _inputs(cols: dict, row: int, *names: str) -> str:
    """'rate 0.05, ..., steps 100': an option's inputs, as the refusals name them."""
    return ", ".join(f"{name} {int(cols[name][row])}" if name == "steps"
                     else f"{name} {float(cols[name][row])!r}" for name in names)


# Every engine prices node (t, i) at S0 e^{t ln d} x e^{i ln(u/d)}, from two tables; where either
# factor alone would leave FP64's range the engines move a factor between them, and where the node
# prices themselves do, they clamp the nodes beyond e^{+-EXACT_NODE_LOG} into the normal range
# (pricer/engines/cpu/kernels.py, node_tables). Clamped nodes change a put's values not at all
# and a call's only where the walk can reach them: lattice.py refuses an option only where that
# reach could move its price by 2^-1074 K (_clamp_matters).
PLAIN, CENTRED, CLAMPED = 0, 1, 2   # how the engines build a lattice's tables (node_tables)
NODE_LOG_LIMIT = 700.0     # the tables' exponents stay within +-this
CLAMP_SLACK = 8.0          # a clamped block's level factor stays within e^{+-this}
EXACT_NODE_LOG = NODE_LOG_LIMIT - CLAMP_SLACK
# -ln 2^-1074: a probability below e^-this times the price's scale is below FP64's least number
_NEGLIGIBLE_LOG = 1074.0 * math.log(2.0)


def _node_range(cols: dict, log_up, log_down):
    """ln S0, and ln of the highest and of the lowest node price."""
    steps = np.asarray(cols["steps"], dtype=np.float64)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        log_spot = np.log(np.asarray(cols["spot"], dtype=np.float64))
        top = log_spot + steps * np.maximum(log_up, 0.0)
        bottom = log_spot + steps * np.minimum(log_down, 0.0)
    return log_spot, top, bottom


def _clamp_matters(cols: dict, log_up, log_down, p) -> np.ndarray:
    """Options whose lattice has node prices beyond e^{+-EXACT_NODE_LOG} (clamped by the engines)
    that its walk may reach with a weight that counts: by Hoeffding's maximal inequality, the
    walk ln S_t = ln S0 + t m + (a martingale of steps within ln(u/d)) passes a level a above its
    mean's extreme with probability <= exp(-2 a^2 / (N ln(u/d)^2)). Under the risk-neutral p (a
    put's payoff K at the bottom) and the share measure p u / (p u + (1 - p) d) (a call's payoff
    ~S at the top), that bound times S0/K, e^{|r - q| T} must stay below 2^-1074."""
    steps = np.asarray(cols["steps"], dtype=np.float64)
    spot = np.asarray(cols["spot"], dtype=np.float64)
    # most books at once, without logarithms: ln S0 within +-299 and N |ln u|, N |ln d| <= 300
    near = ((steps * np.maximum(np.abs(log_up), np.abs(log_down)) <= 300.0)
            & (spot > 1e-130) & (spot < 1e130))
    if near.all():
        return ~near
    log_spot, top, bottom = _node_range(cols, log_up, log_down)
    reach = (top > EXACT_NODE_LOG) | (bottom < -EXACT_NODE_LOG) | ~np.isfinite(top + bottom)
    if not reach.any():
        return reach
    spread = log_up - log_down
    budget = (_NEGLIGIBLE_LOG + np.abs(log_spot - np.log(np.asarray(cols["strike"], np.float64)))
              + np.abs(np.asarray(cols["rate"]) - np.asarray(cols["dividend"]))
              * np.asarray(cols["maturity"]))
    share = p * np.exp(log_up) / (p * np.exp(log_up) + (1.0 - p) * np.exp(log_down))
    safe = np.ones(steps.shape, dtype=bool)
    for q in (p, share):
        drift = steps * (log_down + q * spread)
        above = EXACT_NODE_LOG - log_spot - np.maximum(drift, 0.0)
        below = EXACT_NODE_LOG + log_spot + np.minimum(drift, 0.0)
        room = np.minimum(above, below)
        safe &= (room > 0.0) & (2.0 * room * room >= budget * steps * spread * spread)
    return reach & ~safe


def _refuse_node_range(cols: dict, name: str, ids: np.ndarray, log_up, log_down, bad) -> None:
    steps = np.asarray(cols["steps"], dtype=np.float64)
    _, top, bottom = _node_range(cols, log_up, log_down)
    first = int(np.flatnonzero(bad)[0])
    raise InputError(
        f"the {name} lattice's node prices leave the FP64 range where its paths still carry "
        f"weight, for option id(s) {first_ids(ids, bad)}: over {int(steps[first])} steps its nodes "
        f"span e^{float(bottom[first]):.0f} to e^{float(top[first]):.0f}, and paths beyond "
        f"e^+-{EXACT_NODE_LOG:.0f} (where nodes are clamped) could move the price "
        f"({_inputs(cols, first, 'spot', 'strike', 'volatility', 'maturity')}); use fewer steps "
        f"or check the inputs", ids=np.asarray(ids)[bad])
