"""What the tools write beside their printed tables: a bench's measurements as JSON, a CSV and a
markdown file of a table, and matplotlib for their plots where it is installed (the `plot`
extra)."""

from __future__ import annotations

import csv
import json
import os
import sys


def write_json(path: str | None, data, indent: int = 1) -> None:
    """`data` as JSON at `path` (`--out`; None: nothing written), NumPy scalars as numbers."""
    if path:
        with open(path, "w") as f:
            json.dump(data, f, indent=indent, default=lambda o: o.item())


def pyplot():
    """matplotlib.pyplot on the Agg backend (files, no screen), or None, said on stderr, where
    matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        print("pricer: matplotlib is not installed (the `plot` extra): no PNG written",
              file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def write_outputs(folder: str, stem: str, rows: list[dict], columns, table: list[str]) -> None:
    """FOLDER/STEM.csv of `rows` (the `columns` of each; floats to 6 digits) and FOLDER/STEM.md
    of the lines of `table`."""
    with open(os.path.join(folder, f"{stem}.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(columns), extrasaction="ignore")
        w.writeheader()
        for row in rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()})
    with open(os.path.join(folder, f"{stem}.md"), "w") as f:
        f.write("\n".join(table) + "\n")
