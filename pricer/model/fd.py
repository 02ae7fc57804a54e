"""Finite differences for the option book: the Black–Scholes PDE on a uniform grid in log-spot,
marched in time to maturity (Giles, László, Reguly, Appleyard and Demouth (2014)), as per-option
numbers every engine of the method consumes (FdParams), with its refusals.

In x = ln S and the time to maturity tau, V_tau = s2/2 V_xx + mu V_x - r V with mu = r - q - s2/2
(s2 = sigma^2). On the nodes x_j = x_min + j h, j = 0 .. J-1, central differences give
    (L u)_j = (alpha - beta) u_{j-1} - (2 alpha + r) u_j + (alpha + beta) u_{j+1},
    alpha = s2 / (2 h^2), beta = mu / (2 h),
and with dt = T / M the paper's coefficients a = dt (alpha - beta), b = -dt (2 alpha + r),
c = dt (alpha + beta), constant over the grid and over time. A step of the theta-scheme solves
(I - theta A) du = A u^n (the change du = u^{n+1} - u^n, the paper's implicit2 form; A = dt L):
theta 0 is explicit, 1 fully implicit, 1/2 Crank–Nicolson, whose first RANNACHER_STEPS steps are
each two fully implicit half steps (Rannacher (1984): the payoff's kink does not ring).

The grid (GridPolicy): the spot on node j0 = J // 2, so that the price is a node's value and delta
and gamma the node's central differences; the nodes reach WIDTH standard deviations sigma sqrt(T)
and the drift |mu| T beyond both the spot and the strike on each side, so that the Dirichlet
values at the ends (below) are the price's to within the probability that the log-price moves
further than WIDTH sd, Phi(-WIDTH) ~ 1e-9 of the payoff's scale for WIDTH = 6. The ends hold, at
each tau, the value far from the strike: a call 0 at x_min and S e^{-q tau} - K e^{-r tau} at
x_max (American: at least S - K), a put K e^{-r tau} - S e^{-q tau} at x_min (American: at least
K - S) and 0 at x_max. The node nearest the strike takes the payoff's average over its cell
[x_j - h/2, x_j + h/2] (a kink between nodes would cost the second order: Pooley, Vetzal and
Forsyth (2003)); the other nodes take the payoff itself.

American exercise (explicit: the payoff's maximum after each step; implicit: Ikonen and Toivanen
(2004)'s operator splitting, each step one tridiagonal solve with the multiplier lambda >= 0,
    (I - theta A) du = A u^n + dt lambda^n,  u~ = u^n + du,
    u^{n+1} = max(u~ - dt lambda^n, g),  lambda^{n+1} = max(0, lambda^n + (g - u~) / dt),
g the payoff on the nodes: the tridiagonal structure stays, so the GPU's hybrid solver serves it).

Refused by id (fd_faults, in their order): fewer than MIN_SPACE_STEPS nodes; a grid too coarse for
its drift, |mu| h > s2 (a or c < 0: the scheme would not keep prices monotone; more space_steps
mend it, the message says how many); with the explicit scheme, a step beyond its stability bound,
dt (s2 / h^2 + r) > 1 (the message names the fewest steps that keep it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numba import njit

from pricer import numba_cache  # noqa: F401  (where pricer's kernels below are cached)
from pricer.errors import InputError, first_ids

SPACE_STEPS = 256          # the run's default J (the paper's grid: 32 threads x 8 nodes)
MIN_SPACE_STEPS = 8        # the spot's node and its neighbours away from the ends
MAX_SPACE_STEPS = 1 << 16
WIDTH = 6.0                # standard deviations of the grid beyond the spot and the strike
RANNACHER_STEPS = 2        # Crank–Nicolson's first steps, each two fully implicit half steps
SCHEMES = {"explicit": 0.0, "implicit": 1.0, "crank-nicolson": 0.5}
SCHEME = "crank-nicolson"


@dataclass(frozen=True)
class FdParams:
    """Per option (struct of arrays, float64 unless noted) what every engine of the method needs:
    the grid (x_min, h, space int64, the spot's node j0 int64), the time steps (steps int64, dt),
    the operator's coefficients per unit dt (alpha, beta, rate, dividend) and the payoff (strike,
    call, american bool). theta is the run's scheme, RANNACHER_STEPS applying where theta = 1/2."""
    x_min: np.ndarray
    h: np.ndarray
    space: np.ndarray
    j0: np.ndarray
    steps: np.ndarray
    dt: np.ndarray
    alpha: np.ndarray
    beta: np.ndarray
    rate: np.ndarray
    dividend: np.ndarray
    strike: np.ndarray
    call: np.ndarray
    american: np.ndarray
    theta: float

    def __len__(self) -> int:
        return int(self.steps.size)


