"""What the tools write beside their printed tables: a bench's measurements as JSON, a CSV and a
markdown file of a table, matplotlib for their plots where it is installed (the `plot` extra),
and the folders they write them in (make_folders)."""

from __future__ import annotations

import csv
import json
import os
import shutil
import sys

from pricer.errors import InputError


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


def make_folders(paths) -> list[str]:
    """Each folder of `paths` made, with its missing parents; returns those this call made,
    outermost first. InputError (one line) where a path or a parent is not a folder or cannot
    be made, and then nothing is left of what it made."""
    made = []
    try:
        for path in paths:
            missing, here = [], os.path.abspath(path)
            while not os.path.isdir(here):
                if os.path.lexists(here):
                    which = "" if here == os.path.abspath(path) else f" {here}"
                    raise InputError(f"{path}:{which} exists and is not a folder")
                missing.append(here)
                here = os.path.dirname(here)
            for folder in reversed(missing):
                try:
                    os.mkdir(folder)
                except OSError as exc:
                    raise InputError(f"{path}: cannot make the folder {folder}: "
                                     f"{exc.strerror}") from None
                made.append(folder)
    except InputError:
        remove_made(made)
        raise
    return made


def remove_made(made: list[str]) -> None:
    """Remove the folders make_folders made (outermost first), with what was written in them."""
    for folder in made:
        if os.path.isdir(folder):
            shutil.rmtree(folder, ignore_errors=True)
