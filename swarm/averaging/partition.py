"""Which part of the vector each group member reduces: shares chosen from measured bandwidth so the slowest link
does not set the pace, and contiguous element ranges from those shares. Pure functions, same answer on every peer.
"""

from __future__ import annotations

from typing import Sequence


def optimal_shares(bandwidths: Sequence[float], can_reduce: Sequence[bool]) -> list[float]:
    """Fractions p_i (summing to 1) of the vector that member i reduces.

    In a butterfly all-reduce of S bytes, member i uploads (and downloads) S * (1 + (N - 2) * p_i): its parts for
    the other reducers plus its averaged part for every other member. With bandwidth B_i that takes
    S * (1 + (N - 2) * p_i) / B_i, so we minimise the largest of these: p_i = max(0, (T * B_i - 1) / (N - 2)) for
    the smallest round time T (in units of S) at which the shares sum to 1. Members that cannot accept
    connections (client mode) or report no bandwidth reduce nothing. Raises ValueError if nobody can reduce."""
    n = len(bandwidths)
    eligible = [i for i in range(n) if can_reduce[i] and bandwidths[i] > 0]
    if not eligible:
        raise ValueError("no group member can reduce: every member is in client mode or reports no bandwidth")
    if n <= 2 or len(eligible) == 1:
        # With two members each moves S whatever the split, so balance compute by bandwidth instead.
        total = sum(bandwidths[i] for i in eligible)
        return [bandwidths[i] / total if i in eligible else 0.0 for i in range(n)]

    def shares_at(time: float) -> list[float]:
        return [max(0.0, (time * bandwidths[i] - 1) / (n - 2)) if i in eligible else 0.0 for i in range(n)]

    low, high = 0.0, 1.0 / max(bandwidths[i] for i in eligible)
    while sum(shares_at(high)) < 1:
        high *= 2
    for _ in range(100):  # bisection to float precision
        middle = (low + high) / 2
        if sum(shares_at(middle)) < 1:
            low = middle
        else:
            high = middle
    shares = shares_at(high)
    total = sum(shares)
    return [share / total for share in shares]


def partition(numel: int, shares: int | Sequence[float], align: int = 1) -> list[tuple[int, int]]:
    """Contiguous [start, end) ranges covering `numel` elements, sized by `shares` (or `shares` equal parts);
    sizes are rounded by largest remainder, so they add up to `numel` exactly. With `align`, they are cut in whole
    units of that many elements (the last unit may be short), so every range starts at a multiple of it (the
    sparse codec's chunks: Codec.alignment)."""
    if isinstance(shares, int):
        shares = [1.0] * shares
    total = sum(shares)
    if total <= 0 or any(share < 0 for share in shares):
        raise ValueError(f"shares must be non-negative with a positive sum, got {list(shares)}")
    units = -(-numel // align)
    exact = [units * share / total for share in shares]
    sizes = [int(value) for value in exact]
    by_remainder = sorted(range(len(shares)), key=lambda i: (-(exact[i] - sizes[i]), i))
    for i in by_remainder[:units - sum(sizes)]:
        sizes[i] += 1
    bounds, start = [], 0
    for size in sizes:
        bounds.append((min(start * align, numel), min((start + size) * align, numel)))
        start += size
    return bounds
