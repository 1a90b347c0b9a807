"""Who averages with whom in one attempt, from the attempt's matchmaking entries alone: pure functions, so every
peer that read the same entries computes the same groups. Accusations are settled first (`settled`), then
candidates alone on their state digest are left out (`lineages`), then the rest are split into groups
(`plan_groups`): one group up to the target size, Moshpit-style rows and columns above it."""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from dataclasses import dataclass
from typing import Optional, Sequence

MIX_QUORUM = 2  # candidates that must declare a state digest before a group mixes it in (see `lineages`)


@dataclass(frozen=True)
class Candidate:
    digest: str
    bandwidth: float  # bytes/s this peer measured on recent all-reduces (or its probe)
    client: bool  # cannot accept inbound connections: it contributes but reduces nothing
    excluded: tuple[str, ...] = ()  # peers this one caught sending bad data in this round
    phase_timeout: Optional[float] = None  # the all-reduce deadline its recent rounds measured (None: none yet)
    # The weight (tokens) its contribution declares, to every reducer alike (every entry read declares one; None
    # only in a Candidate made by hand)
    weight: Optional[float] = None
    commitment: str = ""  # sha256 of the nonce it reveals once it holds the average (verify.py); "" where unchecked


def group_timeout(candidates: Sequence[Candidate]) -> Optional[float]:
    """The deadline a group agrees on: the largest its measured members report, so the slowest link sets the
    pace and a member that has measured nothing yet (it just joined) does not wait the ceiling for a dead peer."""
    measured = [c.phase_timeout for c in candidates if c.phase_timeout is not None]
    return max(measured) if measured else None


def choose_members(candidates: dict[str, Candidate], target_size: int, salt: str = "") -> list[str]:
    """One group: the candidates left once accusations are settled (see `settled`), sorted by peer id, capped at
    `target_size`. Members of different state digests (lineages of earlier multi-group rounds, or a peer whose
    last commit went astray) are all welcome: their group mixes params, and leaves them identical. A pure
    function: every peer with the same view picks the same members."""
    return sorted(settled(candidates, salt))[:target_size]


def settled(candidates: dict[str, Candidate], salt: str = "") -> dict[str, Candidate]:
    """The candidates that may average together this attempt. A candidate's `excluded` are the peers it caught
    sending bad data this round; an accusation is only a claim, so it means that the two do not average
    together, not that the accused is out: while any two candidates left are in conflict, the one in the most
    conflicts leaves. A peer caught by the members of its group (each of them accuses it) leaves, and so does one
    that accuses every honest peer: accusing costs the accuser its place beside whom it accuses, never more to the
    others. Of two in as many conflicts, the one that accused more of the peers left leaves: a lone accusation
    without evidence costs its writer the attempt, not the peer it names. Remaining ties (two that accuse each
    other) go by a hash of the peer id with `salt` (the round and attempt), never by the id itself, which is chosen
    with its key: each of the two stays out of about half the attempts, whichever keys they hold."""
    conflicts: dict[str, set[str]] = {peer: set() for peer in candidates}
    accusing: dict[str, set[str]] = {peer: set() for peer in candidates}
    for peer, candidate in candidates.items():
        for accused in candidate.excluded:
            if accused in conflicts and accused != peer:
                conflicts[peer].add(accused)
                conflicts[accused].add(peer)
                accusing[peer].add(accused)
    left = set(candidates)
    while True:
        worst = max(left, key=lambda peer: (len(conflicts[peer] & left), len(accusing[peer] & left),
                                            tie_order(peer, salt)), default=None)
        if worst is None or not conflicts[worst] & left:
            return {peer: candidates[peer] for peer in sorted(left)}
        left.discard(worst)


def tie_order(peer: str, salt: str) -> bytes:
    """Where `peer` stands in a tie decided this attempt (`salt`: its round and attempt): the same on every viewer,
    different from one attempt to the next, and not for a key's holder to choose."""
    return hashlib.sha256(f"{salt}|{peer}".encode()).digest()


def attempt_salt(round_no: int, attempt: int) -> str:
    return f"{round_no}/{attempt}"


