"""How a reducer combines a group's contributions to one chunk. A contribution's values and weight are whatever its
sender chose, so besides the plain weighted mean there are robust aggregates that bound how far any one
contribution (or a minority of them) can move the result: CenteredClip (Karimireddy et al. 2021, as BTARD runs it
inside a butterfly all-reduce) and the coordinate-wise trimmed mean. Every reducer of a group runs the same
function on the same members, so all reducers agree on the weights they name."""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from swarm.averaging.common import chunk_bounds
from swarm.averaging.partition import partition
from swarm.averaging.verify import RADIUS_CEILING, RADIUS_FLOOR, lower_median, norm_cap, shrink

# A robust aggregate counts no contribution as more than this many times the group's (lower) median weight: a
# weight is declared by its sender, and one inflated weight would otherwise outvote the rest (at 1.5, one of three
# members holds at most 3/7 of the weight, one of four 1/3). An honest peer 10x faster than the median counts 1.5x;
# its pseudo-gradient, from more steps, is larger anyway.
WEIGHT_SPREAD = 1.5
# ... and no contribution as more than this fraction of the other members' (capped) total, so that no member holds
# more than 3/7 of a group's weight (the share the spread allows one of three equal members). The median cap alone
# let a member of a group of three whose honest weights differ hold half the weight (1, 2 and a liar's 4: the 4
# capped to 3 of 6), and a member holding half can pull CenteredClip anywhere.
OTHERS_SHARE = 0.75
# CenteredClip's radius, in medians of the distances between the medoid and the other contributions. Within it a
# contribution counts whole; honest contributions lie well inside (an honest one is about 0.7 of these distances
# from the group's mean: see tests/test_aggregate.py).
CLIP_RADIUS = 1.5
CLIP_ITERATIONS = 100  # Newton steps at most (real groups took up to 16, mostly under 10: see _fixed_point)
CLIP_TOLERANCE = 1e-6  # stop once sum_i w_i clip(x_i - v) is this small, in the group's weight times the radius
GRAM_BLOCK = 1 << 18  # elements per float64 block of a Gram matrix or of the final combination (bounds the copies)
# (contributions, their declared weights) -> (the aggregate, the total weight it counts)
Aggregate = Callable[[Sequence[torch.Tensor], Sequence[float]], tuple[torch.Tensor, float]]


