"""Checking a reducer's CenteredClip without its inputs (issue 24: a lying reducer). A reducer's averaged part is
the point v where the weighted sum of the members' contributions, each pulled in to within radius tau of v, is zero
(chunk by chunk, see aggregate.centered_clip). Every member can compute its own term of that sum (it knows its
contribution and v) but no other's; so each member sends a random sketch of its own term, the reducer sends the
sketches of every member's term as it computed them, and every member checks that (1) the reducer's sketch of each
member's term is the one that member sent (a mismatch parts the two, as an accusation does), (2) the reducer's
sketches sum to zero within what its codec and the iteration leave, and (3) its radius and the terms it alone
knows (its own contribution's) are within the bounds an honest group keeps. The sketch's randomness comes from
nonces every member committed to in its matchmaking entry and reveals only once it holds every averaged part, so a
reducer cannot shape its lie to the sketch.

A count sketch (every element goes to one of SKETCH_BUCKETS buckets with a random sign) preserves a fixed vector's
norm within a few percent, costs one pass, and is the same on every member for the same seed. Pure functions: the
butterfly (butterfly.py) moves the reports."""

from __future__ import annotations

import hashlib
import itertools
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from swarm.compression import Codec

SKETCH_BUCKETS = 1024
SKETCH_BLOCK = 1 << 16  # elements a sketch works on at a time (Sketch.offsets)
# ||S u||^2 <= SKETCH_SLACK * ||u||^2 for a vector u fixed before the sketch S is drawn, but for a vanishing chance
# (the sketched squared norm deviates by about sqrt(2 / SKETCH_BUCKETS) = 4% of it).
SKETCH_SLACK = 1.5
# The radius a reducer may name for a chunk, in lower medians of the contributions' norms (which its members
# report, so a liar moves the median no further than the honest members' norms): at most RADIUS_CEILING (a radius
# past every contribution would let its own far contribution through whole), at least RADIUS_FLOOR (a radius near
# zero would make every term, and the check, vanish). An honest reducer's radius is cut to these bounds where its
# medoid's would fall out (aggregate.py); bounds that follow the distances to the result could exclude each other
# when one member trained far more than the rest.
RADIUS_CEILING = 4.0
RADIUS_FLOOR = 0.25
# CenteredClip (aggregate.py) first cuts every contribution's chunk to this many times the weighted lower median of
# the norms of the chunk's contributions (norm clipping before the robust mean, as Karimireddy et al. suggest): a
# member sending x1000 of its honest pseudo-gradient then counts as an honest one 1.5x longer would, instead of a
# radius past the result every round. An honest member whose chunk is longer (it made more steps) counts as 1.5x
# the median, as its weight does. Members check the cap a reducer names against the norms they report.
NORM_SPREAD = 1.5
# What an honest reducer's result may leave of the sum, besides its codec's rounding, in radii times the group's
# weight: CenteredClip solves for its fixed point to aggregate.CLIP_TOLERANCE (1e-6) of that, in float64
# coordinates (on real pseudo-gradients, a x1e9 member among them, the float32 result left at most 1.4e-3, its own
# rounding included, which FLOAT_SLACK covers besides). A lie must move the result by about a radius to matter, and
# the reducer's own term hides one of its weight share times sqrt(SKETCH_SLACK) radii anyway.
CONVERGENCE = 2e-2
FLOAT_SLACK = 1e-5  # relative: members compute in different orders (and on different hardware)


