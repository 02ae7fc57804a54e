"""The engine interface, the registry of backends, and the one routing combinator.

An engine prices lattices: `price(params, levels=None)` takes a LatticeParams (pricer.model.lattice)
and returns one float64 price per option, in the order given; with `levels` ((n, LEVEL_VALUES)
float64) it also writes each option's first levels' values (for the Greeks). Engines never see ids,
files or MPI.

`price_lattices(lattices)` prices lattices made on demand (a scenario grid's,
pricer.model.scenarios.ScenarioLattices): by default a range of them at a time, each range built
on a thread while the engine prices the one before; an engine that can read them in place
overrides it. Besides pricing, an engine says what the run needs to know about it:

- `uses_gpu`: whether it drives a GPU (then the run measures the rank's GPU and fits it);
- `warm_up()`: work done while rank 0 reads the input (compiling, loading kernels);
- `prepare(steps, levels)`: the one-time set-up for a rank's share, timed as the `setup` stage;
- `device_info()`: the rank's GPU as the engine measures it (a DeviceInfo), `device_need(steps,
  cuts, analytics)`: the device bytes a share needs (a DeviceNeed), and `fit_device(chunk_options)`,
  which applies the options per chunk `DeviceNeed.fit` chose for the rank's budget.

A backend is one module with an Engine subclass and one `register(name, {(family, method):
factory})` call; the
factories of the built-in backends are at the end of pricer/engines/__init__.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pricer.errors import InputError
from pricer.model.lattice import (CENTRED, CLAMPED, LEVEL_VALUES, PLAIN, LatticeParams,
                                  lattice_parameters)


# Engine.price_lattices' calls: at least this many lattices each, built on this many threads
LATTICE_CALL_ROWS = 1 << 16
LATTICE_THREADS = 8


def sample_params(steps) -> LatticeParams:
    """American puts, S = K = 100, T = 1, r = 1 %, sigma = 20 %, on crr with these steps: what a
    warm_up prices so that the kernels a book needs are compiled or loaded before the book."""
    steps = np.asarray(steps, dtype=np.int64)
    count = steps.size
    cols = dict(spot=np.full(count, 100.0), strike=np.full(count, 100.0),
                maturity=np.ones(count), rate=np.full(count, 0.01), dividend=np.zeros(count),
                volatility=np.full(count, 0.2), steps=steps, call=np.zeros(count, bool),
                american=np.ones(count, bool))
    return lattice_parameters(cols, "crr")


class Engine:
    """The base of every engine (see the module doc)."""

    name = "engine"
    uses_gpu = False
    # whether the engine picks its device by each call's size (`auto`): the options' own lattices
    # then go in a call of their own, so that their prices do not depend on the analytics asked
    sizes_by_call = False

    def price(self, params: LatticeParams, levels: np.ndarray | None = None) -> np.ndarray:
        raise NotImplementedError

    def start(self, params):
        """Begin pricing `params` and return a handle for finish(); an engine that works beside
        its caller (a GPU's kernels) returns at once, so that the caller can prepare and start the
        next call meanwhile. A caller has at most two calls started and not finished. Once it
        returns, the engine no longer reads `params` (the caller may reuse their storage), unless
        its start() says otherwise. By default the pricing is done here."""
        return self.price(params)

    def finish(self, started) -> np.ndarray:
        """The prices of a start()ed call, in the order given."""
        return started

    def price_rows(self, params: LatticeParams, rows: np.ndarray,
                   levels: np.ndarray | None = None) -> np.ndarray:
        """Prices of options `rows` of params, in that order (an engine that can read rows in
        place, without a copy of their parameters, overrides this)."""
        return self.price(params.take(rows), levels)

    def price_lattices(self, lattices) -> np.ndarray:
        """Prices of `lattices` (len(): their count; `options` per scenario, `scenarios`;
        build(lo, hi): the LatticeParams of scenarios lo .. hi - 1), in order: in calls of at
        least LATTICE_CALL_ROWS lattices (whole scenarios), each call's parameters built on one
        of up to LATTICE_THREADS threads (no more than numba's) while the engine prices the one
        before."""
        per_call = max(1, LATTICE_CALL_ROWS // max(lattices.options, 1))
        calls = [(lo, min(lo + per_call, lattices.scenarios))
                 for lo in range(0, lattices.scenarios, per_call)]
        if len(calls) == 1:
            return self.price(lattices.build(*calls[0]))
        import numba
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=min(LATTICE_THREADS, len(calls),
                                                numba.get_num_threads())) as pool:
            built = [pool.submit(lattices.build, lo, hi) for lo, hi in calls]
            return np.concatenate([self.price(params.result()) for params in built])

    def warm_up(self) -> None:
        """Work worth doing before the input is read (nothing by default)."""

    def prepare(self, steps: np.ndarray, levels: bool = False) -> None:
        """One-time set-up for options with these steps (nothing by default)."""

    def device_need(self, steps: np.ndarray, cuts: np.ndarray, analytics) -> "DeviceNeed | None":
        """The device bytes of a share priced in engine calls of rows cuts[j]:cuts[j+1]; None for an
        engine that uses no GPU."""
        return None

    def fit_device(self, chunk_options: int) -> None:
        """Options per chunk of the engine's device buffers, as DeviceNeed.fit chose them for the
        rank's budget (0: as they are)."""

    def device_info(self) -> "DeviceInfo | None":
        """The rank's GPU as measured in the engine's context; None for an engine without one."""
        return None


@dataclass
class DeviceInfo:
    """A rank's GPU as measured once its engine has started."""
    free: float    # bytes free
    total: float
    device: str    # host and PCI bus id: ranks with the same one share the GPU
    name: str


@dataclass
class DeviceNeed:
    """One rank's device bytes for its share, as an engine allocates them."""
    held: float = 0.0      # whatever the streaming: e.g. the widest option's own arrays
    held_row: int = -1     # the share's row whose lattice sets `held` (-1: none)
    held_steps: int = 0
    held_what: str = ""    # what those bytes are, for a refusal's message
    streamed: float = 0.0  # the streamed buffers as the engine is set now
    unit: float = 0.0      # bytes per option of a chunk of the streamed buffers

    @property
    def total(self) -> float:
        return self.held + self.streamed

    @property
    def least(self) -> float:
        """The streamed buffers at their finest (one option per chunk)."""
        return self.unit if self.streamed else 0.0

    def fit(self, budget: float) -> int | None:
        """The options per chunk that fit `budget` bytes: 0 if the engine fits as it is; None if
        even one option per chunk does not fit."""
        if self.total == 0 or self.total <= budget:   # nothing on the GPU fits any budget
            return 0
        if self.held + self.least > budget:
            return None
        return max(1, int((budget - self.held) // self.unit))


@dataclass(frozen=True)
class Route:
    """Options of `above` < steps <= `most` (None: no bound) whose node tables are of one of
    `kinds` (pricer.model.lattice: PLAIN, CENTRED, CLAMPED) go to `engine` (an Engine, or a
    function that makes it at first use)."""
    engine: object
    most: int | None = None
    above: int = 0
    kinds: tuple = (PLAIN, CENTRED, CLAMPED)

    def accepts(self, steps: np.ndarray, kinds: np.ndarray | None = None) -> np.ndarray:
        """Which options it takes; `kinds` None: every option PLAIN."""
        mask = steps > self.above
        mask = mask if self.most is None else mask & (steps <= self.most)
        if kinds is None:
            return mask if PLAIN in self.kinds else np.zeros_like(mask)
        return mask & np.isin(kinds, self.kinds)

    def takes_kinds(self, kinds: np.ndarray | None) -> bool:
        """Whether it takes options of every kind in `kinds` (None: all PLAIN)."""
        if kinds is None:
            return PLAIN in self.kinds
        return len(self.kinds) == 3 or bool(np.isin(kinds, self.kinds).all())

    def takes_any(self, least: int, most: int) -> bool:
        """Whether some steps of [least, most] are in this route's range (above, self.most]."""
        top = most if self.most is None else min(most, self.most)
        return max(least, self.above + 1) <= top

    def takes_all(self, least: int, most: int) -> bool:
        return self.above < least and (self.most is None or most <= self.most)


def sole_engine(steps: np.ndarray, routes: list, kinds: np.ndarray | None = None):
    """The engine that route() hands every option of `steps` to as they are, or None where it
    splits them between routes (or none takes them)."""
    if steps.size == 0:
        return None
    least, most = int(steps.min()), int(steps.max())
    for r in routes:
        if not r.takes_any(least, most):
            continue
        if r.takes_all(least, most) and r.takes_kinds(kinds):
            return r.engine if isinstance(r.engine, Engine) else r.engine()
        if r.accepts(steps, kinds).any():
            return None
    return None


def route(params: LatticeParams, routes: list, levels: np.ndarray | None = None,
          kinds: np.ndarray | None = None) -> np.ndarray:
    """Prices of params through `routes`: each option goes to the first route that accepts it (the
    routes together should accept every option); `kinds`: each option's node tables (None: all
    PLAIN). A route that takes every option gets params as they are (decided from the steps' range
    and the kinds alone); the others get their rows (Engine.price_rows), and their prices and
    levels are scattered back."""
    steps = params.steps
    out = np.empty(steps.size)
    if steps.size == 0:
        return out
    least, most = int(steps.min()), int(steps.max())
    left = None                                  # None: every row
    for r in routes:
        if not r.takes_any(least, most):
            continue
        engine = r.engine if isinstance(r.engine, Engine) else r.engine()
        if left is None and r.takes_all(least, most) and r.takes_kinds(kinds):
            return engine.price(params, levels)
        if left is None:
            mask = r.accepts(steps, kinds)
        else:
            mask = r.accepts(steps[left], None if kinds is None else kinds[left])
        if not mask.any():
            continue
        rows = np.flatnonzero(mask) if left is None else left[mask]
        part = None if levels is None else np.empty((rows.size, LEVEL_VALUES))
        out[rows] = engine.price_rows(params, rows, part)
        if levels is not None:
            levels[rows] = part
        left = np.flatnonzero(~mask) if left is None else left[~mask]
        if left.size == 0:
            return out
    raise ValueError(f"no engine route accepts {steps.size if left is None else left.size} "
                     f"option(s)")


# ------------------------------------------------------------------------------- the registry

# the instrument families (pricer/model: lattice.py's vanilla options, bond_book.py's Hull–White
# bond options) and the ways of pricing them; a backend registers an engine per pair it prices
FAMILIES = ["options", "bonds"]    # more by add_family (pricer/run/families.py)
METHODS = ["lattice"]              # more by add_method (a plug-in method)


@dataclass(frozen=True)
class Backend:
    name: str
    engines: dict                    # (family, method) -> factory(**overrides) -> Engine
    needs_gpu: bool = False
    help: str = ""

    def prices(self, family: str, method: str = "lattice") -> bool:
        return (family, method) in self.engines

    def engine(self, family: str = "options", method: str = "lattice", asked: str | None = None,
               **overrides) -> Engine:
        """This backend's engine of `family` by `method`; InputError where it has none, naming
        the backend `asked` for (`auto`, which resolved to this one)."""
        factory = self.engines.get((family, method))
        if factory is None:
            raise InputError(f"backend {(asked or self.name)!r} has no engine for {family} by "
                             f"{method}")
        return factory(**overrides)


_BACKENDS: dict[str, Backend] = {}


def register(name: str, engines: dict, needs_gpu: bool = False, help: str = "") -> None:
    """Make backend `name` known to `pricer price --backend`, job files and get_engine.
    `engines` maps (family, method) (FAMILIES, METHODS) to a factory: factory(**overrides)
    builds the engine; overrides are the run's GPU settings (t1, t2), which an engine without
    them accepts and ignores. An options engine takes LatticeParams (pricer/model/lattice.py),
    a bonds engine HullWhiteParams (pricer/model/bond_book.py); both give prices."""
    if not isinstance(engines, dict):
        raise TypeError(f"register({name!r}, ...): give the engines as a dict, "
                        f"{{('options', 'lattice'): factory}}, not {type(engines).__name__}")
    unknown = [key for key in engines if key[0] not in FAMILIES or key[1] not in METHODS]
    if unknown:
        raise ValueError(f"backend {name!r}: unknown (family, method) {unknown}")
    _BACKENDS[name] = Backend(name, dict(engines), needs_gpu, help)


def add_family(family: str) -> None:
    """Make `family` a key that backends may register engines for (a plug-in family's)."""
    if family not in FAMILIES:
        FAMILIES.append(family)


def add_method(method: str) -> None:
    """Make `method` a key that backends may register engines for (a plug-in method's)."""
    if method not in METHODS:
        METHODS.append(method)


def add_engines(name: str, engines: dict) -> None:
    """Give the registered backend `name` more engines ((family, method) -> factory, as
    register's): a plug-in family's or method's, beside the built-in ones."""
    unknown = [key for key in engines if key[0] not in FAMILIES or key[1] not in METHODS]
    if unknown:
        raise ValueError(f"backend {name!r}: unknown (family, method) {unknown}")
    backend(name).engines.update(engines)


def remove_engines(name: str, keys) -> None:
    """Take the engines `keys` ((family, method)) from backend `name` again."""
    for key in keys:
        backend(name).engines.pop(key, None)


def unregister(name: str) -> None:
    """Forget backend `name` (a test's own backend, say)."""
    _BACKENDS.pop(name, None)


def backends() -> tuple[str, ...]:
    """The registered backend names, `auto` first."""
    return tuple(sorted(_BACKENDS, key=lambda name: (name != "auto", list(_BACKENDS).index(name))))


def backend(name: str) -> Backend:
    try:
        return _BACKENDS[name]
    except (KeyError, TypeError):
        raise InputError(f"unknown backend {name!r}; known backends: {', '.join(backends())}") \
            from None