def capped_weights(weights: Sequence[float]) -> list[float]:
    """`weights`, each at most WEIGHT_SPREAD times the lower median of the positive ones (the median of an honest
    majority of the members that trained: members that trained nothing this round, such as a pipeline stage's
    peers no microbatch reached, must not cap the rest to nothing), then at most OTHERS_SHARE times the sum of the
    others' (so no member holds more than 3/7 of the total). Two positive weights are left as they are: of two
    members neither is a majority, and either could send any values."""
    positive = sorted(float(w) for w in weights if w > 0)
    if len(positive) <= 2:
        return [float(w) for w in weights]
    ceiling = WEIGHT_SPREAD * positive[(len(positive) - 1) // 2]
    capped = [min(float(w), ceiling) for w in weights]
    total = sum(capped)
    return [min(w, OTHERS_SHARE * (total - w)) for w in capped]


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
    values; weights capped (capped_weights). The total weight is that of all contributions: each took part.
    Contributions of weight 0 (members that trained nothing) are left out first: trimmed, they could leave a
    coordinate with no weight at all."""
    if 0 < sum(1 for w in weights if w > 0) < len(weights):
        parts, weights = zip(*[(p, w) for p, w in zip(parts, weights) if w > 0])
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
    """CenteredClip with weights capped (capped_weights) and contributions cut to the norm cap (verify.norm_cap):
    the point v where the weighted mean of the contributions, each pulled in to within radius tau of v, is v itself.
    tau is CLIP_RADIUS times the median distance from the medoid (the contribution closest, in sum, to all others:
    an honest one while they are a majority) to the others, so one far contribution moves the result by at most
    about tau times its share of the weight, however far it is. When every contribution lies within tau of the
    plain weighted mean (and none is longer than the cap), that mean is the fixed point, and it is returned exactly
    (a group of two always is). Deciding that costs one Gram matrix of the
    contributions (about what the mean costs); only a group with a far contribution solves for the fixed point
    (one more Gram matrix, a few Newton steps among n coordinates, and one pass to put the point together)."""
    average, total_weight, _, _ = centered_clip_radius(parts, weights)
    return average, total_weight


def centered_clip_radius(parts: Sequence[torch.Tensor], weights: Sequence[float],
                         norms: Optional[Sequence[float]] = None) -> tuple[torch.Tensor, float, float, float]:
    """centered_clip, the radius tau it used (inf for a group of two, which takes the plain mean) and the norm cap
    (norm_cap) its contributions were cut to first. tau stays within the bounds members check it against
    (verify.py): between RADIUS_FLOOR and RADIUS_CEILING times the lower median of the contributions' norms (which
    the cap leaves as it is: the cap is above that median). `norms`: the parts' norms, where the caller has them."""
    weights = capped_weights(weights)
    norms = list(norms) if norms is not None else [float(torch.linalg.vector_norm(part, dtype=torch.float64))
                                                   for part in parts]
    cap = norm_cap(norms, weights)
    parts = [part * shrink(n, cap) if n > cap else part for part, n in zip(parts, norms)]
    plain, total_weight = mean(parts, weights)
    if len(parts) <= 2:
        return plain, total_weight, math.inf, cap
    stacked = torch.stack(list(parts)).flatten(1)
    offsets = stacked - plain.flatten()
    gram = (offsets @ offsets.T).double()  # of the offsets from the mean, so that distances do not cancel
    to_mean = gram.diagonal().clamp_min(0).sqrt()
    pairwise = (gram.diagonal()[:, None] + gram.diagonal()[None, :] - 2 * gram).clamp_min(0).sqrt()
    medoid = int(pairwise.sum(1).argmin())
    others = torch.cat([pairwise[medoid, :medoid], pairwise[medoid, medoid + 1:]])
    # Within the bounds every member checks (verify.py), which follow the contributions' norms alone, so an honest
    # radius always meets them: the medoid's radius, raised to the floor or cut to the ceiling where it falls out.
    norm = lower_median(norms)
    tau = min(max(CLIP_RADIUS * float(others.median()), RADIUS_FLOOR * norm), RADIUS_CEILING * norm)
    if float(to_mean.max()) <= tau * (1 + 1e-6):
        return plain, total_weight, tau, cap
    return _clip_point(stacked, weights, medoid, tau).view_as(plain), total_weight, tau, cap


def _clip_point(stacked: torch.Tensor, weights: Sequence[float], medoid: int, tau: float) -> torch.Tensor:
    """CenteredClip's fixed point v: sum_i w_i clip_tau(x_i - v) = 0, to CLIP_TOLERANCE of the total weight times
    tau (the sum members check, verify.py). v is a weighted mean of the contributions (sum_i a_i x_i / sum_i a_i,
    a_i = w_i min(1, tau / |x_i - v|)), so it lies in their span, where every distance that decides it follows from
    the Gram matrix of their offsets from the medoid: v is solved for there, in at most n - 1 coordinates, and put
    together in one pass. (The plain iteration v += sum_i w_i clip_tau(x_i - v) / W moves v at most tau a step: with
    two members a warm-up step in and two trained ones, tau is cut to 4x the small norms and the fixed point lay
    ~80 radii from the medoid, so 100 steps stopped short, leaving a tenth of W tau of the sum, which the members'
    check refused.)"""
    origin = stacked[medoid]
    if tau <= 0.0:  # (every clipped term is zero: any point is a fixed point)
        return origin.clone()
    offsets = stacked - origin
    coordinates, basis = _coordinates(_gram(offsets))
    if not basis:  # (every contribution is the medoid's)
        return origin.clone()
    point = _fixed_point(coordinates, np.asarray(weights, dtype=np.float64), tau)
    # coordinates[basis] is lower triangular: the basis vectors are combinations of those members' offsets.
    coefficients = torch.from_numpy(np.linalg.solve(coordinates[basis].T, point))
    centre = torch.empty_like(origin)
    for a in range(0, origin.numel(), GRAM_BLOCK):
        block = slice(a, a + GRAM_BLOCK)
        centre[block] = (origin[block].double() + coefficients @ offsets[basis, block].double()).to(centre.dtype)
    return centre


def _gram(rows: torch.Tensor) -> np.ndarray:
    """rows @ rows.T, accumulated in float64."""
    gram = torch.zeros(rows.shape[0], rows.shape[0], dtype=torch.float64)
    for a in range(0, rows.shape[1], GRAM_BLOCK):
        block = rows[:, a:a + GRAM_BLOCK].double()
        gram += block @ block.T
    return gram.numpy()


