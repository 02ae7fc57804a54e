"""`pricer bench plan`: rank 0's read, check and plan of a book, against a plain read of its columns.

Before any pricing, rank 0 reads the book, checks every instrument, sizes the run and partitions
it (pricer/run/pipeline.py, pricer/run/option_family.py): a serial section of every command that grows
with the book. Timed here, in one process with one numba thread, best of `repeats` after a warm-up
(a file read from the page cache, as a second run of a book finds it):

- plain read: h5py reads the book's columns into NumPy arrays, nothing else (the floor);
- options, whole plan: the option book's plan and share on one rank (read, check, the method's
  columns, partition, chunk grid), per option and as a multiple of the plain read;
- options, --distribute read: rank 0's part when every rank reads and checks its own rows (the
  index of ids and steps, the partition, its own rows), at 1, 2 and 4 ranks: it shrinks with the
  ranks;
- bonds: rank 0's plan of a book of bond options (the index, the trees' shapes, the memory
  check, the chunk grid and the split), per instrument.

Targets: options <= 150 ns per option and <= 5x the plain read; bonds <= 300 ns per instrument.
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
import time

from pricer.tools.tables import write_json

OPTION_NS, OPTION_RATIO, BOND_NS = 150.0, 5.0, 300.0


def add_arguments(ap) -> None:
    ap.add_argument("--count", type=int, default=2_000_000,
                    help="options in the book (default 2,000,000; `pricer generate --dist random`)")
    ap.add_argument("--bonds", type=int, default=1_000_000,
                    help="bond options in the bond book (default 1,000,000; dataset R1)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="200,000 options and bonds, 2 repeats")
    ap.add_argument("--out", default=None, help="also write the measurements as JSON here")


def _best(work, repeats: int) -> float:
    """The least seconds of `repeats` calls of work() after one more; a callable it returns (what
    the run does later, beside the pricing: the input's hash) is called untimed."""
    times = []
    for k in range(repeats + 1):
        t = time.perf_counter()
        after = work()
        if k:                                # the first: the page cache's, the first calls'
            times.append(time.perf_counter() - t)
        if callable(after):
            after()
    return min(times)


def _plain_read(path: str, group: str, names=None):
    import h5py

    with h5py.File(path, "r") as f:
        g = f[group]
        return {name: g[name][()] for name in (names or g.keys())
                if isinstance(g[name], h5py.Dataset)}


def _option_plan(path: str, folder: str, size: int = 1, distribute: str = "scatter"):
    """Rank 0's plan of the option book at `size` ranks, and its share of the rows, beside the
    input's hash (as a run reads it: sha256_beside)."""
    from pricer.io.results import sha256_beside
    from pricer.run.collectives import Alone
    from pricer.run.config import RunConfig
    from pricer.run.option_family import OptionBook
    from pricer.run.pipeline import make_plan

    def work():
        cfg = RunConfig(input=path, output=os.path.join(folder, "o.h5"), backend="cpu",
                        overwrite=True, distribute=distribute).check()
        family, digest = OptionBook(), sha256_beside(path)
        plan = make_plan(family, cfg, size, 1, digest, None)
        if distribute == "read" or size == 1:      # rank 0's own rows (alone: every row)
            family.share(cfg, Alone(), plan, plan.rank_chunks(0))
        return digest.result
    return work


def _bond_plan(path: str, folder: str):
    from concurrent.futures import Future

    from pricer.run.bond_family import BondOptions
    from pricer.run.config import RunConfig
    from pricer.run.pipeline import make_plan

    def work():
        cfg = RunConfig(input=path, output=os.path.join(folder, "b.h5"), backend="cpu",
                        overwrite=True).check()
        make_plan(BondOptions(), cfg, 1, 1, Future(), None)
    return work


def bench_plan(args) -> dict:
    import numba

    from pricer.tools.bond_datasets import write_dataset
    from pricer.tools.generate import generate
    from pricer.io.portfolio import write_portfolio

    count = 200_000 if args.quick else args.count
    bonds = 200_000 if args.quick else args.bonds
    repeats = 2 if args.quick else args.repeats
    numba.set_num_threads(1)
    out = {"options": count, "bonds": bonds, "repeats": repeats, "numba_threads": 1}
    with tempfile.TemporaryDirectory(prefix="pricer-bench-plan-") as folder:
        book = os.path.join(folder, "book.h5")
        write_portfolio(book, generate("random", count, seed=0))
        plain = _best(lambda: _plain_read(book, "portfolio"), repeats)
        whole = _best(_option_plan(book, folder), repeats)
        out["plain_read_s"], out["plan_s"] = plain, whole
        print(f"options: {count:,} (random N in [16, 4096]), best of {repeats}, one numba thread")
        print(f"  plain h5py read of the columns   {plain:8.3f} s  {plain / count * 1e9:6.0f} ns/option")
        print(f"  rank 0's read + check + plan     {whole:8.3f} s  {whole / count * 1e9:6.0f} ns/option"
              f"  {whole / plain:5.1f}x the plain read  (targets <= {OPTION_NS:.0f} ns, "
              f"<= {OPTION_RATIO:.0f}x)")
        out["own_rows_s"] = {}
        for size in (1, 2, 4):
            seconds = _best(_option_plan(book, folder, size, "read"), repeats)
            out["own_rows_s"][size] = seconds
            print(f"  --distribute read, rank 0 of {size}  {seconds:8.3f} s  "
                  f"{seconds / count * 1e9:6.0f} ns/option of the book")
        os.remove(book)
        bond_book = os.path.join(folder, "bonds.h5")
        with contextlib.redirect_stdout(io.StringIO()):
            write_dataset(bond_book, "R1", bonds)
        plain_bonds = _best(lambda: _plain_read(bond_book, "bond_options"), repeats)
        bond = _best(_bond_plan(bond_book, folder), repeats)
        out["bond_plain_read_s"], out["bond_plan_s"] = plain_bonds, bond
        print(f"bond options: {bonds:,} (dataset R1), best of {repeats}")
        print(f"  plain h5py read of the columns   {plain_bonds:8.3f} s  "
              f"{plain_bonds / bonds * 1e9:6.0f} ns/instrument")
        print(f"  rank 0's plan                    {bond:8.3f} s  {bond / bonds * 1e9:6.0f} "
              f"ns/instrument  {bond / plain_bonds:5.1f}x the plain read  (target <= "
              f"{BOND_NS:.0f} ns)")
    out["verdicts"] = {
        "options_ns": bool(whole / count * 1e9 <= OPTION_NS),
        "options_ratio": bool(whole / plain <= OPTION_RATIO),
        "bonds_ns": bool(bond / bonds * 1e9 <= BOND_NS)}
    print("verdicts: " + ", ".join(f"{k} {'met' if v else 'MISSED'}"
                                   for k, v in out["verdicts"].items()))
    write_json(args.out, out)
    return out
