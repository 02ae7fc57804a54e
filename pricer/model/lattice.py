"""Per-option lattice parameters for each tree type, vectorised over the portfolio.

Tree types are small policy objects (as in QuantLib): they turn an option's market data and N into
the numbers every engine consumes — log up/down factors and discounted branch probabilities. The
engines never see the tree type, so a new tree needs no new kernel.

Node (t, i) (t steps taken, i of them up) has asset price S0 * exp(t*log_down + i*(log_up - log_down)).
Backward step: V(t, i) = pu * V(t+1, i+1) + pd * V(t+1, i), with pu = disc*p, pd = disc*(1-p);
American options take max(hold, exercise) at every node, t = 0 included.

The trees themselves (`crr`, the textbook Cox–Ross–Rubinstein tree and the default, and QuantLib's)
are in pricer/model/trees.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np

from pricer.errors import InputError, first_ids
# the trees live in trees.py; their registry is named here too, where the parameters are built
from pricer.model.trees import TREE_NAMES, TREES, tree_codes, tree_named  # noqa: F401


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


def lattice_parameters(cols: dict, tree: str = "crr", ids: np.ndarray | None = None) -> LatticeParams:
    """Per-option parameters; options whose p is not in (0, 1) are rejected by id, never priced.

    `tree` is the run's tree; where `cols` has a "tree" column (codes into TREE_NAMES, from a
    portfolio's tree column), each option with a code >= 0 uses that tree instead."""
    return _built(cols, *_tree_parameters(cols, tree, ids))


def _built(cols: dict, dt, log_up, log_down, p) -> LatticeParams:
    disc = np.exp(-np.asarray(cols["rate"]) * dt)
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


def lattice_parameters_where(cols: dict, tree: str = "crr"):
    """(params, exists): lattice_parameters of the options whose lattice exists (no fault that
    lattice_parameters refuses), and whether each one's does. An option's parameters are those
    lattice_parameters gives it."""
    (dt, log_up, log_down, p), exists = _by_tree(cols, tree)
    if not exists.all():
        cols = {key: np.asarray(value)[exists] for key, value in cols.items()}
        dt, log_up, log_down, p = dt[exists], log_up[exists], log_down[exists], p[exists]
    return _built(cols, dt, log_up, log_down, p), exists


def _by_tree(cols: dict, tree: str):
    """Every option's (dt, log_up, log_down, p) by its tree, and whether its lattice exists."""
    n = int(np.shape(cols["steps"])[0])
    codes = _codes(cols, tree)
    dt, log_up, log_down, p = (np.empty(n) for _ in range(4))
    exists = np.ones(n, dtype=bool)
    one = n == 0 or bool((codes == codes[0]).all())
    for code in codes[:1] if one else np.unique(codes):
        rows = slice(None) if one else np.flatnonzero(codes == code)
        sub = cols if isinstance(rows, slice) else {k: np.asarray(v)[rows] for k, v in cols.items()}
        (dt[rows], log_up[rows], log_down[rows], p[rows]), faults = \
            _conditions(sub, TREE_NAMES[int(code)])
        exists[rows] = ~np.logical_or.reduce(faults)
    return (dt, log_up, log_down, p), exists


def spot_free(cols: dict, tree: str) -> bool:
    """Whether every option's tree ignores the spot (trees' spot_free)."""
    return all(TREES[TREE_NAMES[int(code)]].spot_free for code in np.unique(_codes(cols, tree)))


def _codes(cols: dict, tree: str) -> np.ndarray:
    """Each option's tree code: its tree column's, else (absent or < 0) the run's `tree`."""
    n = int(np.shape(cols["steps"])[0])
    default = TREE_NAMES.index(tree_named(tree).name)
    codes = np.asarray(cols["tree"], dtype=np.int64) if "tree" in cols else np.full(n, default)
    return np.where(codes < 0, default, codes)


def check_lattices(cols: dict, tree: str = "crr", ids: np.ndarray | None = None) -> None:
    """lattice_parameters' refusals (InputError by id), without building the parameters."""
    _tree_parameters(cols, tree, ids)


def _tree_parameters(cols: dict, tree: str, ids: np.ndarray | None):
    """(dt, log_up, log_down, p) of every option, each by its tree, checked."""
    n = int(np.shape(cols["steps"])[0])
    ids = ids if ids is not None else np.arange(n)
    if "tree" not in cols:         # every option the run's tree
        return _parameters(cols, tree_named(tree).name, ids)
    codes = _codes(cols, tree)
    if n == 0 or (codes == codes[0]).all():
        name = TREE_NAMES[int(codes[0])] if n else tree_named(tree).name
        dt, log_up, log_down, p = _parameters(cols, name, ids)
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
    return ~_by_tree(cols, tree)[1]


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
