"""The options' value rules are written once (pricer/model/option_rules.py's RULES): the refusal
and --invalid skip's statuses both follow from the table. For a random book (a fresh seed each
run) with bad values of every rule planted, the refusal names each rule's column and ids in the
table's order (the book's rules as it is read, then the task's), and the statuses give each row
its rule's code; a rule added to the table shows up in both."""

from __future__ import annotations

import numpy as np
import pytest

import pricer
from pricer.errors import InputError
from pricer.io.portfolio import portfolio_from_columns
from pricer.model import option_rules
from pricer.model.option_rules import IMPLIED, PRICE, PRICED, RULES, Rule
from pricer.model.validity import REASONS
from pricer.run import checks
from pricer.run.checks import checked_rows
from pricer.run.config import RunConfig
from pricer.tools.generate import generate

# rule -> the bad values a row may take to break it (and no other rule of the table)
EXAMPLES = {
    "spot not finite": [np.nan, np.inf, -np.inf],
    "strike not finite": [np.nan, np.inf, -np.inf],
    "maturity not finite": [np.nan, np.inf, -np.inf],
    "rate not finite": [np.nan, np.inf, -np.inf],
    "dividend not finite": [np.nan, np.inf, -np.inf],
    "volatility not finite": [np.inf, -np.inf],     # the book has market prices: NaN is no start
    "market_price not finite": [np.nan, np.inf, -np.inf],
    "volatility absent": [np.nan],
    "spot not positive": [0.0, -1.5],
    "strike not positive": [0.0, -100.0],
    "maturity not positive": [0.0, -0.25],
    "volatility not positive": [0.0, -0.2],
    "market_price negative": [-1.0, -1e-300],
    "steps below 1": [0, -7],
    "steps beyond memory": [2**62],
    "unknown tree": ["crrr", "binomial"],
}
COUNT = 300


def config(task: str, invalid: str) -> RunConfig:
    return RunConfig(input="book", output="book", task=task, invalid=invalid).check()


def planted_book(seed: int, task: str):
    """(the book's columns, {rule: its rows}, the good values of those rows): every rule that
    applies to a run of `task` broken by 1-3 rows of its own, chosen at random."""
    rng = np.random.default_rng(seed)
    portfolio = generate("random", COUNT, seed=seed, max_steps=400)
    cols = {name: np.array(value, copy=True) for name, value in vars(portfolio).items()
            if value is not None}
    cols["tree"] = np.array(["crr", "jr", "lr", "tian"], dtype=object)[rng.integers(0, 4, COUNT)]
    cols["market_price"] = rng.uniform(0.5, 5.0, COUNT)
    applying = [rule for rule in RULES if rule.task in (None, task)]
    rows = rng.permutation(COUNT)
    planted, good, at = {}, {}, 0
    for rule in applying:
        take = int(rng.integers(1, 4))
        planted[rule.name] = np.sort(rows[at:at + take])
        at += take
        good[rule.name] = cols[rule.column][planted[rule.name]].copy()
        examples = EXAMPLES[rule.name]
        for row in planted[rule.name]:
            cols[rule.column][row] = examples[int(rng.integers(len(examples)))]
    return cols, planted, good


def mend(cols: dict, planted: dict, good: dict) -> None:
    """The planted rows of the rules `planted` given their good values back."""
    for rule in RULES:
        if rule.name in planted:
            cols[rule.column][planted[rule.name]] = good[rule.name]


def test_every_rule_has_examples_and_the_table_is_in_code_order():
    assert set(EXAMPLES) == {rule.name for rule in RULES}, "a rule of RULES without examples here"
    assert len({rule.name for rule in RULES}) == len(RULES)
    codes = [rule.code for rule in RULES]
    assert codes == sorted(codes)       # a row's first broken rule is its lowest code
    assert set(codes) <= set(REASONS) - {PRICED}


@pytest.mark.parametrize("task", [PRICE, IMPLIED])
def test_refusal_and_statuses_follow_the_table(task):
    seed = int(np.random.default_rng().integers(1 << 30))
    cols, planted, good = planted_book(seed, task)
    ids = cols["id"]
    # skip: each planted row gets its rule's code, every other row is priced
    want = np.zeros(COUNT, dtype=np.int8)
    for rule in RULES:
        if rule.name in planted:
            want[planted[rule.name]] = rule.code
    checked = checked_rows(config(task, "skip"), portfolio_from_columns(cols, values=False))
    assert np.array_equal(checked.status, want), (seed, np.flatnonzero(checked.status != want))
    # refuse: the book's rules as it is read, then the task's, each in the table's order; the
    # first one broken names its column and its rows' ids (all of them), and once those rows are
    # mended, the next
    order = [rule for rule in RULES if rule.task is None] + [r for r in RULES if r.task == task]
    for rule in order:
        with pytest.raises(InputError) as info:
            checked_rows(config(task, "refuse"), portfolio_from_columns(cols))
        error, rows = info.value, planted[rule.name]
        assert (error.column, sorted(error.ids.tolist())) == (rule.column,
                                                              sorted(ids[rows].tolist())), \
            (seed, rule.name, str(error))
        assert str(error).startswith(f"book: column {rule.column} "), (seed, str(error))
        assert all(str(i) in str(error) for i in ids[rows[:5]]), (seed, str(error))
        mend(cols, {rule.name: rows}, good)
    checked_rows(config(task, "refuse"), portfolio_from_columns(cols))     # every rule kept


