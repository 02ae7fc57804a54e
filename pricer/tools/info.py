"""`pricer info FILE`: a short description of a portfolio or a results file."""

from __future__ import annotations

import h5py
import numpy as np

from pricer.errors import InputError
from pricer.files import check_input_file
from pricer.io.portfolio import GROUP, read_portfolio


def describe(path: str) -> list[str]:
    check_input_file(path)
    if not h5py.is_hdf5(path):
        raise InputError(f"{path}: not an HDF5 file")
    try:
        with h5py.File(path, "r") as f:
            kind = "results" if "results" in f else GROUP
        return _describe_results(path) if kind == "results" else _describe_portfolio(path)
    except (OSError, KeyError, ValueError, TypeError) as exc:   # cut short, or not pricer's
        raise InputError(f"{path}: cannot read it: {exc}") from None


def _describe_portfolio(path: str) -> list[str]:
    p = read_portfolio(path)
    steps = p.steps
    return [
        f"{path}: portfolio (pricer.portfolio/1), {len(p)} options, {p.nodes():.4g} lattice nodes",
        f"  steps N: min {steps.min()}, median {int(np.median(steps))}, max {steps.max()}",
        f"  calls {int(p.call.sum())}, puts {int((~p.call).sum())}; "
        f"american {int(p.american.sum())}, european {int((~p.american).sum())}",
        f"  spot {p.spot.min():.4g}..{p.spot.max():.4g}, strike {p.strike.min():.4g}..{p.strike.max():.4g}, "
        f"maturity {p.maturity.min():.4g}..{p.maturity.max():.4g}, "
        f"volatility {p.volatility.min():.4g}..{p.volatility.max():.4g}",
    ]


def _describe_results(path: str) -> list[str]:
    from pricer.model.greeks import GREEKS
    from pricer.io.results import read_results

    r = read_results(path)
    attrs = r["attrs"]
    lines = [f"{path}: results ({attrs.get('schema')}), {r['price'].size} prices, "
             f"min {r['price'].min():.6g}, max {r['price'].max():.6g}"]
    greeks = [name for name in GREEKS if name in r]  # written by --greeks
    if greeks:
        lines.append(f"  Greeks: {', '.join(greeks)}")
        for name in greeks:
            lines.append(f"    {name}: min {r[name].min():.6g}, max {r[name].max():.6g}")
    for key in sorted(attrs):
        if key != "schema":
            lines.append(f"  {key}: {attrs[key]}")
    for rank, (sec, opts, nodes) in enumerate(zip(r["run"]["seconds"], r["run"]["options"],
                                                 r["run"]["nodes"])):
        lines.append(f"  rank {rank}: {opts} options, {nodes:.4g} nodes, {sec:.3f}s")
    return lines