def lineages(candidates: dict[str, Candidate]) -> dict[str, Candidate]:
    """The candidates whose state digest at least MIX_QUORUM of them declare, where any digest has that many: a
    group mixes params only between lineages that several peers vouch for. A candidate alone on its digest (a peer
    whose last commit went astray, or a stranger declaring a state of its own to have it averaged into everyone's
    params) is left out of this attempt's groups and re-syncs once the swarm has averaged the round. Where no digest
    has a quorum (two peers that differ, each alone), all stay: nobody there can out-vote anybody."""
    counts = Counter(c.digest for c in candidates.values())
    if max(counts.values(), default=0) < MIX_QUORUM:
        return candidates
    return {peer: c for peer, c in candidates.items() if counts[c.digest] >= MIX_QUORUM}


def bandwidth_class(bandwidth: float) -> int:
    """Half-octave bucket of a measured bandwidth, so that round-to-round noise does not reshuffle groups."""
    return math.floor(2 * math.log2(bandwidth)) if bandwidth > 1 else 0


def plan_groups(candidates: dict[str, Candidate], target_size: int, min_size: int, round_no: int,
                attempt: int = 0, min_servers: int = 1) -> list[list[str]]:
    """Split this attempt's candidates into groups; a pure function, so every peer with the same view computes the same
    groups. Up to `target_size` candidates: one group, as `choose_members`; too few for two groups of `min_size`: one
    group of all of them (over the target by less than `min_size`). Otherwise all candidates, whatever their digest, in
    k = ceil(n / target_size) groups of nearly equal size. Even rounds: consecutive runs of the bandwidth order, so
    similar links average together. Odd rounds: every k-th peer in the order of (digest, bandwidth), so each group takes
    its members from as many of the previous round's groups (digests) as it can, and what each group learned spreads
    through the swarm: with n = k * g the two layouts are the rows and columns of a grid. Each group then gets
    `min_servers` members that accept connections where the others can spare them (_give_every_group_reducers)."""
    salt = attempt_salt(round_no, attempt)
    candidates = settled(candidates, salt)
    n = len(candidates)
    k = min(-(-n // max(target_size, 1)), n // max(min_size, 1))
    if min_servers > 1:  # (fewer, larger groups where too few accept connections for every group to have enough)
        k = min(k, max(sum(not c.client for c in candidates.values()) // min_servers, 1))
    if k <= 1:
        # Too few for two groups of min_size: one group a little over the target rather than peers left out.
        members = choose_members(candidates, max(target_size, n), salt)
        return [members] if members else []
    if round_no % 2 == 0:
        order = sorted(candidates, key=lambda peer: (-bandwidth_class(candidates[peer].bandwidth), peer))
        sizes = [n // k + (1 if i < n % k else 0) for i in range(k)]
        starts = [sum(sizes[:i]) for i in range(k)]
        groups = [order[start:start + size] for start, size in zip(starts, sizes)]
    else:
        order = sorted(candidates, key=lambda peer: (candidates[peer].digest,
                                                     -bandwidth_class(candidates[peer].bandwidth), peer))
        groups = [order[i::k] for i in range(k)]
    _give_every_group_reducers(groups, candidates, min_servers)
    return [sorted(group) for group in groups]


def _give_every_group_reducers(groups: list[list[str]], candidates: dict[str, Candidate], least: int = 1) -> None:
    """A group of client-mode peers only could not average, and one with a single server among clients is checked by
    nobody (clients receive no reports: a verified run that refuses pairs needs two): while a group has fewer than
    `least` servers, swap one of its clients with a server of a group that has more than `least` (deterministically:
    the first such group, its last server)."""
    def servers(group: list[str]) -> int:
        return sum(not candidates[peer].client for peer in group)

    for group in groups:
        while servers(group) < least:
            donors = [g for g in groups if servers(g) > max(least, 1)]
            clients = [k for k, peer in enumerate(group) if candidates[peer].client]
            if not donors or not clients:
                break
            donor = donors[0]
            server = [peer for peer in donor if not candidates[peer].client][-1]
            donor[donor.index(server)], group[clients[0]] = group[clients[0]], server