RATE = Rule("rate beyond 1", "rate", lambda cols, limit: np.abs(cols["rate"]) > 1.0,
            "must be within +-1; it is not for option id(s) {ids} (first value {value})", 9,
            lambda values: repr(float(values[0])))


def test_a_rule_added_to_the_table_is_refused_and_skipped(monkeypatch):
    portfolio = generate("random", 40, seed=int(np.random.default_rng().integers(1 << 30)),
                         max_steps=64)
    book = {name: value for name, value in vars(portfolio).items() if value is not None}
    book["rate"][[3, 17]] = [2.0, -1.5]
    portfolio_from_columns(book)            # not a rule yet: read
    monkeypatch.setattr(option_rules, "RULES", RULES + (RATE,))
    with pytest.raises(InputError) as info:
        pricer.price(book, backend="cpu")
    assert str(info.value) == (f"book: column rate must be within +-1; it is not for option "
                               f"id(s) {book['id'][3]}, {book['id'][17]} (first value 2.0)")
    assert info.value.column == "rate" and info.value.ids.tolist() == book["id"][[3, 17]].tolist()
    got = pricer.price(book, backend="cpu", invalid="skip")
    assert np.flatnonzero(got["status"].to_numpy()).tolist() == [3, 17]
    assert (got["status"].to_numpy()[[3, 17]] == 9).all()
    assert np.isnan(got["price"].to_numpy()[[3, 17]]).all()


def test_a_task_rule_added_to_the_table_is_refused_and_skipped(monkeypatch):
    """A rule of implied-volatility runs only: judged once the task is known, in both modes."""
    rule = Rule("market_price huge", "market_price", lambda cols, limit: cols["market_price"] > 1e6,
                "is huge for option id(s) {ids}", 9, task=IMPLIED)
    clean, planted, good = planted_book(int(np.random.default_rng().integers(1 << 30)), IMPLIED)
    mend(clean, planted, good)
    clean["market_price"][[5, 6]] = 1e7
    monkeypatch.setattr(option_rules, "RULES", RULES + (rule,))
    checked_rows(config(PRICE, "refuse"), portfolio_from_columns(clean))   # not a pricing rule
    with pytest.raises(InputError) as info:
        checked_rows(config(IMPLIED, "refuse"), portfolio_from_columns(clean))
    assert info.value.column == "market_price" and str(info.value).startswith(
        "book: column market_price is huge for option id(s) ")
    assert sorted(info.value.ids.tolist()) == sorted(clean["id"][[5, 6]].tolist())
    status = checked_rows(config(IMPLIED, "skip"),
                            portfolio_from_columns(clean, values=False)).status
    assert np.flatnonzero(status).tolist() == [5, 6] and (status[[5, 6]] == 9).all()


def _refusal(call):
    """The InputError call() raises (its text, column and ids), or None."""
    try:
        call()
    except InputError as exc:
        return str(exc), exc.column, sorted(np.asarray(exc.ids).tolist())
    return None


@pytest.mark.parametrize("task", [PRICE, IMPLIED])
def test_rules_left_by_the_read_are_refused_as_the_read_refuses_them(task, monkeypatch):
    """A run's HDF5 book is read without its own rules, which checked_rows judges a block at a
    time by their quick proofs (Rule.clear) beside the lattices: the same refusal as a book whose
    read judged them, rule after rule, though a lattice fault sits in a block before every broken
    rule; then that fault's (pricing); and none for a clean book whose proofs fail (finite strikes whose sum
    overflows)."""
    monkeypatch.setattr(checks, "BLOCK_ROWS", 16)       # the planted rows in many blocks
    seed = int(np.random.default_rng().integers(1 << 30))
    cols, planted, good = planted_book(seed, task)
    mend(cols, {"unknown tree": planted.pop("unknown tree")}, good)
    del cols["tree"]                    # no proof for tree names: those books are judged whole
    free = min(set(range(COUNT)) - {int(r) for rows in planted.values() for r in rows})
    lattice = {"rate": 0.5, "dividend": 0.0, "volatility": 0.01, "steps": 1, "maturity": 1.0}
    kept = {name: cols[name][free].copy() for name in lattice}
    for name, value in lattice.items():            # p > 1: a CRR lattice that does not exist
        cols[name][free] = value
    cfg = config(task, "refuse")

    def both():
        read = _refusal(lambda: checked_rows(cfg, portfolio_from_columns(cols)))
        left = _refusal(lambda: checked_rows(cfg, portfolio_from_columns(cols, values=False),
                                             book_rules=True))
        assert read == left, (seed, read, left)
        return left

    order = [r for r in RULES if r.task is None] + [r for r in RULES if r.task == task]
    for rule in [r for r in order if r.name in planted]:     # the book's, then the task's
        assert both()[1] == rule.column, (seed, rule.name)
        mend(cols, {rule.name: planted[rule.name]}, good)
    if task == PRICE:           # (implied volatilities build their lattices as they search)
        assert "not arbitrage-free" in both()[0] and both()[2] == [int(cols["id"][free])]
    for name, value in kept.items():
        cols[name][free] = value
    cols["strike"][[free, free + 1]] = 1e308
    assert both() is None
