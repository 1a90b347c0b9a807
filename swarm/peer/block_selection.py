"""Which contiguous blocks a joining peer hosts: the range where the swarm is weakest, as Petals'
`block_selection.py` does. A pure function of the swarm view, so every peer with the same view computes the same.
"""

from __future__ import annotations

from typing import Sequence

from swarm.dht.records import PeerRecord
from swarm.dht.view import block_throughputs


def choose_block_range(view: Sequence[PeerRecord], n_blocks: int, capacity: int) -> tuple[int, int]:
    """The range [start, start + min(capacity, n_blocks)) whose hosted throughput is lowest.

    Windows compare by their blocks' throughputs sorted ascending (the weakest block first, then the next), and
    ties go to the lowest start, so an empty swarm gives [0, capacity). `view` should exclude the caller's own
    record. Raises ValueError if `n_blocks` or `capacity` is not positive."""
    if n_blocks <= 0 or capacity <= 0:
        raise ValueError(f"n_blocks ({n_blocks}) and capacity ({capacity}) must be positive")
    length = min(capacity, n_blocks)
    throughputs = block_throughputs(view, n_blocks)
    start = min(range(n_blocks - length + 1), key=lambda i: (sorted(throughputs[i:i + length]), i))
    return start, start + length
