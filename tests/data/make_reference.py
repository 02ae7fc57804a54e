"""Make tests/data/scenarios_n20000.csv: Cao (2025)'s validation grid (`pricer generate --dist scenarios
--count 270 --steps 20000`, 270 American puts) priced by the serial engine at N = 20 000.

The other backends must reproduce these prices to test_engines.STORED_TOLERANCE relative (on another
CPU the same code may round differently in the last bit). Run from the
repository root:   PYTHONPATH=. python tests/data/make_reference.py   (about 1-2 minutes on one core).

Prices are written with repr(), which round-trips float64 exactly.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from pricer import __version__  # noqa: E402
from pricer.engines.cpu.serial import SerialEngine  # noqa: E402
from pricer.tools.generate import generate  # noqa: E402
from pricer.model.lattice import lattice_parameters  # noqa: E402

OUT = Path(__file__).with_name("scenarios_n20000.csv")
COUNT, STEPS = 270, 20_000
COLUMNS = ("id", "spot", "strike", "maturity", "rate", "dividend", "volatility", "steps", "call",
           "american", "price")


def main() -> None:
    portfolio = generate("scenarios", COUNT, steps=STEPS)
    params = lattice_parameters(portfolio.columns(), "crr", ids=portfolio.id)
    start = time.perf_counter()
    prices = SerialEngine().price(params)
    seconds = time.perf_counter() - start
    with open(OUT, "w") as f:
        f.write(f"# pricer.tools.generate.generate('scenarios', {COUNT}, steps={STEPS}) priced by the serial "
                f"engine (crr tree), pricer {__version__}, made by tests/data/make_reference.py\n")
        f.write(",".join(COLUMNS) + "\n")
        for k in range(len(portfolio)):
            row = [str(int(portfolio.id[k]))]
            row += [repr(float(getattr(portfolio, c)[k]))
                    for c in ("spot", "strike", "maturity", "rate", "dividend", "volatility")]
            row += [str(int(portfolio.steps[k])), str(int(portfolio.call[k])),
                    str(int(portfolio.american[k])), repr(float(prices[k]))]
            f.write(",".join(row) + "\n")
    print(f"wrote {OUT}: {len(portfolio)} prices in {seconds:.1f}s "
          f"({portfolio.nodes() / seconds:.3g} nodes/s)")


if __name__ == "__main__":
    main()
