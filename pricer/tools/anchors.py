"""The benches' independent anchors, timed beside pricer in the same run: QuantLib (the `bench`
extra, `pip install 'pricer[bench]'`). A bench whose anchor is not installed says so once and
times the rest; its JSON then has no anchor figures and its verdicts say "not measured"."""

from __future__ import annotations

import sys

EXTRA = "pip install 'pricer[bench]'"


def have_quantlib(bench: str) -> bool:
    """Whether QuantLib can be imported; if not, a line on stderr saying that `pricer bench
    BENCH` runs without it."""
    try:
        import QuantLib  # noqa: F401
        return True
    except ImportError:
        pass
    print(f"pricer bench {bench}: QuantLib, its anchor, is not installed ({EXTRA}): the QuantLib "
          f"figures are left out", file=sys.stderr, flush=True)
    return False


def missing(what: str) -> str:
    """A verdict's text where the anchor was not there to measure against."""
    return f"{what}: not measured (QuantLib is not installed: {EXTRA})"
