"""How a reducer combines a group's contributions to one chunk. A contribution's values and weight are whatever its
sender chose, so besides the plain weighted mean there are robust aggregates that bound how far any one
contribution (or a minority of them) can move the result: CenteredClip (Karimireddy et al. 2021, as BTARD runs it
inside a butterfly all-reduce) and the coordinate-wise trimmed mean. Every reducer of a group runs the same
function on the same members, so all reducers agree on the weights they name."""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

from swarm.averaging.common import chunk_bounds
from swarm.averaging.partition import partition
from swarm.averaging.verify import RADIUS_CEILING, RADIUS_FLOOR

AGGREGATORS = ("mean", "trimmed_mean", "centered_clip")
# A robust aggregate counts no contribution as more than this many times the group's (lower) median weight: a
# weight is declared by its sender, and one inflated weight would otherwise outvote the rest (at 1.5, one of three
# members holds at most 3/7 of the weight, one of four 1/3). An honest peer 10x faster than the median counts 1.5x;
# its pseudo-gradient, from more steps, is larger anyway.
WEIGHT_SPREAD = 1.5
# CenteredClip's radius, in medians of the distances between the medoid and the other contributions. Within it a
# contribution counts whole; honest contributions lie well inside (an honest one is about 0.7 of these distances
# from the group's mean: see tests/test_aggregate.py).
CLIP_RADIUS = 1.5
CLIP_ITERATIONS = 100  # (it stops long before, at CLIP_TOLERANCE, in groups seen so far)
CLIP_TOLERANCE = 1e-6  # stop iterating once a step moves the centre less than this fraction of the radius
# (contributions, their declared weights) -> (the aggregate, the total weight it counts)
Aggregate = Callable[[Sequence[torch.Tensor], Sequence[float]], tuple[torch.Tensor, float]]