@dataclass(frozen=True)
class Grid:
    """The nodes of each option: x_min, h, J (space) and the spot's node j0."""
    x_min: np.ndarray
    h: np.ndarray
    space: np.ndarray
    j0: np.ndarray


def grid(cols: dict, space=SPACE_STEPS) -> Grid:
    """The options' grids (module doc): J = `space` nodes (a number, or one per option), the spot
    on node J // 2, h such that both sides reach WIDTH sd and the drift beyond the spot and the
    strike."""
    spot, strike = np.asarray(cols["spot"], np.float64), np.asarray(cols["strike"], np.float64)
    sigma, t = np.asarray(cols["volatility"], np.float64), np.asarray(cols["maturity"], np.float64)
    mu = np.asarray(cols["rate"], np.float64) - np.asarray(cols["dividend"], np.float64) \
        - 0.5 * sigma * sigma
    J = np.broadcast_to(np.asarray(space, dtype=np.int64), spot.shape).copy()
    j0 = J // 2
    x0 = np.log(spot)
    with np.errstate(all="ignore"):
        reach = WIDTH * sigma * np.sqrt(t) + np.abs(mu) * t + np.abs(np.log(strike) - x0)
        # the shorter side (J - 1 - j0 nodes above the spot, j0 >= that below) reaches `reach`
        h = reach / np.maximum(J - 1 - j0, 1)
    return Grid(x0 - j0 * h, h, J, j0)


def parameters(cols: dict, scheme: str = SCHEME, space=SPACE_STEPS,
               on: Grid | None = None) -> FdParams:
    """FdParams of the options in `cols`, checked (fd_faults' refusals by id, InputError). `on`:
    the grids to use instead of the options' own (--greeks' bumped copies share the option's, so
    that a bump moves the price and not the grid)."""
    g = on if on is not None else grid(cols, space)
    steps = np.asarray(cols["steps"], dtype=np.int64)
    sigma = np.asarray(cols["volatility"], np.float64)
    rate, dividend = np.asarray(cols["rate"], np.float64), np.asarray(cols["dividend"], np.float64)
    with np.errstate(all="ignore"):
        s2 = sigma * sigma
        params = FdParams(
            x_min=g.x_min, h=g.h, space=g.space, j0=g.j0, steps=steps,
            dt=np.asarray(cols["maturity"], np.float64) / steps,
            alpha=s2 / (2.0 * g.h * g.h), beta=(rate - dividend - 0.5 * s2) / (2.0 * g.h),
            rate=rate, dividend=dividend, strike=np.asarray(cols["strike"], np.float64),
            call=np.asarray(cols["call"], dtype=bool), american=np.asarray(cols["american"], bool),
            theta=SCHEMES[scheme])
    _refuse(params, cols, np.asarray(cols.get("id", np.arange(steps.size))))
    return params


