"""The rules an option's values must keep, written once (RULES): a run refuses the whole book for
the first rule a row breaks (`refuse`: an InputError naming the column, the first ids and the
first value), and with --invalid skip each row's status is the code of the first rule it breaks
(`statuses`), the row then not priced. pricer/io/portfolio.py's validate judges the book's rules
as the book is read (a run's HDF5 book leaves them to checked_rows); pricer/run/checks.py's
checked_rows the rules of the run's task (implied volatilities: the market prices; pricing: a
volatility for every option) once the task is known, block by block by their quick proofs
(Rule.clear) before the lattices; pricer/model/validity.py's statuses all of them, then the
lattices'.

The table is in code order (every rule of a code before the next code's), so that a row's first
broken rule is also its lowest code. The lattices' own rules (a tree's fewest steps, p in (0, 1),
0 < d < u, the node range) and those of --greeks/--richardson are not here: they follow from the
tree's parameters, built block by block (pricer/model/lattice.py, pricer/model/greeks.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from pricer.errors import InputError, first_ids
from pricer.model.trees import TREE_NAMES

PRICED = 0
NOT_FINITE, NOT_POSITIVE, BAD_STEPS, UNKNOWN_TREE = range(1, 5)
# the texts of the table's codes (pricer/model/validity.py's REASONS adds the lattices')
REASONS = {
    NOT_FINITE: "a value is NaN or infinite (spot, strike, maturity, rate, dividend, volatility; "
                "for implied volatilities market_price, and volatility may be NaN)",
    NOT_POSITIVE: "spot, strike, maturity or volatility is not > 0 (or market_price < 0)",
    BAD_STEPS: "steps < 1, or more steps than this machine's memory can price",
    UNKNOWN_TREE: "the tree column names no known tree",
}
# the tree code (portfolio matrix) of an option whose tree column names no known tree
UNKNOWN_TREE_CODE = -2
PRICE, IMPLIED = "price", "implied-vol"     # the run's task (pricer.run.config.TASKS)
MARKET = "market_price"


@dataclass(frozen=True)
class Rule:
    """One rule: the rows of `column` that break it, the refusal's text and the status's code."""
    name: str        # what it is called (tests, docs): unique in RULES
    column: str      # the column it judges, which a refusal names (InputError.column)
    bad: Callable    # bad(cols, limit) -> bool mask of the rows that break it; cols: name -> array
                     # (a book's columns, or the portfolio matrix's: its tree column as codes),
                     # limit: the most steps this machine's memory can price
    message: str     # the refusal after "{source}: column {column} ", with the fields {ids} (the
                     # first few), {value} (the first bad value, as `shown` gives it) and {limit}
    code: int        # the status --invalid skip gives a row that breaks it (REASONS)
    shown: Callable | None = None    # shown(the bad rows' values) -> the {value} text
    task: str | None = None          # None: every book's, judged as it is read; PRICE, IMPLIED:
                                     # only a run of that task's, judged once the task is known
    needs: str | None = None         # a column the rule applies only where the book has (not None)
    clear: Callable | None = None    # clear(cols, limit) -> True only where no row breaks it, by
                                     # one reduction of the column (no mask): refuse's fast path

    def applies(self, cols, task: str | None) -> bool:
        return self.task == task and (self.needs is None or cols.get(self.needs) is not None)

    def error(self, cols, ids: np.ndarray, bad: np.ndarray, source: str, limit: int) -> InputError:
        """The refusal of the rows `bad`, which break this rule."""
        value = self.shown(np.asarray(cols[self.column])[bad]) if self.shown else None
        text = self.message.format(ids=first_ids(ids, bad), value=value, limit=limit)
        return InputError(f"{source}: column {self.column} {text}", column=self.column,
                          ids=ids[bad])


def _float(values) -> str:
    return repr(float(values[0]))


def _int(values) -> str:
    return str(int(values[0]))


def _tree_names(values) -> str:
    """The unknown tree names, each once, the first five quoted."""
    unknown = list(dict.fromkeys(str(name) for name in values))
    names = ", ".join(repr(name) for name in unknown[:5])
    return names + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")


def _not_finite(name: str) -> Callable:
    return lambda cols, limit: ~np.isfinite(cols[name])


def _not_positive(name: str) -> Callable:
    return lambda cols, limit: cols[name] <= 0.0


# The quick proofs (Rule.clear). A sum is finite only where every term is (a NaN or an infinity
# makes it NaN or infinite; a finite sum that overflows proves nothing and the mask decides); a
# least value above a bound puts every value above it (NaN makes the least NaN, no proof).
def _sum_finite(name: str) -> Callable:
    def clear(cols, limit) -> bool:
        with np.errstate(all="ignore"):
            return bool(np.isfinite(np.add.reduce(np.asarray(cols[name], np.float64))))
    return clear


def _least_above(name: str, bound: float, strict: bool = True) -> Callable:
    def clear(cols, limit) -> bool:
        column = np.asarray(cols[name])
        if not column.size:
            return True
        least = np.min(column)
        return bool(least > bound) if strict else bool(least >= bound)
    return clear


def _steps_within(cols, limit) -> bool:
    steps = np.asarray(cols["steps"])
    return not steps.size or bool(np.max(steps) <= limit)


def _volatility_not_finite(cols, limit):
    # a book of market prices may leave a volatility (a start) out: NaN (a pricing run refuses
    # it with its own rule, "absent")
    volatility = cols["volatility"]
    return np.isinf(volatility) if cols.get(MARKET) is not None else ~np.isfinite(volatility)


def _unknown_tree(cols, limit):
    trees = np.asarray(cols["tree"])
    if trees.dtype.kind in "iuf":      # the matrix's tree codes
        return trees == UNKNOWN_TREE_CODE
    return ~np.isin(trees, TREE_NAMES)


NAN = "is NaN or infinite for option id(s) {ids}"
POSITIVE = "must be > 0; it is not for option id(s) {ids} (first value {value})"
RULES = (
    *(Rule(f"{name} not finite", name, _not_finite(name), NAN, NOT_FINITE,
           clear=_sum_finite(name))
      for name in ("spot", "strike", "maturity", "rate", "dividend")),
    Rule("volatility not finite", "volatility", _volatility_not_finite, NAN, NOT_FINITE,
         clear=_sum_finite("volatility")),    # a NaN start of a book of market prices: the mask
    Rule("market_price not finite", MARKET, _not_finite(MARKET), NAN, NOT_FINITE, task=IMPLIED,
         clear=_sum_finite(MARKET)),
    Rule("volatility absent", "volatility", lambda cols, limit: np.isnan(cols["volatility"]),
         "is NaN or absent for option id(s) {ids}: pricing needs it (`pricer implied-vol` "
         "solves for it from market_price)", NOT_FINITE, task=PRICE,
         clear=_sum_finite("volatility")),
    *(Rule(f"{name} not positive", name, _not_positive(name), POSITIVE, NOT_POSITIVE, _float,
           clear=_least_above(name, 0.0))
      for name in ("spot", "strike", "maturity", "volatility")),
    Rule("market_price negative", MARKET, lambda cols, limit: cols[MARKET] < 0.0,
         "must be >= 0; it is not for option id(s) {ids} (first value {value})", NOT_POSITIVE,
         _float, task=IMPLIED, clear=_least_above(MARKET, 0.0, strict=False)),
    Rule("steps below 1", "steps", lambda cols, limit: cols["steps"] < 1,
         "must be >= 1; it is not for option id(s) {ids} (first value {value})", BAD_STEPS, _int,
         clear=_least_above("steps", 1, strict=False)),
    Rule("steps beyond memory", "steps", lambda cols, limit: cols["steps"] > limit,
         "is too large for this machine's memory for option id(s) {ids} (first value {value}, "
         "limit {limit})", BAD_STEPS, _int, clear=_steps_within),
    Rule("unknown tree", "tree", _unknown_tree, "has unknown tree name(s) {value} for option "
         "id(s) {ids}; known trees: " + ", ".join(TREE_NAMES), UNKNOWN_TREE, _tree_names,
         needs="tree"),
)


def rules(cols, task: str | None, columns=None, without=()) -> list:
    """The rules (RULES' order) that apply to `cols` for `task` (None: the book's own, which every
    run judges; PRICE or IMPLIED: that task's only), those of `columns` only where given, none of
    the columns `without`."""
    return [rule for rule in RULES if rule.applies(cols, task)
            and (columns is None or rule.column in columns) and rule.column not in without]


def refuse(cols, ids: np.ndarray, source: str, chosen: list, limit: int) -> None:
    """InputError for the first of the rules `chosen` (rules()) that a row of `cols` breaks."""
    for rule in chosen:
        if rule.clear is not None and rule.clear(cols, limit):
            continue
        bad = rule.bad(cols, limit)
        if bad.any():
            raise rule.error(cols, ids, bad, source, limit)


def cleared(cols, chosen: list, limit: int) -> bool:
    """Whether the quick proofs (Rule.clear) show that no row of `cols` breaks a rule of `chosen`
    (False proves nothing: refuse then judges)."""
    return all(rule.clear is not None and rule.clear(cols, limit) for rule in chosen)


def broken(cols, chosen: list, limit: int) -> np.ndarray:
    """Per row, whether it breaks any of the rules `chosen` (rules())."""
    return np.logical_or.reduce([rule.bad(cols, limit) for rule in chosen])


def statuses(cols: dict, task: str, limit: int) -> np.ndarray:
    """Each row's status (int8): PRICED where it breaks no rule of the book's or of `task`'s, else
    the code of the first rule (RULES' order) it breaks; a pass over a rule's column each."""
    n = int(np.shape(cols["steps"])[0])
    status = np.zeros(n, dtype=np.int8)
    chosen = [rule for rule in RULES if rule.applies(cols, None) or rule.applies(cols, task)]
    with np.errstate(invalid="ignore"):
        # written last rule first, so that a row keeps its first; the rules of a run of one code
        # together, one write
        while chosen:
            code, masks = chosen[-1].code, []
            while chosen and chosen[-1].code == code:
                masks.append(chosen.pop().bad(cols, limit))
            status[np.logical_or.reduce(masks)] = code
    return status