def capped_weights(weights: Sequence[float]) -> list[float]:
    """`weights`, each at most WEIGHT_SPREAD times the lower median of them (the median of an honest majority).
    Two weights are left as they are: of two members neither is a majority, and either could send any values."""
    if len(weights) <= 2:
        return [float(w) for w in weights]
    ceiling = WEIGHT_SPREAD * sorted(weights)[(len(weights) - 1) // 2]
    return [min(float(w), ceiling) for w in weights]


def mean(parts: Sequence[torch.Tensor], weights: Sequence[float]) -> tuple[torch.Tensor, float]:
    """The weighted mean and the total weight (summed in order: every reducer gets the same bits for the same
    inputs)."""
    total, total_weight = parts[0] * weights[0], float(weights[0])
    for part, weight in zip(parts[1:], weights[1:]):
        total += part * weight
        total_weight += weight
    return total / total_weight, total_weight


def trimmed_mean(parts: Sequence[torch.Tensor], weights: Sequence[float]) -> tuple[torch.Tensor, float]:
    """Per coordinate, the weighted mean of what is left after dropping the `trimmed(n)` largest and smallest
    values; weights capped (capped_weights). The total weight is that of all contributions: each took part."""
    weights = capped_weights(weights)
    n, cut = len(parts), trimmed(len(parts))
    if cut == 0:
        return mean(parts, weights)
    stacked = torch.stack(list(parts))
    values, order = torch.sort(stacked, dim=0)
    kept_weights = torch.tensor(weights, dtype=stacked.dtype)[order[cut:n - cut]]
    kept = values[cut:n - cut]
    return (kept * kept_weights).sum(0) / kept_weights.sum(0), float(sum(weights))


def trimmed(n: int) -> int:
    """How many values trimmed_mean drops at each end among n: none of two, then a fifth, rounded up."""
    return 0 if n <= 2 else -(-n // 5)


def centered_clip(parts: Sequence[torch.Tensor], weights: Sequence[float]) -> tuple[torch.Tensor, float]:
    """CenteredClip with weights capped (capped_weights): the point v where the weighted mean of the contributions,
    each pulled in to within radius tau of v, is v itself. tau is CLIP_RADIUS times the median distance from the
    medoid (the contribution closest, in sum, to all others: an honest one while they are a majority) to the
    others, so one far contribution moves the result by at most about tau times its share of the weight, however
    far it is. When every contribution lies within tau of the plain weighted mean, that mean is the fixed point,
    and it is returned exactly (a group of two always is). Deciding that costs one Gram matrix of the
    contributions (about what the mean costs); only a group with a far contribution iterates."""
    average, total_weight, _ = centered_clip_radius(parts, weights)
    return average, total_weight


def centered_clip_radius(parts: Sequence[torch.Tensor],
                         weights: Sequence[float]) -> tuple[torch.Tensor, float, float]:
    """centered_clip, and the radius tau it used (inf for a group of two, which takes the plain mean). tau stays
    within the bounds members check it against (verify.py): between RADIUS_FLOOR and RADIUS_CEILING times the lower
    median of the contributions' norms."""
    weights = capped_weights(weights)
    plain, total_weight = mean(parts, weights)
    if len(parts) <= 2:
        return plain, total_weight, math.inf
    stacked = torch.stack(list(parts)).flatten(1)
    offsets = stacked - plain.flatten()
    gram = (offsets @ offsets.T).double()  # of the offsets from the mean, so that distances do not cancel
    to_mean = gram.diagonal().clamp_min(0).sqrt()
    pairwise = (gram.diagonal()[:, None] + gram.diagonal()[None, :] - 2 * gram).clamp_min(0).sqrt()
    medoid = int(pairwise.sum(1).argmin())
    others = torch.cat([pairwise[medoid, :medoid], pairwise[medoid, medoid + 1:]])
    # Within the bounds every member checks (verify.py), which follow the contributions' norms alone, so an honest
    # radius always meets them: the medoid's radius, raised to the floor or cut to the ceiling where it falls out.
    norm = _lower_median(stacked.double().norm(dim=1))
    tau = min(max(CLIP_RADIUS * float(others.median()), RADIUS_FLOOR * norm), RADIUS_CEILING * norm)
    if float(to_mean.max()) <= tau * (1 + 1e-6):
        return plain, total_weight, tau
    centre = _clip_point(stacked, weights, total_weight, stacked[medoid].clone(), tau)
    return centre.view_as(plain), total_weight, tau


def _clip_point(stacked: torch.Tensor, weights: Sequence[float], total_weight: float, centre: torch.Tensor,
                tau: float) -> torch.Tensor:
    """CenteredClip's iteration from `centre`, until a step moves it less than CLIP_TOLERANCE of tau."""
    if tau <= 0.0:
        return centre
    w = torch.tensor(weights, dtype=stacked.dtype)[:, None]
    for _ in range(CLIP_ITERATIONS):
        differences = stacked - centre
        scale = (tau / differences.norm(dim=1).clamp_min(1e-30)).clamp(max=1.0)[:, None]
        step = (differences * (w * scale)).sum(0) / total_weight
        centre += step
        if float(step.norm()) <= CLIP_TOLERANCE * tau:
            break
    return centre


def _lower_median(values: torch.Tensor) -> float:
    return float(values.sort().values[(values.numel() - 1) // 2])


def aggregate_parts(name: str, vectors: Sequence[torch.Tensor], weights: Sequence[float],
                    shares: Sequence[float]) -> tuple[torch.Tensor, float]:
    """What a butterfly's reducers make of the members' `vectors` (no lossless tail): reducer j aggregates each
    chunk of part j (the chunks of butterfly.py) with the aggregate `name`. Returns the average and total weight."""
    aggregate, average, total = aggregator(name), torch.empty_like(vectors[0]), 0.0
    for start, end in partition(vectors[0].numel(), list(shares)):
        for a, b in chunk_bounds(start, end):
            average[a:b], total = aggregate([vector[a:b] for vector in vectors], weights)
    return average, total


def aggregator(name: str) -> Aggregate:
    """The aggregate named by a recipe's `averaging.aggregator`."""
    return {"mean": mean, "trimmed_mean": trimmed_mean, "centered_clip": centered_clip}[name]
