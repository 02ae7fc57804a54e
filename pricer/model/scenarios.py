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

ScenarioLattices are a grid's lattices for a set of options, made on demand: an engine builds
them a range of scenarios at a time (Engine.price_lattices), or, where every option's tree ignores
the spot (SharedNumbers), reads each lattice's numbers from those of its volatility, rate and days
shifts and multiplies its spot as it fills its input (the GPU batch runner).
"""

from __future__ import annotations

import copy
import functools
import itertools
import math
from dataclasses import dataclass, replace

import numpy as np

from pricer.errors import InputError
from pricer.model.lattice import PACKED_FIELDS, LatticeParams, lattice_parameters, spot_free

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
        return shifted(cols, self.shifts()[k])

    def describe(self, k: int) -> str:
        spot, volatility, rate, days = self.shifts()[k]
        return (f"scenario {k} (spot x (1 + {spot:g}), volatility + {volatility:g}, rate + "
                f"{rate:g}, {days:g} days passed)")

    def settings(self) -> dict:
        return {axis: list(getattr(self, axis)) for axis in AXES}


def shifted(cols: dict, shift) -> dict:
    """The options of `cols` under one scenario's shifts (spot, volatility, rate, days): its spot
    cols["spot"] * (1 + spot shift), as SharedNumbers multiplies it too."""
    spot, volatility, rate, days = shift
    return dict(cols, spot=cols["spot"] * (1.0 + spot), volatility=cols["volatility"] + volatility,
                rate=cols["rate"] + rate, maturity=cols["maturity"] - days / DAYS_PER_YEAR)


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
                with np.errstate(over="ignore", invalid="ignore"):   # refused below, in a line
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
        spacing = isinstance(value, str) and text.count(":") == 2 and \
            all(math.isfinite(float(end)) for end in (first, last))
        raise InputError(f"scenarios: {name} has a value that is not finite: {value!r}"
                         + (" (the spacing of its points overflows)" if spacing else ""))
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


@dataclass(frozen=True)
class SharedNumbers:
    """Scenario lattices whose numbers ignore the spot, without their rows written out: lattice
    k n + i (option i of n under scenario k) is row sets[k] n + i of `numbers`, its spot
    spot[i] * factors[k]. That product is ScenarioGrid.column's, and the numbers are those of the
    shifted row's own lattice parameters (its tree ignores the spot): each lattice is bitwise the
    explicitly expanded book's row. `numbers` holds one set of n rows per distinct volatility, rate
    and days shift."""
    numbers: LatticeParams   # (len(set of shifts) * n rows)
    spot: np.ndarray         # (n,) the options' own spots
    factors: np.ndarray      # (scenarios,) 1 + each scenario's spot shift
    sets: np.ndarray         # (scenarios,) int64: each scenario's set of numbers

    def __len__(self) -> int:
        return self.spot.size * self.sets.size

    def take(self, index) -> LatticeParams:
        """The lattices `index` (rows of the expansion) written out."""
        index = np.asarray(index, dtype=np.int64)
        n = self.spot.size
        k, i = np.divmod(index, n)
        rows = self.sets[k] * n + i
        return LatticeParams(**{name: (self.spot[i] * self.factors[k] if name == "spot"
                                       else getattr(self.numbers, name)[rows])
                                for name in PACKED_FIELDS})


class ScenarioLattices:
    """The lattices of the n options of `cols` under every scenario of `grid`, scenario after
    scenario (lattice k n + i: option i under scenario k), made on demand; with `base`, the
    options' own lattices first, as a scenario without shifts (the same bits: x (1 + 0), x + 0
    and T - 0 / 365 are x). build(lo, hi) writes out scenarios lo .. hi - 1; `shared` (a
    SharedNumbers, or None) is set where every option's tree ignores the spot
    (trees.spot_free), whose scenarios that differ only in spot share one set of numbers,
    computed here once per volatility, rate and days shift."""

    def __init__(self, cols: dict, grid: ScenarioGrid, tree: str, ids: np.ndarray,
                 base: bool = False):
        self.cols, self.tree, self.ids, self.base = cols, tree, np.asarray(ids), base
        shifts = grid.shifts()
        self.shifts = np.concatenate([np.zeros((1, len(AXES))), shifts]) if base else shifts
        self.options, self.scenarios = int(np.shape(cols["spot"])[0]), len(self.shifts)
        self.shared = self._shared() if spot_free(cols, tree) else None

    def __len__(self) -> int:
        return self.options * self.scenarios

    def without_base(self) -> "ScenarioLattices":
        """The grid's scenarios alone (the options' own lattices left out), sharing these
        numbers."""
        if not self.base:
            return self
        rest = copy.copy(self)
        rest.base, rest.shifts, rest.scenarios = False, self.shifts[1:], self.scenarios - 1
        if self.shared is not None:
            rest.shared = replace(self.shared, factors=self.shared.factors[1:],
                                  sets=self.shared.sets[1:])
        return rest

    def build(self, lo: int, hi: int) -> LatticeParams:
        """The lattice parameters of scenarios lo .. hi - 1, scenario after scenario."""
        if self.shared is not None:
            return self.shared.take(np.arange(lo * self.options, hi * self.options))
        return self._parameters(range(lo, hi))

    def _parameters(self, scenarios) -> LatticeParams:
        parts = [shifted(self.cols, self.shifts[k]) for k in scenarios]
        every = {key: np.concatenate([part[key] for part in parts]) for key in parts[0]}
        return lattice_parameters(every, self.tree, ids=np.tile(self.ids, len(parts)))

    def _shared(self) -> SharedNumbers:
        """Each distinct volatility, rate and days shift's numbers, from its first scenario's
        rows (lattice_parameters, in one call: the same expressions as the expanded book's
        rows)."""
        keys: dict = {}
        sets = np.array([keys.setdefault(tuple(row[1:]), len(keys)) for row in self.shifts],
                        dtype=np.int64)
        numbers = self._parameters([int(np.argmax(sets == s)) for s in range(len(keys))])
        return SharedNumbers(numbers, np.ascontiguousarray(self.cols["spot"], dtype=np.float64),
                             1.0 + self.shifts[:, 0], sets)
