"""Group formation for one averaging attempt of an outer round: peers that reached the averaging point announce
themselves (state digest, measured bandwidth, whether they accept connections) under the attempt's key, wait for
the peers they expect, and adopt the member list and reduction shares published by their group's leader (the
member whose id hashes smallest with the round and attempt, see leader_of). Every member checks the same group id
in the all-reduce, so a peer whose view differed fails that attempt cleanly instead of averaging with the wrong
set.

Up to `target_group_size` candidates form one group. With more, every peer computes
the same split into groups from the same view (Moshpit-style): on even rounds peers of similar measured bandwidth
average together, so a slow home uplink does not hold up fibre peers; on odd rounds every group takes its members
from different groups of the round before, so what each group learned spreads through the swarm. Groups then
hold different global params, so a group whose members' digests differ averages global params and outer momentum
too ("mix"), and the digest agreement is per group; any group, one or many, leaves its members identical.

The leader also pushes the group it publishes straight to its members over a stream (GroupPush): a member then
starts the all-reduce without waiting for the DHT write and its next read of it (about 60 ms a round on a LAN).
The DHT entry stays the record: a member that misses the push reads it there, as before.

Entries are written under the writer's owned subkey, which hivemind signs with its key; readers count only
entries whose signature and peer id check out, so nobody can enter, accuse or lead in another peer's name.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

import msgpack

from swarm.averaging.partition import optimal_shares
from swarm.dht.frames import recv_frame, send_frame
from swarm.dht.node import SwarmNode
from swarm.dht.records import final_key, group_key
from swarm.dht.validation import subkey_owner

logger = logging.getLogger(__name__)
POLL_SECONDS = 0.1  # between reads of the group's entries, once the first few came back empty...
FIRST_POLL_SECONDS = 0.02  # ...starting here: a group of peers that finished the last round together forms at once
SETTLE_SECONDS = 0.4
FINAL_GRACE_SECONDS = 2.0  # how long after other groups' leaders published we still wait for ours
MAX_PUSH_BYTES = 1 << 20  # a pushed group: its member ids, shares and flags
PUSHED_KEYS = 16  # (round, attempt) keys whose pushed groups a peer keeps


@dataclass(frozen=True)
class Candidate:
    digest: str
    bandwidth: float  # bytes/s this peer measured on recent all-reduces (or its probe)
    client: bool  # cannot accept inbound connections: it contributes but reduces nothing
    excluded: tuple[str, ...] = ()  # peers this one caught sending bad data in this round
    phase_timeout: Optional[float] = None  # the all-reduce deadline its recent rounds measured (None: none yet)


@dataclass(frozen=True)
class Group:
    round: int
    attempt: int
    members: tuple[str, ...]  # sorted peer ids
    shares: tuple[float, ...]  # fraction of the vector each member reduces
    group_id: str
    phase_timeout: Optional[float] = None  # agreed all-reduce deadline: the slowest measured member's
    clients: tuple[bool, ...] = ()  # per member: accepts no inbound streams (it pulls what it needs)
    mix: bool = False  # members hold different global params: average params and outer momentum too
    swarm_size: int = 0  # candidates the leader split into groups (its estimate of the peers in this round)

    @classmethod
    def of(cls, round_no: int, attempt: int, members: Sequence[str], shares: Sequence[float],
           phase_timeout: Optional[float] = None, clients: Sequence[bool] = (), mix: bool = False,
           swarm_size: int = 0) -> "Group":
        ordered = tuple(members)
        clients = tuple(bool(c) for c in clients) or (False,) * len(ordered)
        swarm_size = max(int(swarm_size), len(ordered))
        text = (f"{round_no}|{attempt}|{'|'.join(ordered)}|{','.join(f'{s:.9f}' for s in shares)}|{phase_timeout}"
                f"|{''.join('c' if c else 's' for c in clients)}|{int(mix)}|{swarm_size}")
        return cls(round_no, attempt, ordered, tuple(shares), hashlib.sha256(text.encode()).hexdigest()[:32],
                   phase_timeout, clients, bool(mix), swarm_size)

    def is_client(self, peer: str) -> bool:
        return self.clients[self.members.index(peer)]


def group_timeout(candidates: Sequence[Candidate]) -> Optional[float]:
    """The deadline a group agrees on: the largest its measured members report, so the slowest link sets the
    pace and a member that has measured nothing yet (it just joined) does not wait the ceiling for a dead peer."""
    measured = [c.phase_timeout for c in candidates if c.phase_timeout is not None]
    return max(measured) if measured else None


def choose_members(candidates: dict[str, Candidate], target_size: int) -> list[str]:
    """One group: the candidates left once accusations are settled (see `settled`), sorted by peer id, capped at
    `target_size`. Members of different state digests (lineages of earlier multi-group rounds, or a peer whose
    last commit went astray) are all welcome: their group mixes params, and leaves them identical. A pure
    function: every peer with the same view picks the same members."""
    return sorted(settled(candidates))[:target_size]


def settled(candidates: dict[str, Candidate]) -> dict[str, Candidate]:
    """The candidates that may average together this attempt. A candidate's `excluded` are the peers it caught
    sending bad data this round; an accusation is only a claim, so it means that the two do not average
    together, not that the accused is out: while any two candidates left are in conflict, the one in the most
    conflicts leaves (ties: the larger peer id). A peer caught by the members of its group (each of them
    accuses it) leaves, and so does one that accuses every honest peer: accusing costs the accuser its place
    beside whom it accuses, never more to the others."""
    conflicts: dict[str, set[str]] = {peer: set() for peer in candidates}
    for peer, candidate in candidates.items():
        for accused in candidate.excluded:
            if accused in conflicts and accused != peer:
                conflicts[peer].add(accused)
                conflicts[accused].add(peer)
    left = set(candidates)
    while True:
        worst = max(left, key=lambda peer: (len(conflicts[peer] & left), peer), default=None)
        if worst is None or not conflicts[worst] & left:
            return {peer: candidates[peer] for peer in sorted(left)}
        left.discard(worst)


def leader_of(members: Iterable[str], round_no: int, attempt: int) -> str:
    """The member that publishes the group: the one whose id hashes smallest with the round and attempt. (The
    smallest id led every group before, so a key ground for a small id led every round; now a key leads about
    one round in len(members), and a key ground for one round leads that round only.)"""
    return min(members, key=lambda peer: _rank(peer, round_no, attempt))


def _rank(peer: str, round_no: int, attempt: int) -> bytes:
    return hashlib.sha256(f"{round_no}|{attempt}|{peer}".encode()).digest()


def bandwidth_class(bandwidth: float) -> int:
    """Half-octave bucket of a measured bandwidth, so that round-to-round noise does not reshuffle groups."""
    return math.floor(2 * math.log2(bandwidth)) if bandwidth > 1 else 0


def plan_groups(candidates: dict[str, Candidate], target_size: int, min_size: int, round_no: int) -> list[list[str]]:
    """Split this attempt's candidates into groups; a pure function, so every peer with the same view computes the
    same groups. Up to `target_size` candidates: one group, as `choose_members`; too few for two groups of
    `min_size`: one group of all of them (over the target by less than `min_size`). Otherwise all candidates, whatever their digest, in k = ceil(n / target_size) groups of
    nearly equal size. Even rounds: consecutive runs of the bandwidth order, so similar links average together.
    Odd rounds: every k-th peer in the order of (digest, bandwidth), so each group takes its members from as many
    of the previous round's groups (digests) as it can, and what each group learned spreads through the swarm:
    with n = k * g the two layouts are the rows and columns of a grid."""
    candidates = settled(candidates)
    n = len(candidates)
    k = min(-(-n // max(target_size, 1)), n // max(min_size, 1))
    if k <= 1:
        # Too few for two groups of min_size: one group a little over the target rather than peers left out.
        members = choose_members(candidates, max(target_size, n))
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
    _give_every_group_a_reducer(groups, candidates)
    return [sorted(group) for group in groups]


def _give_every_group_a_reducer(groups: list[list[str]], candidates: dict[str, Candidate]) -> None:
    """A group of client-mode peers only could not average: swap one of them with a server of a group that has
    two or more (deterministically: the first such group, its last server)."""
    for group in groups:
        if any(not candidates[peer].client for peer in group):
            continue
        donors = [g for g in groups if sum(not candidates[peer].client for peer in g) >= 2]
        if not donors:
            return
        donor = donors[0]
        server = [peer for peer in donor if not candidates[peer].client][-1]
        donor[donor.index(server)], group[0] = group[0], server


def _parse_candidate(value: object) -> Optional[Candidate]:
    if not isinstance(value, dict) or not isinstance(value.get("digest"), str):
        return None
    bandwidth, client = value.get("bandwidth", 0.0), value.get("client", False)
    excluded, timeout = value.get("excluded", []), value.get("phase_timeout")
    if not isinstance(bandwidth, (int, float)) or not math.isfinite(bandwidth) or bandwidth < 0:
        return None
    if not isinstance(excluded, list) or len(excluded) > 1024 or not all(isinstance(p, str) for p in excluded):
        return None
    if timeout is not None and (not _is_seconds(timeout)):
        return None
    return Candidate(value["digest"], float(bandwidth), bool(client), tuple(excluded),
                     None if timeout is None else float(timeout))


def _is_seconds(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and \
        0 < value < 1e6


def signed_entries(raw: dict) -> dict[str, object]:
    """{writer's peer id: value} of the entries under owned subkeys (signed: hivemind's validator checked the
    signature); anything else under the key is ignored."""
    entries = {}
    for subkey, value in raw.items():
        writer = subkey_owner(subkey)
        if writer is not None:
            entries[writer] = value
    return entries


async def _read_candidates(node: SwarmNode, key: str, excluded: set[str]) -> dict[str, Candidate]:
    raw = signed_entries(await node.get(key))
    parsed = {peer: _parse_candidate(value) for peer, value in raw.items() if peer not in excluded}
    return {peer: c for peer, c in parsed.items() if c is not None}


async def form_group(node: SwarmNode, run_id: str, round_no: int, attempt: int, me_as: Candidate,
                     expected: set[str], min_size: int, target_size: int, timeout: float,
                     excluded: Iterable[str] = (), not_waiting_for: Iterable[str] = (),
                     still_in: Optional[Callable[[], Optional[set[str]]]] = None,
                     push: Optional["GroupPush"] = None) -> tuple[Optional[Group], int]:
    """Find this attempt's group: (group, others seen), with group None if no group of at least `min_size`
    formed within about `timeout` s. A peer that saw nobody else may retry under the same attempt number.

    `expected` are peers believed to be in this round (from their announcements): we wait for them, but never
    past the deadline, so a peer that crashed only delays the round. `excluded` peers (they sent bad data earlier
    in this round) are neither waited for nor accepted, nor followed as leaders; `not_waiting_for` peers (they did
    not deliver in an earlier attempt) are not waited for, but accepted if they show up.

    `still_in`, polled while we wait, names the peers whose announcements still show this round: expected peers
    that left it (they averaged it elsewhere, or their heartbeat stopped) are no longer waited for. It returns None
    once the swarm moved on without us; we then give up at once (the caller re-syncs) instead of waiting out the
    deadline for peers that will never come. With `push`, a leader also pushes its group to the members, and
    we take a group pushed to us by our leader as if read from the DHT."""
    me = node.peer_id
    excluded = set(excluded) - {me}
    expected = set(expected) - excluded - set(not_waiting_for)
    deadline = time.monotonic() + timeout
    key = group_key(run_id, round_no, attempt)
    ttl = 3 * timeout + 30
    me_as = Candidate(me_as.digest, me_as.bandwidth, me_as.client, tuple(sorted(excluded)), me_as.phase_timeout)
    await node.store(key, {"digest": me_as.digest, "bandwidth": me_as.bandwidth, "client": me_as.client,
                           "excluded": list(me_as.excluded), "phase_timeout": me_as.phase_timeout},
                     ttl=ttl, subkey=node.owned_subkey)

    poll = FIRST_POLL_SECONDS
    while True:
        candidates = {**await _read_candidates(node, key, excluded), me: me_as}
        if expected <= set(candidates) and len(candidates) >= min_size:
            break
        if still_in is not None:
            in_round = still_in()
            if in_round is None:
                logger.info("round %d: the swarm moved on while I waited for a group", round_no)
                return None, max(len(candidates) - 1, 1)
            expected &= in_round | set(candidates)
            if expected <= set(candidates) and len(candidates) >= min_size:
                break
        if time.monotonic() >= deadline:
            # Stragglers: let entries written at this moment reach every reader before deciding.
            await asyncio.sleep(SETTLE_SECONDS)
            candidates = {**await _read_candidates(node, key, excluded), me: me_as}
            break
        await asyncio.sleep(poll)
        poll = min(poll * 1.5, POLL_SECONDS)
    seen = len(candidates) - 1
    groups = plan_groups(candidates, target_size, min_size, round_no)
    members = next((group for group in groups if me in group), [])
    if not members:
        logger.info("round %d: not in this attempt's group (left out by accusations of bad data)", round_no)
        return None, seen
    if len(members) < min_size:
        return None, seen
    leader = leader_of(members, round_no, attempt)
    if leader == me:
        try:
            shares = optimal_shares([candidates[m].bandwidth or 1.0 for m in members],
                                    [not candidates[m].client for m in members])
        except ValueError as e:
            logger.warning("round %d: %s", round_no, e)
            return None, seen
        final = {"members": members, "shares": shares, "clients": [candidates[m].client for m in members],
                 "phase_timeout": group_timeout([candidates[m] for m in members]),
                 "mix": len({candidates[m].digest for m in members}) > 1,
                 "swarm_size": sum(len(group) for group in groups)}
        if push is not None:
            push.send(members, round_no, attempt, final)
        await node.store(final_key(run_id, round_no, attempt), final, ttl=ttl, subkey=node.owned_subkey)

    # Wait as long as the leader may still be waiting for its own candidates (it may have started later).
    final_deadline = time.monotonic() + timeout + 2 * SETTLE_SECONDS
    others_published = None
    poll = FIRST_POLL_SECONDS
    while time.monotonic() < final_deadline:
        pushed = push.finals(round_no, attempt, excluded) if push is not None else {}
        finals = pushed if leader in pushed else {**await _read_finals(node, run_id, round_no, attempt, excluded),
                                                  **pushed}
        mine = {writer: final for writer, final in finals.items() if me in final[0]}
        if finals and not mine and leader not in finals:
            # Other groups' leaders published and ours did not: views that agree publish within moments of each
            # other, so after a grace our leader most likely followed another group; retry rather than wait.
            others_published = others_published or time.monotonic()
            if time.monotonic() - others_published > FINAL_GRACE_SECONDS:
                logger.info("round %d: groups were published, none with me", round_no)
                return None, seen
        if leader in finals or mine:
            if leader not in mine or leader_of(mine, round_no, attempt) != leader:
                # Our views differ: another leader may be writing at this moment, so wait and re-read.
                await asyncio.sleep(SETTLE_SECONDS)
                finals = await _read_finals(node, run_id, round_no, attempt, excluded)
                mine = {writer: final for writer, final in finals.items() if me in final[0]}
            if not mine:
                logger.info("round %d: leader %s formed a group without me", round_no, leader[-8:])
                return None, seen
            chosen, shares, phase_timeout, clients, mix, swarm_size = mine[leader_of(mine, round_no, attempt)]
            if len(chosen) < min_size:
                return None, seen
            return Group.of(round_no, attempt, chosen, shares, phase_timeout, clients, mix, swarm_size), seen
        if push is not None:
            await push.wait(round_no, attempt, poll)  # a push wakes us at once
        else:
            await asyncio.sleep(poll)
        poll = min(poll * 1.5, POLL_SECONDS)
    logger.info("round %d: no group leader published a group in time", round_no)
    return None, seen


async def _read_finals(node: SwarmNode, run_id: str, round_no: int, attempt: int,
                       excluded: set[str]) -> dict[str, tuple[list[str], list[float], Optional[float], list[bool],
                                                               bool, int]]:
    raw = signed_entries(await node.get(final_key(run_id, round_no, attempt)))
    finals = {}
    for writer, value in raw.items():
        final = _parse_final(writer, value, excluded, round_no, attempt)
        if final is not None:
            finals[writer] = final
    return finals


Final = tuple[list[str], list[float], Optional[float], list[bool], bool, int]


def _parse_final(writer: str, value: object, excluded: set[str], round_no: int, attempt: int) -> Optional[Final]:
    """A group of this round and attempt as its leader `writer` published (or pushed) it, or None if it is
    malformed, not the writer's to publish (see leader_of), or names an excluded peer."""
    if writer in excluded or not isinstance(value, dict):
        return None
    members, shares = value.get("members"), value.get("shares")
    # Only a leader may publish: it must be the group's leader_of; shares must be a distribution.
    if not (isinstance(members, list) and members and all(isinstance(m, str) for m in members)
            and members == sorted(set(members)) and leader_of(members, round_no, attempt) == writer
            and isinstance(shares, list) and len(shares) == len(members)
            and all(isinstance(s, (int, float)) and not isinstance(s, bool) and math.isfinite(s) and s >= 0
                    for s in shares)
            and abs(sum(shares) - 1) < 1e-6 and not excluded & set(members)
            and (value.get("phase_timeout") is None or _is_seconds(value.get("phase_timeout")))):
        return None
    timeout, clients = value.get("phase_timeout"), value.get("clients", [False] * len(members))
    mix, swarm_size = value.get("mix", False), value.get("swarm_size", len(members))
    if not isinstance(clients, list) or len(clients) != len(members) or \
            not all(isinstance(c, bool) for c in clients) or \
            any(c and share > 0 for c, share in zip(clients, shares)) or all(clients):
        return None  # a client never reduces, and someone must
    if not isinstance(mix, bool) or isinstance(swarm_size, bool) or not isinstance(swarm_size, int) or \
            not len(members) <= swarm_size <= 1 << 20:
        return None
    return (members, [float(s) for s in shares], None if timeout is None else float(timeout), clients, mix,
            swarm_size)