def fd_faults(params: FdParams) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per option, in the order they are refused: too few nodes (or too many), a grid too coarse
    for its drift (|beta| > alpha), an explicit step beyond the stability bound."""
    with np.errstate(all="ignore"):
        nodes = (params.space < MIN_SPACE_STEPS) | (params.space > MAX_SPACE_STEPS) | \
            ~(np.isfinite(params.h) & (params.h > 0.0))
        coarse = ~(np.abs(params.beta) <= params.alpha)
        unstable = ~(params.dt * (2.0 * params.alpha + params.rate) <= 1.0) \
            if params.theta == 0.0 else np.zeros(params.steps.shape, dtype=bool)
    return nodes, coarse & ~nodes, unstable & ~nodes & ~coarse


def _refuse(params: FdParams, cols: dict, ids: np.ndarray) -> None:
    nodes, coarse, unstable = fd_faults(params)
    if nodes.any():
        raise InputError(f"option id(s) {first_ids(ids, nodes)} have a finite-difference grid of "
                         f"{int(params.space[nodes][0])} nodes: it needs "
                         f"{MIN_SPACE_STEPS} to {MAX_SPACE_STEPS} (space_steps)",
                         column="space_steps", ids=ids[nodes])
    if coarse.any():
        k = int(np.flatnonzero(coarse)[0])
        need = _space_for_drift(params, k)
        raise InputError(
            f"option id(s) {first_ids(ids, coarse)} have a finite-difference grid too coarse for "
            f"their drift (|r - q - sigma^2/2| h > sigma^2, first h = {float(params.h[k]):.3g}): "
            f"prices would oscillate; use space_steps >= {need}", column="space_steps",
            ids=ids[coarse])
    if unstable.any():
        k = int(np.flatnonzero(unstable)[0])
        t = float(params.dt[k] * params.steps[k])
        need = math.floor(t * (2.0 * float(params.alpha[k]) + float(params.rate[k]))) + 1
        raise InputError(
            f"option id(s) {first_ids(ids, unstable)} are beyond the explicit scheme's stability "
            f"bound dt (sigma^2/h^2 + r) <= 1 (first: {int(params.steps[k])} steps, it needs "
            f">= {need}); use more steps or an implicit scheme", column="steps",
            ids=ids[unstable])


def _space_for_drift(params: FdParams, k: int) -> int:
    """The fewest nodes that make option k's grid fine enough for its drift: h <= s2 / |mu|."""
    s2 = 2.0 * float(params.alpha[k]) * float(params.h[k]) ** 2
    mu = 2.0 * float(params.beta[k]) * float(params.h[k])
    span = float(params.h[k]) * float(params.space[k] - 1 - params.j0[k])   # the shorter side
    return 2 * math.ceil(span * abs(mu) / s2) + 2


def nodes(params: FdParams, k: int) -> np.ndarray:
    """Option k's nodes x_j."""
    return params.x_min[k] + np.arange(int(params.space[k])) * params.h[k]


def payoff(params: FdParams, k: int) -> np.ndarray:
    """Option k's payoff on its nodes (exercise values: the American obstacle g)."""
    s = np.exp(nodes(params, k))
    return np.maximum(s - params.strike[k], 0.0) if params.call[k] else \
        np.maximum(params.strike[k] - s, 0.0)


def start(params: FdParams, k: int) -> np.ndarray:
    """Option k's values at tau = 0: the payoff, the node nearest the strike its cell average."""
    u = payoff(params, k)
    x, h, K = nodes(params, k), float(params.h[k]), float(params.strike[k])
    j = int(np.rint((math.log(K) - float(params.x_min[k])) / h))
    if 0 < j < u.size - 1:
        u[j] = cell_average(float(x[j]), h, K, bool(params.call[k]))
    return u


@njit(cache=True, nogil=True)
def cell_average(x: float, h: float, strike: float, call: bool) -> float:
    """(1/h) times the integral of the payoff over [x - h/2, x + h/2] in log-spot."""
    lo, hi, k = x - 0.5 * h, x + 0.5 * h, math.log(strike)
    if call:
        a = max(lo, k)
        return (math.exp(hi) - math.exp(a) - strike * (hi - a)) / h if hi > k else 0.0
    b = min(hi, k)
    return (strike * (b - lo) - (math.exp(b) - math.exp(lo))) / h if lo < k else 0.0


@njit(cache=True, nogil=True)
def end_values(call: bool, american: bool, strike: float, rate: float, dividend: float,
               s_lo: float, s_hi: float, tau: float) -> tuple:
    """An option's values at its lowest and highest node (spots s_lo, s_hi) at time to maturity
    tau (module doc)."""
    dr, dq = math.exp(-rate * tau), math.exp(-dividend * tau)
    if call:
        hi = s_hi * dq - strike * dr
        return 0.0, max(hi, s_hi - strike) if american else hi
    lo = strike * dr - s_lo * dq
    return (max(lo, strike - s_lo) if american else lo), 0.0


def boundaries(params: FdParams, k: int, tau: float) -> tuple[float, float]:
    """Option k's values at its lowest and highest node at time to maturity tau."""
    s_lo = math.exp(float(params.x_min[k]))
    s_hi = math.exp(float(params.x_min[k]) + (int(params.space[k]) - 1) * float(params.h[k]))
    return end_values(bool(params.call[k]), bool(params.american[k]), float(params.strike[k]),
                      float(params.rate[k]), float(params.dividend[k]), s_lo, s_hi, tau)