@dataclass(frozen=True)
class Term:
    """One member's term of one part's sum, as sketched: the sketch of its clipped offsets from the result, and per
    chunk the norm of its contribution and its distance to the result."""

    sketch: tuple[float, ...]
    norms: tuple[float, ...]
    distances: tuple[float, ...]

    def to_wire(self) -> list:
        return [list(self.sketch), list(self.norms), list(self.distances)]

    @classmethod
    def from_wire(cls, value, chunks: int) -> Optional["Term"]:
        """The term a peer sent, or None if it is malformed."""
        if not (isinstance(value, list) and len(value) == 3 and all(isinstance(v, list) for v in value)):
            return None
        sketch, norms, distances = value
        if len(sketch) != SKETCH_BUCKETS or len(norms) != chunks or len(distances) != chunks:
            return None
        numbers = [*sketch, *norms, *distances]
        if not all(isinstance(x, float) and math.isfinite(x) for x in numbers) or min(norms + distances,
                                                                                      default=0) < 0:
            return None
        return cls(tuple(sketch), tuple(norms), tuple(distances))


def nonce_commitment(nonce: bytes) -> str:
    return hashlib.sha256(nonce).hexdigest()[:32]


def part_seed(group_id: str, nonces: Sequence[bytes], part: int) -> bytes:
    """The seed of part `part`'s sketch: the group's id and every member's nonce (in member order)."""
    digest = hashlib.sha256(group_id.encode())
    for nonce in nonces:
        digest.update(hashlib.sha256(nonce).digest())
    digest.update(part.to_bytes(4, "little"))
    return digest.digest()


