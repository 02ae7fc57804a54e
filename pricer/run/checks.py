"""Rank 0's checks before any work (with --distribute read, every rank's of its own rows):
settings, output path, the file, every option's lattice (and the extra lattices --greeks and
--richardson price), and the node's memory. Each failure is an InputError naming the cause."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from pricer.errors import InputError, first_ids
from pricer.files import check_input_file
from pricer.io.formats import HDF5, input_format, read_book
from pricer.io.portfolio import (max_steps_for_memory, priced_steps, read_index,
                                 read_portfolio_rows)
from pricer.io.checkpoint import checkpoint_bytes
from pricer.io.results import check_output_path, results_bytes
from pricer.model import option_rules
from pricer.model.greeks import check
from pricer.model.lattice import TREE_NAMES, check_lattices as lattice_check
from pricer.model.option_rules import IMPLIED, PRICE
from pricer.model.validity import PRICED, UNKNOWN_TREE_CODE, min_steps, statuses
from pricer.run import memory
from pricer.run.config import RunConfig, rank_threads
from pricer.run.memory import size_text


def read_and_check(cfg: RunConfig, size: int, node_ranks: int):
    """Rank 0 only: everything that can be wrong with the input, found before any work; the node's
    memory checked from the book's shape before the book itself is read. Returns the portfolio
    and its rows checked (CheckedRows)."""
    cfg.check()
    check_input_file(cfg.input)   # before any read: a FIFO never ends
    check_output_path(cfg.output, cfg.overwrite, protect=cfg.input)
    skip = cfg.invalid == "skip"
    if input_format(cfg.input) == HDF5:
        # the ids and steps first (the structure checked, the ids unique): the memory checked from
        # them, then the other columns; the book's own rules are judged with its lattices, a
        # block at a time (checked_rows)
        index = read_index(cfg.input, values=False)
        most = _most_steps(index.steps, skip)
        if most is not None:      # else checked_rows names the steps column's fault
            check_memory(cfg, len(index), most, index.has_tree, size, node_ranks)
        portfolio = read_portfolio_rows(cfg.input, None, values=False, index=index)
        return portfolio, checked_rows(cfg, portfolio, book_rules=not skip)
    # a CSV or Parquet table is parsed whole before its shape is known
    portfolio = read_book(cfg.input, values=not skip)
    steps = priced_steps(portfolio.steps)
    check_memory(cfg, len(portfolio), max(int(steps.max()), 1), portfolio.tree is not None,
                 size, node_ranks)
    return portfolio, checked_rows(cfg, portfolio)


def _most_steps(steps: np.ndarray, skip: bool) -> int | None:
    """The most steps of a row the run prices, for the memory check: with --invalid skip of the
    rows whose steps keep the steps column's rules (None if none does), else of every row (None
    where one breaks them: the refusal names it)."""
    if skip:
        priced = priced_steps(steps)
        return int(priced.max()) if priced.any() else None
    steps_rules = option_rules.rules({"steps": steps}, None, columns=("steps",))
    return int(steps.max()) if option_rules.cleared({"steps": steps}, steps_rules,
                                                    max_steps_for_memory()) else None


@dataclass
class CheckedRows:
    """A portfolio's rows as the engines take them, checked: the option method's columns (name ->
    array: float64, steps int64, call and american bool, the tree as its code in TREE_NAMES, the
    market price for implied volatilities)."""
    cols: dict
    status: np.ndarray | None   # --invalid skip: each row's status (model/validity.py), else None
    trees: int                  # the trees that price its rows, a bit per code in TREE_NAMES

    def tree_names(self) -> list:
        return tree_names(self.trees)


def tree_names(bits: int) -> list:
    """The names of the trees whose codes are the bits set in `bits`."""
    return [name for code, name in enumerate(TREE_NAMES) if bits >> code & 1]


def checked_rows(cfg: RunConfig, portfolio, book_rules: bool = False) -> CheckedRows:
    """The portfolio's columns with every option's lattice checked (check_lattices' refusals, by
    id), a block of rows at a time (a block's temporaries stay in the CPU's cache); with
    --invalid skip, each row's status instead, a row that cannot be priced given steps 0 (nothing
    to price: the partition, the chunks and the memory estimates count it as empty).
    `book_rules`: the book was read without its own rules (option_rules), which are judged here
    with the run's task's, before any lattice and with the same refusal (the first rule broken
    anywhere in the book): a block is judged by the rules' quick proofs (option_rules.cleared),
    and the whole book by option_rules.refuse where a proof fails or a lattice is refused."""
    skip = cfg.invalid == "skip"
    check_task_columns(cfg, portfolio)
    if skip:
        codes = portfolio.tree_codes(cfg.tree, UNKNOWN_TREE_CODE)
        cols = portfolio.columns(codes=codes, implied=cfg.implied)
        status = skip_invalid(cfg, cols)
        return CheckedRows(cols, status, _tree_bits(codes[status == PRICED]))
    rules = _rules_of(cfg, portfolio, book_rules)
    limit = max_steps_for_memory()

    def refuse() -> None:      # the read's order: every rule over the whole book, then lattices
        option_rules.refuse(vars(portfolio), portfolio.id, cfg.input, rules, limit)
        del rules[:]           # judged

    if any(rule.clear is None for rule in rules):    # a tree column's names: judged whole first
        refuse()
    codes = portfolio.tree_codes(cfg.tree, None)
    cols = portfolio.columns(codes=codes, implied=cfg.implied)
    # a book without a tree column: every row the run's tree, which a block without one says
    judged = [name for name in cols if name != "tree" or portfolio.tree is not None]

    def check(rows: slice, block: dict) -> None:
        try:
            _check_block(cfg, block, portfolio.id[rows])
        except InputError as exc:    # named from the MESSAGE_ROWS that start at this block
            refuse()                 # a broken rule of a later row comes first
            wider = slice(rows.start, rows.start + MESSAGE_ROWS)
            try:
                _check_block(cfg, {name: cols[name][wider] for name in judged},
                             portfolio.id[wider])
            except InputError as more:
                exc = more
            raise exc.prefixed(f"{cfg.input}: ") from None

    n, span = len(portfolio), BLOCK_ROWS * RULE_BLOCKS
    for a in range(0, n, BLOCK_ROWS):
        if rules and a % span == 0:    # the rules' proofs of the rows the next blocks check
            rows = slice(a, min(n, a + span))
            if not option_rules.cleared({name: cols[name][rows] for name in cols}, rules, limit):
                refuse()
        rows = slice(a, min(n, a + BLOCK_ROWS))
        check(rows, {name: cols[name][rows] for name in judged})
    if portfolio.tree is None:         # one tree for every row
        return CheckedRows(cols, None, 1 << int(codes[0]) if codes.size else 0)
    return CheckedRows(cols, None, _tree_bits(codes))


def check_task_columns(cfg: RunConfig, portfolio) -> None:
    """The columns the run's task needs: an implied-volatility run the market prices (a pricing
    run needs every volatility, which a book of market prices may leave out: a rule of the task,
    _rules_of)."""
    if cfg.implied and portfolio.market_price is None:
        raise InputError(f"{cfg.input}: implied volatilities need a market_price column (the "
                         f"prices to solve for)", column="market_price")


def _rules_of(cfg: RunConfig, portfolio, book_rules: bool) -> list:
    """The rules (option_rules) checked_rows judges: the book's own where its read left them, then
    the run's task's (implied volatilities: the market prices; pricing: a volatility for every
    option, which a book of market prices may leave out)."""
    cols = vars(portfolio)
    return (option_rules.rules(cols, None) if book_rules else []) + \
        option_rules.rules(cols, IMPLIED if cfg.implied else PRICE)


def _tree_bits(codes: np.ndarray) -> int:
    """A bit per tree code in `codes` (a skipped row's code, < 0, is none)."""
    codes = codes.astype(np.int64, copy=False)
    present = np.flatnonzero(np.bincount(codes[codes >= 0], minlength=1))
    return int(np.bitwise_or.reduce(np.left_shift(1, present))) if present.size else 0


def skip_invalid(cfg: RunConfig, cols: dict) -> np.ndarray:
    """--invalid skip: every row's status (pricer/model/validity.py), block by block
    (CHECK_ROWS); the rows that cannot be priced get steps 0 in `cols` (a copy of the column)."""
    n = len(cols["steps"])
    status = np.empty(n, dtype=np.int8)
    analytics, most = cfg.analytics(), max_steps_for_memory()
    for a in range(0, n, CHECK_ROWS):
        block = {name: column[a:a + CHECK_ROWS] for name, column in cols.items()}
        status[a:a + CHECK_ROWS] = statuses(block, cfg.tree, analytics, most)
    skipped = status != PRICED
    if skipped.any():
        cols["steps"] = np.where(skipped, 0, cols["steps"])
    return status


def check_memory(cfg: RunConfig, options: int, most_steps: int, has_tree: bool, size: int,
                 node_ranks: int) -> None:
    """The node's memory holds what every rank of it needs (memory.estimate), or InputError."""
    analytics = cfg.analytics()
    threads = rank_threads(cfg.threads, node_ranks)     # capped at the cores, as the run's
    est = memory.estimate(options, len(cfg.outputs()), size, node_ranks, cfg.chunk_shape()[1],
                          most_steps, analytics.lattice_count,
                          threads, has_tree, cfg.distribute == "bcast", cfg.distribute == "read",
                          memory.SEARCH_BYTES_PER_OPTION if cfg.implied else 0.0)
    memory.check(est, cfg.input)


# rows --invalid skip judges at a time: judging builds every parameter of an option (~150 bytes of
# temporaries), so a block stays in the CPU's cache and the peak does not grow with the book
# (docs/decisions.md). checked_rows checks blocks of BLOCK_ROWS for the same reason, and tells a
# refusal from the MESSAGE_ROWS that start at the first bad block, so that its "and N more" counts
# more than one small block.
CHECK_ROWS = 1 << 16
BLOCK_ROWS = 1 << 15
MESSAGE_ROWS = 1 << 20
# checked_rows proves the rules over the rows of RULE_BLOCKS blocks at a time: a proof is a few
# NumPy calls per rule, whose overhead a block's rows would not repay; the span's columns (~16 MiB)
# then stay in the last-level cache for its blocks' lattices
RULE_BLOCKS = 8


def _check_block(cfg: RunConfig, cols: dict, ids: np.ndarray) -> None:
    """Every option's lattice exists (p in (0, 1)), also those that --greeks/--richardson add; for
    implied volatilities, whose lattices are built at volatilities the search picks, each option
    has the steps its tree needs."""
    if cfg.implied:
        few = np.asarray(cols["steps"]) < min_steps(cols, cfg.tree)
        if few.any():
            raise InputError(f"option id(s) {first_ids(ids, few)} have fewer steps than their "
                             f"tree needs (first value {int(np.asarray(cols['steps'])[few][0])})",
                             column="steps", ids=np.asarray(ids)[few])
        return
    lattice_check(cols, cfg.tree, ids=ids)
    check_analytics(cols, cfg, ids)


def check_analytics(cols: dict, cfg: RunConfig, ids: np.ndarray) -> None:
    """What --greeks/--richardson cannot price, refused by id on rank 0 (so that no rank fails
    later, alone): greeks.check's rules, then the extra lattices they price must exist too — the
    volatility- and rate-bumped copies (--greeks) and the coarse M ~ N/2-step one (--richardson) —
    since an option near the edge of p in (0, 1), or a joshi4 option at M = 1, can fail there only."""
    analytics = cfg.analytics()
    check(cols, analytics, ids)
    for what, part in analytics.described_lattices(cols)[1:]:
        try:
            lattice_check(part, cfg.tree, ids=ids)
        except InputError as exc:
            raise exc.prefixed(f"{what}, and ") from None


def check_disk(cfg: RunConfig, options: int, chunks: int, outputs: int | None = None,
               checkpoint: str | None = None) -> None:
    """The output's folder (and the checkpoint's) has room for what the run will write there —
    the results file, the checkpoint's chunks not yet saved — or InputError with the numbers,
    before any pricing (a full disk found only at the write would lose the run); InputError too
    for a folder that does not exist or cannot be looked at. `options` rows of `outputs` values
    each (None: the option run's, cfg.outputs()); `checkpoint`: the folder of the chunks (None:
    cfg.checkpoint). The checkpoint's saved chunks are its regular files (a link is not
    followed)."""
    outputs = len(cfg.outputs()) if outputs is None else outputs
    checkpoint = checkpoint or cfg.checkpoint
    wanted = [(cfg.output, os.path.dirname(os.path.abspath(cfg.output)), "the results",
               results_bytes(options, outputs))]
    if checkpoint:
        folder = checkpoint if os.path.isdir(checkpoint) else \
            os.path.dirname(os.path.abspath(checkpoint))
        try:
            with os.scandir(checkpoint) as entries:
                saved = sum(entry.stat(follow_symlinks=False).st_size for entry in entries
                            if entry.is_file(follow_symlinks=False))
        except (FileNotFoundError, NotADirectoryError):
            saved = 0
        except OSError as exc:
            raise InputError(f"{checkpoint}: cannot read the checkpoint folder: "
                             f"{exc.strerror}") from None
        wanted.append((checkpoint, folder, "the checkpoint",
                       max(0.0, checkpoint_bytes(options, outputs, chunks) - saved)))
    by_device: dict = {}
    for path, folder, what, nbytes in wanted:
        try:
            device = os.stat(folder).st_dev
        except OSError as exc:
            raise InputError(f"{path}: folder {folder} " + (
                "does not exist" if isinstance(exc, FileNotFoundError) else
                f"cannot be used: {exc.strerror}")) from None
        entry = by_device.setdefault(device, [folder, [], 0.0])
        entry[1].append(f"{what} need ~{size_text(nbytes)}")
        entry[2] += nbytes
    for folder, whats, nbytes in by_device.values():
        stats = os.statvfs(folder)
        free = stats.f_bavail * stats.f_frsize
        if nbytes > free:
            raise InputError(f"{cfg.output}: not enough disk space in {folder}: "
                             f"{' and '.join(whats)}, {size_text(free)} is free")
