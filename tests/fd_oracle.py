"""A plain NumPy reference of the finite-difference method (pricer/model/fd.py), one option at a
time: the theta-scheme in its value form, (I - theta A) u^{n+1} = (I + (1 - theta) A) u^n, with the
whole J x J matrices (the ends' rows the Dirichlet values) solved by np.linalg.solve, so that it
shares neither the change form nor the Thomas sweeps with the engines; American by the same
Ikonen–Toivanen splitting (explicit: the payoff's maximum)."""

from __future__ import annotations

import numpy as np

from pricer.model import fd


def _operator(params, k: int, dt: float) -> np.ndarray:
    """A = dt L on option k's nodes (the ends' rows zero)."""
    J = int(params.space[k])
    al, be, r = float(params.alpha[k]), float(params.beta[k]), float(params.rate[k])
    A = np.zeros((J, J))
    for j in range(1, J - 1):
        A[j, j - 1], A[j, j], A[j, j + 1] = dt * (al - be), -dt * (2 * al + r), dt * (al + be)
    return A


def _march(params, k, u, lam, g, A, th, dt, tau, american):
    J = u.size
    rhs = u + (1.0 - th) * (A @ u)
    lo, hi = fd.boundaries(params, k, tau)
    if th == 0.0:
        v = rhs
        v[0], v[-1] = lo, hi
        return (np.maximum(v, g) if american else v), lam
    if american:
        rhs = rhs + dt * lam
    M = np.eye(J) - th * A
    rhs[0], rhs[-1] = lo, hi
    tilde = np.linalg.solve(M, rhs)
    if not american:
        return tilde, lam
    v = np.maximum(tilde - dt * lam, g)
    lam = np.maximum(0.0, lam + (g - tilde) / dt)
    v[0], v[-1] = lo, hi
    lam[0] = lam[-1] = 0.0
    return v, lam


def values(params, k: int):
    """(u[j0 - 1], u[j0], u[j0 + 1], u[j0] a step before the last) of option k."""
    M, dt, th = int(params.steps[k]), float(params.dt[k]), params.theta
    american = bool(params.american[k])
    g, u = fd.payoff(params, k), fd.start(params, k)
    lam = np.zeros_like(u)
    A, half = _operator(params, k, dt), _operator(params, k, 0.5 * dt)
    j0, before, tau = int(params.j0[k]), u[int(params.j0[k])], 0.0
    for n in range(M):
        before = u[j0]
        if th == 0.5 and n < fd.RANNACHER_STEPS:
            for _ in range(2):
                tau += 0.5 * dt
                u, lam = _march(params, k, u, lam, g, half, 1.0, 0.5 * dt, tau, american)
        else:
            tau = (n + 1) * dt
            u, lam = _march(params, k, u, lam, g, A, th, dt, tau, american)
    return u[j0 - 1], u[j0], u[j0 + 1], before