def _coordinates(gram: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """Coordinates of the vectors whose Gram matrix is `gram` in an orthonormal basis of their span (a Cholesky
    factorisation, shortest vectors first, so that a far contribution's rounding does not swamp the differences of
    the near ones), and the rows whose vectors span it, in basis order. A vector within 1e-6 of its own length of
    the span of the shorter ones adds no direction."""
    n = len(gram)
    coordinates, basis = np.zeros((n, n)), []
    for j in np.argsort(np.diag(gram), kind="stable"):
        for k, p in enumerate(basis):
            coordinates[j, k] = (gram[j, p] - coordinates[j, :k] @ coordinates[p, :k]) / coordinates[p, k]
        rest = gram[j, j] - coordinates[j, :len(basis)] @ coordinates[j, :len(basis)]
        if rest > 1e-12 * gram[j, j]:
            coordinates[j, len(basis)] = math.sqrt(rest)
            basis.append(int(j))
    return coordinates[:, :len(basis)], basis


def _fixed_point(points: np.ndarray, weights: np.ndarray, tau: float) -> np.ndarray:
    """The v (coordinates like `points`, one member a row, the medoid at the origin) where the pull
    sum_i w_i clip_tau(p_i - v) is below CLIP_TOLERANCE of the total weight times tau: Newton's method on the
    Huber loss whose negative gradient the pull is, each step halved until the pull shrinks, or where halving does
    not help, the weighted-mean step v = sum_i a_i p_i / sum_i a_i (which never increases the loss). Starts at the
    medoid."""
    total, dimensions = float(weights.sum()), points.shape[1]
    centre = np.zeros(dimensions)
    pull, offsets, distances, shares = _pull(points, weights, tau, centre)
    for _ in range(CLIP_ITERATIONS):
        size = float(np.linalg.norm(pull))
        if size <= CLIP_TOLERANCE * total * tau:
            break
        # The loss's Hessian: sum_i a_i I, less a_i u_i u_i^T for each clipped member (u_i its unit offset).
        clipped = distances > tau
        directions = offsets[clipped] / distances[clipped, None]
        hessian = shares.sum() * np.eye(dimensions) - (directions.T * shares[clipped]) @ directions
        step = np.linalg.solve(hessian + 1e-12 * shares.sum() * np.eye(dimensions), pull)
        fraction = 1.0
        while True:
            trial = _pull(points, weights, tau, centre + fraction * step)
            if np.linalg.norm(trial[0]) <= (1 - 1e-4 * fraction) * size:
                break
            fraction /= 2
            if fraction < 2 ** -20:
                step, fraction = pull / shares.sum(), 1.0
                trial = _pull(points, weights, tau, centre + step)
                break
        centre = centre + fraction * step
        pull, offsets, distances, shares = trial
    return centre


def _pull(points: np.ndarray, weights: np.ndarray, tau: float,
          centre: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """sum_i w_i clip_tau(p_i - centre), and the offsets, their lengths and the a_i = w_i min(1, tau / length)."""
    offsets = points - centre
    distances = np.linalg.norm(offsets, axis=1)
    shares = weights * np.minimum(1.0, tau / np.maximum(distances, 1e-300))
    return shares @ offsets, offsets, distances, shares


def aggregate_parts(name: str, vectors: Sequence[torch.Tensor], weights: Sequence[float],
                    shares: Sequence[float], align: int = 1) -> tuple[torch.Tensor, float]:
    """What a butterfly's reducers make of the members' `vectors` (no lossless tail): reducer j aggregates each
    chunk of part j (the chunks of butterfly.py; parts cut in units of `align`, the codec's alignment) with the
    aggregate `name`. Returns the average and total weight."""
    aggregate, average, total = aggregator(name), torch.empty_like(vectors[0]), 0.0
    for start, end in partition(vectors[0].numel(), list(shares), align):
        for a, b in chunk_bounds(start, end):
            average[a:b], total = aggregate([vector[a:b] for vector in vectors], weights)
    return average, total


def aggregator(name: str) -> Aggregate:
    """The aggregate named by a recipe's `averaging.aggregator`."""
    return {"mean": mean, "trimmed_mean": trimmed_mean, "centered_clip": centered_clip}[name]
