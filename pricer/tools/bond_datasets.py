"""The seven datasets of Hull–White instruments of Pawlak et al. (2021), "Datasets" (the same in
Pawlak & Oancea (2019), 6.2), made by choosing each tree's mean reversion and maturity so that its
width and height are theirs.

At monthly steps (12 a year) an instrument of height h (steps) matures in h / 12 years, and one of
width w = 2 j_max + 1 has a = 0.184 / (Δt (j_max − ½)): then 0.184 / (a Δt) = j_max − ½ and
hw1f.jmax_of gives j_max. Widths are odd. The datasets:

| name | instruments | widths | heights |
|---|---|---|---|
| U1 | 3 000 | 259 | 606 |
| U2 | 100 000 | 259 | 606 |
| R1 | 100 000 | uniform in [7, 511] | uniform in [13, 1 200] |
| R2 | 100 000 | uniform in [7, 511] | normal in [13, 1 200] |
| R3 | 100 000 | normal in [7, 511] | uniform in [13, 1 200] |
| S1 | 100 000 | 99 %: [7, 57], 1 %: [461, 511] | 99 %: [12, 131], 1 % (the same instruments): [1 082, 1 200] |
| S2 | 100 000 | as S1, but one 1 % has wide trees of uniform heights and another 1 % tall trees of uniform widths | |

"Normal in [lo, hi]": mean at the middle, standard deviation (hi − lo) / 6, clipped to the
interval (Pawlak et al. say standard-normal). S* heights start at 12 as Pawlak et al. give them.
Every instrument is, as theirs are, a Bermudan call or put on a bond: face 100, a coupon
rate in [0, 8 %] paid twice a year, exercisable once a year from the first year to a year before
maturity (at mid-life for bonds under two years), strike in [90, 110]; σ in [0.5 %, 2 %]; one
sloped curve for all.
"""

from __future__ import annotations

import numpy as np

from pricer.errors import InputError
from pricer.model import hw1f

DATASETS = ("U1", "U2", "R1", "R2", "R3", "S1", "S2")
# the instruments as objects, their columns and the file's rows while a dataset is written
GENERATE_BYTES_PER_INSTRUMENT = 512    # the columns, the text columns' objects, the file in memory
STEPS_PER_YEAR = 12
WIDTHS, HEIGHTS = (7, 511), (13, 1200)
CURVE = hw1f.YieldCurve(np.array([0.25, 1.0, 2.0, 5.0, 10.0, 30.0, 100.0]),
                        np.array([0.015, 0.018, 0.022, 0.028, 0.033, 0.037, 0.038]))


def mean_reversion(width) -> np.ndarray:
    """The a that gives trees of these (odd) widths at monthly steps."""
    jmax = (np.asarray(width, dtype=np.float64) - 1.0) / 2.0
    return hw1f.JMAX_FACTOR * STEPS_PER_YEAR / (jmax - 0.5)


def _odd(values) -> np.ndarray:
    values = np.asarray(np.rint(values), dtype=np.int64)
    return values + (values % 2 == 0)


def _uniform(rng, lo, hi, n) -> np.ndarray:
    return rng.integers(lo, hi + 1, n)


def _normal(rng, lo, hi, n) -> np.ndarray:
    return np.clip(np.rint(rng.normal((lo + hi) / 2.0, (hi - lo) / 6.0, n)), lo, hi).astype(np.int64)