class GroupPush:
    """A leader's group, pushed to its members over a stream of protocol `swarm.<run>.group` as it is published,
    and the groups pushed to us. The sender is the stream's authenticated remote, and a pushed group is checked as
    one read from the DHT (only its leader_of may publish it), so a push can do nothing a DHT entry cannot."""

    def __init__(self, node: SwarmNode, run_id: str):
        self.node, self.protocol = node, f"swarm.{run_id}.group"
        self._finals: dict[tuple[int, int], dict[str, Final]] = {}
        self._arrived: dict[tuple[int, int], asyncio.Event] = {}
        self._background: set[asyncio.Task] = set()  # held until done: asyncio holds tasks only weakly

    async def start(self) -> None:
        await self.node.add_stream_handler(self.protocol, self._on_stream)

    def _event(self, key: tuple[int, int]) -> asyncio.Event:
        if key not in self._arrived:
            while len(self._arrived) >= PUSHED_KEYS:  # bounded against senders naming endless keys
                oldest = next(iter(self._arrived))
                del self._arrived[oldest]
                self._finals.pop(oldest, None)
            self._arrived[key] = asyncio.Event()
        return self._arrived[key]

    async def _on_stream(self, remote: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        body = msgpack.unpackb(await recv_frame(reader, MAX_PUSH_BYTES))
        if not isinstance(body, dict):
            raise ValueError(f"malformed group push from {remote}")
        key = (body.get("round"), body.get("attempt"))
        if not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 40 for v in key):
            raise ValueError(f"group push from {remote} names round/attempt {key!r}")
        final = _parse_final(remote, body.get("final"), set(), *key)
        if final is None:
            raise ValueError(f"group push from {remote} is not a group it may publish")
        self._event(key).set()
        self._finals.setdefault(key, {})[remote] = final
        await send_frame(writer, b"ok")

    def finals(self, round_no: int, attempt: int, excluded: set[str]) -> dict[str, Final]:
        return {writer: final for writer, final in self._finals.get((round_no, attempt), {}).items()
                if writer not in excluded and not excluded & set(final[0])}

    async def wait(self, round_no: int, attempt: int, timeout: float) -> None:
        """Until a group is pushed to us for this round and attempt, or `timeout` s."""
        event = self._event((round_no, attempt))
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        event.clear()

    def send(self, members: list[str], round_no: int, attempt: int, final: dict) -> None:
        """Push our group to its other members, in the background (best effort: the DHT entry is the record)."""
        body = msgpack.packb({"round": round_no, "attempt": attempt, "final": final})

        async def push(peer: str) -> None:
            try:
                reader, writer = await asyncio.wait_for(self.node.open_stream(peer, self.protocol), 5)
                try:
                    await send_frame(writer, body)
                    await asyncio.wait_for(recv_frame(reader, 16), 5)
                finally:
                    writer.close()
            except Exception as e:  # noqa: BLE001 - it reads the group from the DHT instead
                logger.debug("could not push round %d's group to %s: %s", round_no, peer[-8:], e)

        for peer in members:
            if peer != self.node.peer_id:
                task = asyncio.ensure_future(push(peer))
                self._background.add(task)
                task.add_done_callback(self._background.discard)
