"""Cao (2025)'s benchmark American put at the N given (python3 tests/seed_option.py 100000 500000 1000000) on
every backend, against the independent oracle tests/oracle.crr_wide (docs/performance.md)."""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import numpy as np
from oracle import crr_wide
from pricer import price

for n in map(int, sys.argv[1:]):
    t = time.perf_counter()
    ref = crr_wide(100.0, 100.0, 10.0, 0.05, 0.0, 0.2, n, False, True)
    print(f"N={n:,} oracle {ref!r} ({time.perf_counter() - t:.1f} s)", flush=True)
    book = dict(id=np.array([1]), spot=np.array([100.0]), strike=np.array([100.0]),
                maturity=np.array([10.0]), rate=np.array([0.05]), dividend=np.array([0.0]),
                volatility=np.array([0.2]), steps=np.array([n]), call=np.array([False]),
                american=np.array([True]))
    for backend in ("cpu", "gpu", "hybrid", "batch", "auto"):
        t = time.perf_counter()
        try:
            got = float(price(book, backend=backend)["price"][0])
        except Exception as error:   # a GPU backend on a machine without one
            print(f"  {backend:7s} unavailable: {str(error).splitlines()[0]}")
            continue
        print(f"  {backend:7s} {got!r}  rel {abs(got - ref) / ref:.2e}  "
              f"({time.perf_counter() - t:.1f} s)", flush=True)