@dataclass(frozen=True)
class Sketch:
    """Where each element of a part goes: one of 2 * SKETCH_BUCKETS slots, bucket b with a plus sign or
    SKETCH_BUCKETS + b with a minus sign (one pass of bincount, then a subtraction, is the whole sketch)."""

    slots: torch.Tensor  # int16

    @classmethod
    def of(cls, seed: bytes, numel: int) -> "Sketch":
        # PCG64's raw 64-bit outputs, four slots each (eight times faster than Generator.bytes, which was most of
        # what a member spent drawing every part's sketch after the commits), masked in place.
        drawn = np.random.PCG64(int.from_bytes(seed[:16], "little")).random_raw((numel + 3) // 4)
        slots = torch.from_numpy(drawn.astype("<u8", copy=False).view(np.int16)[:numel])
        slots &= 2 * SKETCH_BUCKETS - 1
        return cls(slots)

    def apply(self, values: torch.Tensor) -> torch.Tensor:
        return self.offsets([values], None, [(0, values.numel())], [1.0], [1.0])

    def offsets(self, pieces: Sequence[torch.Tensor], result: Optional[torch.Tensor],
                chunks: Sequence[tuple[int, int]], cuts: Sequence[float], scales: Sequence[float]) -> torch.Tensor:
        """The sketch of (piece * cut - result) * scale, chunk by chunk (`pieces`: a contribution's values in each
        chunk; no result: zero), summed in float64 a block at a time (_float64_blocks): a float64 copy of a whole
        part (and a reducer's concatenated copy of every member's) was what a member spent most of the check's
        time on, their pages faulted in afresh every round."""
        sums = torch.zeros(2 * SKETCH_BUCKETS, dtype=torch.float64)
        for piece, (a, b), cut, scale in zip(pieces, chunks, cuts, scales):
            for start, wide in _float64_blocks(piece, cut, None if result is None else result[a:b], scale):
                sums += torch.bincount(self.slots[a + start:a + start + wide.numel()], weights=wide,
                                       minlength=2 * SKETCH_BUCKETS)
        return sums[:SKETCH_BUCKETS] - sums[SKETCH_BUCKETS:]


def norm_cap(norms: Sequence[float], weights: Sequence[float]) -> float:
    """The longest a contribution counts as, given every contribution's norm and (capped) weight: NORM_SPREAD times
    the weighted lower median of the norms of those with a positive weight, the least norm that the contributions no
    longer than it hold half the weight with. No member holds half (aggregate.capped_weights), so that norm is an
    honest member's, or lies between two honest ones, while the liars hold less than half. Weighted, so that where
    half the members barely trained (two that joined late took one step, two trained four), the ones that trained,
    holding most of the weight, are not cut to the late ones' norms. inf (no cap) among two or fewer members with
    weight, as capped_weights leaves two weights alone, or where that median is zero (a majority sent nothing, and
    CenteredClip's radius bounds the rest)."""
    ranked = sorted((float(n), float(w)) for n, w in zip(norms, weights) if w > 0)
    if len(ranked) <= 2:
        return math.inf
    half = sum(w for _, w in ranked) / 2
    norm = next(n for (n, _), held in zip(ranked, itertools.accumulate(w for _, w in ranked)) if held >= half)
    return NORM_SPREAD * norm if norm > 0 else math.inf


def shrink(norm: float, cap: float) -> float:
    """The factor a contribution of `norm` is scaled by to be no longer than `cap`."""
    return cap / norm if norm > cap else 1.0


def offset_stats(contribution: torch.Tensor, result: torch.Tensor, radius: float, cap: float = math.inf,
                 norm: Optional[float] = None) -> tuple[float, float, float, float]:
    """One chunk of a member's term, but for the sketch: (the norm of its contribution, the distance to the result
    of its contribution cut to the norm cap `cap`, the factor that offset is pulled in by to lie within `radius`: 1
    if it does, the factor the cap cut the contribution by: 1 if it did not). Nothing here depends on the sketch, so
    a member works it out as each averaged chunk arrives (verifying.py), and only the sketching waits for the
    nonces. `norm`: the contribution's norm64, where the caller has it."""
    norm = norm64(contribution) if norm is None else norm
    cut = shrink(norm, cap)
    distance = norm64(contribution, cut, result)
    return norm, distance, radius / distance if distance > radius else 1.0, cut


def norm64(values: torch.Tensor, cut: float = 1.0, minus: Optional[torch.Tensor] = None) -> float:
    """The float64 norm of values * cut - minus (no minus: of values * cut), a block at a time (_float64_blocks):
    the float64 copy of a whole chunk that torch.linalg.vector_norm(dtype=float64) makes, and the offset vector,
    cost more than the arithmetic, in the data phase where they hold up the averages."""
    return math.sqrt(sum(float(torch.dot(wide, wide)) for _, wide in _float64_blocks(values, cut, minus)))


def _float64_blocks(values: torch.Tensor, cut: float, minus: Optional[torch.Tensor], scale: float = 1.0):
    """(values * cut - minus) * scale, worked out in float32 as every member works it out, SKETCH_BLOCK elements at
    a time, each block then copied to float64: yields (the block's start, the float64 block), in two small buffers
    reused from block to block."""
    numel = values.numel()
    block = torch.empty(min(SKETCH_BLOCK, numel))
    wide = torch.empty(block.numel(), dtype=torch.float64)
    for start in range(0, numel, SKETCH_BLOCK):
        end = min(start + SKETCH_BLOCK, numel)
        out = _offset(values[start:end], cut, None if minus is None else minus[start:end], block[:end - start])
        if scale != 1.0:
            out = torch.mul(out, scale, out=block[:end - start])
        yield start, wide[:end - start].copy_(out)


def _offset(values: torch.Tensor, cut: float, minus: Optional[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """values * cut - minus in float32 (in `out`, or `values` itself where that is all), in as few passes as that
    takes: every member computes the same float32 elements, whichever of these paths it takes."""
    if cut != 1.0:
        torch.mul(values, cut, out=out)
        return out if minus is None else out.sub_(minus)
    if minus is None:
        return values
    return torch.sub(values, minus, out=out)


def sketched(contribution: torch.Tensor | Sequence[torch.Tensor], result: torch.Tensor,
             chunks: Sequence[tuple[int, int]], stats: Sequence[tuple[float, float, float, float]],
             sketch: Sketch) -> Term:
    """The term whose chunks' offset_stats are `stats`: its chunks cut to the norm cap, their offsets pulled in,
    sketched. `contribution`: the part's values, or their pieces chunk by chunk."""
    pieces = [contribution[a:b] for a, b in chunks] if isinstance(contribution, torch.Tensor) else contribution
    offsets = sketch.offsets(pieces, result, chunks, [s[3] for s in stats], [s[2] for s in stats])
    return Term(tuple(offsets.tolist()), tuple(s[0] for s in stats), tuple(s[1] for s in stats))


def term(contribution: torch.Tensor, result: torch.Tensor, chunks: Sequence[tuple[int, int]],
         radii: Sequence[float], sketch: Sketch, caps: Optional[Sequence[float]] = None) -> Term:
    """A member's term of a part: `contribution` and `result` are the part's values (what the reducer decoded of the
    member's payload, and what every member decoded of the reducer's), `chunks` the chunk bounds relative to the
    part, `radii` and `caps` the reducer's radius and norm cap of each chunk (no caps: none)."""
    caps = caps if caps is not None else [math.inf] * len(chunks)
    stats = [offset_stats(contribution[a:b], result[a:b], radius, cap)
             for (a, b), radius, cap in zip(chunks, radii, caps)]
    return sketched(contribution, result, chunks, stats, sketch)


def lower_median(values: Sequence[float]) -> float:
    return sorted(values)[(len(values) - 1) // 2]


def rounding(codecs: Sequence[Codec], result: torch.Tensor, chunks: Sequence[tuple[int, int]]) -> list[float]:
    """Per chunk, the norm of the most that decoding can have moved the part's result: its codec's bound read off
    the decoded result (nothing for a lossless chunk), with 1% to spare for the bound's own rounding."""
    return [0.0 if codec.name == "none" else 1.01 * codec.error_bound_norm(result[a:b])
            for codec, (a, b) in zip(codecs, chunks)]


def chunk_norms(result: torch.Tensor, chunks: Sequence[tuple[int, int]]) -> list[float]:
    return [norm64(result[a:b]) for a, b in chunks]


@dataclass(frozen=True)
class Verdict:
    """What one member concludes about one part: whether it verified, and whom that member itself accuses
    (the reducer, or a member whose term it knows firsthand to be misreported)."""

    ok: bool
    accused: frozenset[str] = frozenset()
    why: str = ""


def judge(me: str, reducer: str, members: Sequence[str], weights: Sequence[float], radii: Sequence[float],
          claims: dict[str, Term], own: dict[str, Term], result_norms: Sequence[float],
          roundings: Sequence[float], caps: Optional[Sequence[float]] = None) -> Verdict:
    """`me`'s verdict on `reducer`'s part. `weights` are the members' capped weights (in member order), `radii`
    and `caps` the reducer's radius and norm cap of each chunk (no caps: none), `claims` the reducer's sketch of
    every member's term, `own` the terms members sent of themselves (missing for a member that could not send one,
    e.g. a client: its term is then held to the bound on length only, as the reducer's own is). `result_norms` are
    the norms of the result's chunks, `roundings` what decoding may have moved each (rounding)."""
    if set(claims) != set(members):
        return Verdict(False, frozenset({reducer}), "its claims do not name every member")
    for peer in members:
        mine, theirs = own.get(peer), claims[peer]
        if mine is not None and not _same(mine, theirs):
            # One of the two misreports `peer`'s term; only they know which: the one who knows it accuses the other.
            if peer == me or peer == reducer:  # (the reducer's own two statements of its term contradict each other)
                return Verdict(False, frozenset({reducer}), "it misreports my term" if peer == me else
                               "it states its own term two ways")
            if me == reducer:
                return Verdict(False, frozenset({peer}), f"{peer[-8:]} misreports its term")
            return Verdict(False, frozenset(), f"it and {peer[-8:]} disagree on {peer[-8:]}'s term")
    caps = list(caps) if caps is not None else [math.inf] * len(radii)
    for k, cap in enumerate(caps):
        expected = norm_cap([claims[p].norms[k] for p in members], weights)
        if not (cap == expected or abs(cap - expected) <= FLOAT_SLACK * expected):
            return Verdict(False, frozenset({reducer}), f"its norm cap {cap:.3g} of chunk {k} is not the "
                                                        f"members' ({expected:.3g})")
    radius_norm = math.sqrt(sum(r * r for r in radii))
    for k, radius in enumerate(radii):
        norm = lower_median([claims[p].norms[k] for p in members])
        floor, ceiling = RADIUS_FLOOR * norm, RADIUS_CEILING * norm
        if not floor <= radius * (1 + FLOAT_SLACK) + 1e-30 or radius > ceiling * (1 + FLOAT_SLACK) + 1e-30:
            return Verdict(False, frozenset({reducer}), f"its radius {radius:.3g} of chunk {k} is out of bounds "
                                                        f"[{floor:.3g}, {ceiling:.3g}]")
    # The result stays near the others' contributions: at the fixed point, a result farther than M + delta from the
    # origin (M: the largest norm of another member's contribution) leaves every other member's clipped term pulling
    # back by at least min(delta, radius * delta / (2M + delta)), which the reducer's own term (at most its weight
    # times the radius) must balance. So a far result, or one whose rounding would drown the sum below, is refused.
    own_weight = weights[members.index(reducer)]
    others = sum(weights) - own_weight
    share = own_weight / others if others > 0 else math.inf
    for k, radius in enumerate(radii):
        largest = max((min(claims[p].norms[k], caps[k]) for p in members if p != reducer), default=0.0)
        reach = largest + share * radius + (2 * largest * share / (1 - share) if share < 1 else math.inf)
        if result_norms[k] > reach * (1 + FLOAT_SLACK) + roundings[k] + CONVERGENCE * radius + 1e-30:
            return Verdict(False, frozenset({reducer}), f"its result's chunk {k} lies farther "
                                                        f"({result_norms[k]:.3g}) than the contributions allow "
                                                        f"({reach:.3g})")
    bound = SKETCH_SLACK * radius_norm * radius_norm * (1 + FLOAT_SLACK) + 1e-30
    for peer in members:
        if float(np.square(claims[peer].sketch).sum()) > bound:
            return Verdict(False, frozenset({reducer}), f"{peer[-8:]}'s term is longer than any radius allows")
    total = np.zeros(SKETCH_BUCKETS)
    for peer, weight in zip(members, weights):
        total += weight * np.asarray(claims[peer].sketch)
    scale = sum(weights)
    contributions = sum(w * math.sqrt(sum(min(n, cap) ** 2 for n, cap in zip(claims[p].norms, caps)))
                        for p, w in zip(members, weights))
    rounding_norm = math.sqrt(sum(r * r for r in roundings))
    result_norm = math.sqrt(sum(n * n for n in result_norms))
    tolerance = math.sqrt(SKETCH_SLACK) * scale * (rounding_norm + CONVERGENCE * radius_norm) + \
        FLOAT_SLACK * (contributions + scale * result_norm) + 1e-30
    residual = float(np.linalg.norm(total))
    if residual > tolerance:
        return Verdict(False, frozenset({reducer}), f"its result is not the group's (residual {residual:.3g} > "
                                                    f"{tolerance:.3g})")
    return Verdict(True)


def _same(a: Term, b: Term) -> bool:
    """Equal but for the rounding of different summation orders."""
    x = np.asarray([*a.sketch, *a.norms, *a.distances])
    y = np.asarray([*b.sketch, *b.norms, *b.distances])
    scale = float(np.linalg.norm(y[:SKETCH_BUCKETS])) + float(np.linalg.norm(y[SKETCH_BUCKETS + len(b.norms):]))
    return bool(np.all(np.abs(x - y) <= FLOAT_SLACK * (np.abs(x) + np.abs(y) + scale) + 1e-30))
