"""The cost model, written once: what a lattice costs, and which lattices a run prices.

A recombining binomial lattice of N steps has (N+1)(N+2)/2 nodes, and every engine's work is
proportional to them (a node is a fixed handful of FP64 operations), so nodes are the unit in
which the partition balances ranks (partition.py), chunks are cut (pricer/run/chunks.py), the
CPU engine balances its threads, the memory guard sizes buffers, and summaries report speed.
The lattices a run prices per option come from its analytics (greeks.Analytics.lattices).
"""

from __future__ import annotations

import numpy as np


def lattice_nodes(steps) -> np.ndarray:
    """Nodes of a recombining lattice with N steps: (N+1)(N+2)/2, as float64 (exact below 2^53)."""
    # in place, two arrays rather than four temporaries: each is a fresh allocation (page faults)
    # on a large book
    nodes = np.array(steps, dtype=np.float64)
    nodes += 1.0
    nodes *= nodes + 1.0
    nodes *= 0.5
    return nodes


def option_cost(steps) -> np.ndarray:
    """Work per option: its lattice nodes, (N+1)(N+2)/2 ~ N^2/2."""
    return lattice_nodes(steps)


def nodes_priced(steps, analytics) -> float:
    """Lattice nodes the options of `steps` really cost under `analytics`: every lattice it
    prices per option (Analytics.lattices), each Analytics.rounds times."""
    return float(analytics.rounds * sum(count * lattice_nodes(s).sum()
                                        for s, count in analytics.lattices(steps)))
