"""Scenario grids: every option repriced under every combination of shifts of its market data.

A grid has four axes, each a list of shifts (a single 0 where not given):

- spot: relative, S0 (1 + s)            - volatility: absolute, sigma + v
- rate: absolute, r + dr                - days: time passed, T - d / 365

and its scenarios are their Cartesian product, in the order of itertools.product(spot, volatility,
rate, days) (the last axis fastest). An option's scenario k is an option of its own, priced on its
own lattice with the option's N and tree, exactly as the book with that shifted row would be:
scenario prices are bitwise those of the explicitly expanded book on the same backend. The
Analytics of a run (pricer.model.greeks) carries the grid, so that the lattices per option, the
cost model, the memory guard and the checks count the scenarios with the rest.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

import numpy as np

from pricer.errors import InputError

AXES = ("spot", "volatility", "rate", "days")
DAYS_PER_YEAR = 365.0
MAX_SCENARIOS = 10_000


@dataclass(frozen=True)
class ScenarioGrid:
    spot: tuple = (0.0,)
    volatility: tuple = (0.0,)
    rate: tuple = (0.0,)
    days: tuple = (0.0,)

    @property
    def count(self) -> int:
        return math.prod(len(getattr(self, axis)) for axis in AXES)

    @property
    def shape(self) -> tuple:
        return tuple(len(getattr(self, axis)) for axis in AXES)

    def shifts(self) -> np.ndarray:
        """(count, 4): each scenario's shift on each axis, in scenario order (read-only: made
        once per grid, as every scenario's column and description reads it)."""
        return _shifts(tuple(getattr(self, axis) for axis in AXES))

    def columns(self, cols: dict) -> list[dict]:
        """The options of `cols` under each scenario, in scenario order."""
        return [self.column(cols, k) for k in range(self.count)]

    def column(self, cols: dict, k: int) -> dict:
        """The options of `cols` under scenario k."""
        spot, volatility, rate, days = self.shifts()[k]
        return dict(cols, spot=cols["spot"] * (1.0 + spot),
                    volatility=cols["volatility"] + volatility, rate=cols["rate"] + rate,
                    maturity=cols["maturity"] - days / DAYS_PER_YEAR)

    def describe(self, k: int) -> str:
        spot, volatility, rate, days = self.shifts()[k]
        return (f"scenario {k} (spot x (1 + {spot:g}), volatility + {volatility:g}, rate + "
                f"{rate:g}, {days:g} days passed)")

    def settings(self) -> dict:
        return {axis: list(getattr(self, axis)) for axis in AXES}


@functools.lru_cache(maxsize=8)
def _shifts(axes: tuple) -> np.ndarray:
    shifts = np.array(list(itertools.product(*axes)), dtype=np.float64).reshape(-1, len(AXES))
    shifts.flags.writeable = False
    return shifts


def parse_axis(value, name: str) -> tuple:
    """An axis as a tuple of floats: "a:b:n" (n points from a to b), "x,y,z", a number, or a list
    of numbers (a job file's array)."""
    try:
        if isinstance(value, str):
            text = value.strip()
            if text.count(":") == 2:
                first, last, count = text.split(":")
                count = int(count)
                if count < 1:
                    raise ValueError
                if count > MAX_SCENARIOS:
                    raise InputError(f"scenarios: {name} has {count} points; at most "
                                     f"{MAX_SCENARIOS} scenarios in all")
                points = np.linspace(float(first), float(last), count)
            else:
                points = [float(part) for part in text.split(",")]
        elif isinstance(value, (list, tuple)):
            if not value or any(isinstance(v, bool) or not isinstance(v, (int, float))
                                for v in value):
                raise ValueError
            points = [float(v) for v in value]
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            points = [float(value)]
        else:
            raise ValueError
    except (ValueError, TypeError):
        raise InputError(f"scenarios: {name} must be FIRST:LAST:COUNT (COUNT >= 1), a comma-"
                         f"separated list of numbers or an array of numbers, got {value!r}") \
            from None
    points = tuple(float(p) for p in points)
    if not all(math.isfinite(p) for p in points):
        raise InputError(f"scenarios: {name} has a value that is not finite: {value!r}")
    return points


def grid_of(scenarios: dict | None) -> ScenarioGrid | None:
    """The grid of a run's `scenarios` setting (axis -> value, parse_axis), or None; InputError
    for an unknown axis, a bad value or too many scenarios."""
    if not scenarios:
        return None
    if not isinstance(scenarios, dict):
        raise InputError(f"scenarios must be a table of axes ({', '.join(AXES)}), got "
                         f"{scenarios!r}")
    unknown = sorted(set(scenarios) - set(AXES))
    if unknown:
        raise InputError(f"scenarios: unknown axis {', '.join(map(str, unknown))}; the axes are "
                         f"{', '.join(AXES)}")
    grid = ScenarioGrid(**{axis: parse_axis(value, axis) for axis, value in scenarios.items()})
    if grid.count > MAX_SCENARIOS:
        raise InputError(f"scenarios: {grid.count} scenarios ({' x '.join(map(str, grid.shape))});"
                         f" at most {MAX_SCENARIOS}")
    return grid
