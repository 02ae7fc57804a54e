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


def lattice_costs(steps) -> tuple[np.ndarray, np.ndarray]:
    """lattice_nodes(steps), and their prefix sums [0, n0, n0 + n1, ...] as np.cumsum gives them,
    a block of COST_ROWS at a time: a block's temporaries stay in the CPU's cache, so a large book
    is read once and its two results written once (rather than ten passes over its memory, the
    most of this part of rank 0's plan). The nodes are whole numbers >= 0, so while their total
    is below 2^53 every partial sum is exact and a block's sums plus the sum before it are the
    serial sums' very numbers; a larger total is summed serially."""
    steps = np.asarray(steps)
    n = steps.size
    nodes, prefix = np.empty(n), np.empty(n + 1)
    prefix[0] = 0.0
    for a in range(0, n, COST_ROWS):
        b = min(n, a + COST_ROWS)
        block, sums = nodes[a:b], prefix[a + 1:b + 1]
        block[:] = steps[a:b]
        block += 1.0
        block *= block + 1.0
        block *= 0.5
        np.cumsum(block, out=sums)
        sums += prefix[a]
    if prefix[-1] >= EXACT_SUMS:
        np.cumsum(nodes, out=prefix[1:])
    return nodes, prefix


COST_ROWS = 1 << 15
EXACT_SUMS = 2.0**53


def option_cost(steps) -> np.ndarray:
    """Work per option: its lattice nodes, (N+1)(N+2)/2 ~ N^2/2."""
    return lattice_nodes(steps)


def nodes_priced(steps, analytics) -> float:
    """Lattice nodes the options of `steps` really cost under `analytics`: every lattice it
    prices per option (Analytics.lattices), each Analytics.rounds times."""
    return float(analytics.rounds * sum(count * lattice_nodes(s).sum()
                                        for s, count in analytics.lattices(steps)))