def shapes(name: str, count: int | None, rng) -> tuple[np.ndarray, np.ndarray]:
    """(widths, heights) of a dataset's trees."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; the datasets are {', '.join(DATASETS)}")
    n = count if count is not None else (3000 if name == "U1" else 100_000)
    if name in ("U1", "U2"):
        return np.full(n, 259), np.full(n, 606)
    if name in ("R1", "R2", "R3"):
        widths = (_normal if name == "R3" else _uniform)(rng, *WIDTHS, n)
        heights = (_normal if name == "R2" else _uniform)(rng, *HEIGHTS, n)
        return np.minimum(_odd(widths), WIDTHS[1]), heights
    widths, heights = _uniform(rng, 7, 57, n), _uniform(rng, 12, 131, n)
    picked = rng.permutation(n)
    few = max(1, n // 100)
    if name == "S1":
        both = picked[:few]
        widths[both], heights[both] = _uniform(rng, 461, 511, few), _uniform(rng, 1082, 1200, few)
    else:
        wide, tall = picked[:few], picked[few:2 * few]
        widths[wide] = _uniform(rng, 461, 511, few)
        heights[tall] = _uniform(rng, 1082, 1200, few)
    return np.minimum(_odd(widths), 511), heights


def dataset_columns(name: str, count: int | None = None, seed: int = 2026) -> dict:
    """A dataset (module doc) as a book's columns (bond_book.BOND_COLUMNS) on curve 0 (CURVE),
    vectorised: what `pricer generate --bonds` writes."""
    rng = np.random.default_rng(seed)
    return columns_of_shapes(*shapes(name, count, rng), rng)


def columns_of_shapes(widths, heights, rng) -> dict:
    """Instruments as the datasets' (module doc) with trees of these (odd) widths and heights at
    monthly steps, as a book's columns on curve 0 (CURVE)."""
    n = widths.size
    maturity = heights / STEPS_PER_YEAR
    coupon = rng.uniform(0.0, 0.08, n)
    strike = rng.uniform(90.0, 110.0, n)
    call = rng.random(n) < 0.5
    sigma = rng.uniform(0.005, 0.02, n)
    long = maturity >= 2.0
    return dict(face=np.full(n, 100.0), coupon=coupon, frequency=np.full(n, 2, dtype=np.int64),
                maturity=maturity, strike=strike, call=call,
                exercise=np.full(n, hw1f.EXERCISES.index("bermudan"), dtype=np.int64),
                first_exercise=np.where(long, 1.0, maturity / 2.0),
                last_exercise=np.where(long, maturity - 1.0, maturity / 2.0),
                exercise_frequency=np.ones(n), product=np.zeros(n, dtype=np.int64),
                mean_reversion=mean_reversion(widths), volatility=sigma,
                steps_per_year=np.full(n, float(STEPS_PER_YEAR)),
                curve=np.zeros(n, dtype=np.int64))


def dataset(name: str, count: int | None = None, seed: int = 2026):
    """(instruments, a, sigma, steps_per_year, curve) of a dataset (module doc): its columns as
    hw1f.BondOption objects."""
    cols = dataset_columns(name, count, seed)
    instruments = [hw1f.BondOption(face=100.0, coupon=float(c), frequency=2, maturity=float(m),
                                   strike=float(k), call=bool(x), exercise="bermudan",
                                   first=float(f), last=float(last), every=1.0)
                   for c, m, k, x, f, last in zip(cols["coupon"], cols["maturity"],
                                                  cols["strike"], cols["call"],
                                                  cols["first_exercise"], cols["last_exercise"])]
    return (instruments, cols["mean_reversion"], cols["volatility"], STEPS_PER_YEAR, CURVE)


def write_dataset(path: str, name: str, count: int | None = None, seed: int = 2026,
                  overwrite: bool = False) -> None:
    """`pricer generate --bonds NAME`: the dataset as a book of bond options (pricer/io/bonds.py)
    on its one curve, named "default"; checked, claimed and written as `pricer generate` writes an
    option book (pricer/tools/generate.py: check_memory, claimed, write_image)."""
    from pricer.files import check_output_file
    from pricer.io.bonds import bond_book_image
    from pricer.tools.generate import check_memory, claimed, write_image

    if count is not None and count < 1:
        raise InputError(f"--count must be >= 1, got {count}")
    if seed < 0:
        raise InputError(f"--seed must be >= 0, got {seed}")
    check_output_file(path, overwrite, "book of bond options")
    if not path.endswith((".h5", ".hdf5")):
        raise InputError(f"{path}: a book of bond options is an HDF5 file (.h5)")
    check_memory(count or 100_000, GENERATE_BYTES_PER_INSTRUMENT)
    with claimed(path, overwrite, "book of bond options"):
        columns = dataset_columns(name, count, seed)
        n = columns["maturity"].size
        write_image(path, bond_book_image(np.arange(1, n + 1), columns, {"default": CURVE},
                                          default="default"), "book of bond options")
    print(f"wrote {path}: {n} bond options ({name}, seed {seed})", flush=True)
