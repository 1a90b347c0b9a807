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
import time
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Optional, Sequence

from swarm.averaging.group_push import (COMMITMENT_CHARS, Final, GroupPush, is_hex, is_seconds, is_weight, leader_of,
                                       parse_final)
from swarm.averaging.grouping import Candidate, attempt_salt, group_timeout, lineages, plan_groups, settled
from swarm.averaging.partition import optimal_shares
from swarm.dht.node import SwarmNode
from swarm.dht.records import final_key, group_key
from swarm.dht.validation import subkey_owner

logger = logging.getLogger(__name__)
POLL_SECONDS = 0.1  # between reads of the group's entries, once the first few came back empty...
FIRST_POLL_SECONDS = 0.02  # ...starting here: a group of peers that finished the last round together forms at once
SETTLE_SECONDS = 0.4
FINAL_GRACE_SECONDS = 2.0  # how long after other groups' leaders published we still wait for ours


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
    # Per member, from their own entries: the weight its contribution declares (reducers take this one, so a member
    # cannot weigh differently at different reducers), and, in a run that checks its reducers, its nonce
    # commitment. Matchmaking always fills both (an entry without them is malformed); empty only in a group made by
    # hand (tests, benchmarks), where reducers take the weight a part's header declares and, in a run that checks
    # its reducers, a group of three or more is refused (GroupAllReduce.run).
    weights: tuple[float, ...] = ()
    commitments: tuple[str, ...] = ()

    @classmethod
    def of(cls, round_no: int, attempt: int, members: Sequence[str], shares: Sequence[float],
           phase_timeout: Optional[float] = None, clients: Sequence[bool] = (), mix: bool = False,
           swarm_size: int = 0, weights: Sequence[float] = (), commitments: Sequence[str] = ()) -> "Group":
        ordered = tuple(members)
        clients = tuple(bool(c) for c in clients) or (False,) * len(ordered)
        swarm_size = max(int(swarm_size), len(ordered))
        weights = tuple(float(w) for w in weights) if len(weights) == len(ordered) else ()
        commitments = tuple(commitments) if len(commitments) == len(ordered) and all(commitments) else ()
        text = (f"{round_no}|{attempt}|{'|'.join(ordered)}|{','.join(f'{s:.9f}' for s in shares)}|{phase_timeout}"
                f"|{''.join('c' if c else 's' for c in clients)}|{int(mix)}|{swarm_size}"
                f"|{','.join(repr(w) for w in weights)}|{','.join(commitments)}")
        return cls(round_no, attempt, ordered, tuple(shares), hashlib.sha256(text.encode()).hexdigest()[:32],
                   phase_timeout, clients, bool(mix), swarm_size, weights, commitments)

    def is_client(self, peer: str) -> bool:
        return self.clients[self.members.index(peer)]


DIGEST_CHARS = 16  # a state digest (swarm.peer.digest.state_digest): blake3 in hex, cut to 64 bits
ENTRY_FIELDS = frozenset({"digest", "bandwidth", "client", "excluded", "phase_timeout", "weight", "commitment"})
MAX_BANDWIDTH = 1e11  # bytes/s (800 Gbit/s): a larger declared link is a lie, not a faster peer
BANDWIDTH_SPREAD = 16.0  # a member's bandwidth counts as at most this many times the group's lower median for shares


def parse_candidate(value: object, verified: bool) -> Optional[Candidate]:
    """A matchmaking entry as one schema: every field present, of its type and within its bounds (a missing field
    is malformed, never a default: an entry without its weight or nonce commitment would otherwise switch off the
    reducer check for the whole group), or None. `verified`: the run checks its reducers, so the commitment is a
    hex sha256 prefix; otherwise it is empty."""
    if not isinstance(value, dict) or not ENTRY_FIELDS <= value.keys():
        return None
    digest, bandwidth, client = value["digest"], value["bandwidth"], value["client"]
    excluded, timeout, weight, commitment = value["excluded"], value["phase_timeout"], value["weight"], \
        value["commitment"]
    if not (is_hex(digest, DIGEST_CHARS) and isinstance(client, bool) and is_weight(weight)):
        return None
    if isinstance(bandwidth, bool) or not isinstance(bandwidth, (int, float)) or not 0 <= bandwidth <= MAX_BANDWIDTH:
        return None
    if not isinstance(excluded, list) or len(excluded) > 1024 or \
            not all(isinstance(p, str) and len(p) <= 128 for p in excluded):
        return None
    if timeout is not None and not is_seconds(timeout):
        return None
    if not (is_hex(commitment, COMMITMENT_CHARS) if verified else commitment == ""):
        return None
    return Candidate(digest, float(bandwidth), client, tuple(excluded), None if timeout is None else float(timeout),
                     float(weight), commitment)



def signed_entries(raw: dict) -> dict[str, object]:
    """{writer's peer id: value} of the entries under owned subkeys (signed: hivemind's validator checked the
    signature); anything else under the key is ignored."""
    entries = {}
    for subkey, value in raw.items():
        writer = subkey_owner(subkey)
        if writer is not None:
            entries[writer] = value
    return entries


async def _read_candidates(node: SwarmNode, key: str, excluded: set[str], verified: bool,
                           malformed: set[str]) -> dict[str, Candidate]:
    """The attempt's candidates, by writer; writers whose entry is malformed are added to `malformed` (they are not
    waited for, and lead nothing)."""
    raw = signed_entries(await node.get(key))
    parsed = {peer: parse_candidate(value, verified) for peer, value in raw.items() if peer not in excluded}
    malformed.update(peer for peer, c in parsed.items() if c is None)
    return {peer: c for peer, c in parsed.items() if c is not None}


async def form_group(node: SwarmNode, run_id: str, round_no: int, attempt: int, me_as: Candidate,
                     expected: set[str], min_size: int, target_size: int, timeout: float,
                     excluded: Iterable[str] = (), not_waiting_for: Iterable[str] = (),
                     still_in: Optional[Callable[[], Optional[set[str]]]] = None,
                     push: Optional[GroupPush] = None, verified: bool = False, min_servers: int = 1,
                     patience: Optional[dict[str, float]] = None, attendance: Optional[dict[str, set[str]]] = None,
                     tamper: Optional[Callable[[str, dict, int, int], dict]] = None) -> tuple[Optional[Group], int]:
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
    we take a group pushed to us by our leader as if read from the DHT. `verified`: the run checks its reducers
    (combinations.reducers_verified), so every entry carries a nonce commitment and a group of three or more that
    does not carry them all is not formed. `min_servers`: members that accept connections a group needs (2 with
    averaging.checked_groups: clients receive no reports, so a lone server among them, reducing every part, would
    be checked by nobody). `patience`: seconds we wait at most for an expected peer (the whole window for one not
    named: Averager shortens it for a peer that never came in the rounds before). `attendance`, when given, gets
    "came" (the candidates we decided with) and "missed" (expected peers, still in the round by their
    announcements, whose entry never came). `tamper` (fault injection, faults.FaultPlan.tamper) may rewrite what we
    write, our entry ("entry") and the group we publish as leader ("final"); what we decide stays our own."""
    me = node.peer_id
    excluded = set(excluded) - {me}
    expected = set(expected) - excluded - set(not_waiting_for)
    awaited, in_round = set(expected), set(expected)  # (whom we waited for; of them, those still in the round)
    started = time.monotonic()
    deadline = started + timeout
    patience = patience or {}
    key = group_key(run_id, round_no, attempt)
    ttl = 3 * timeout + 30
    me_as = replace(me_as, excluded=tuple(sorted(excluded)))
    entry = {"digest": me_as.digest, "bandwidth": me_as.bandwidth, "client": me_as.client,
             "excluded": list(me_as.excluded), "phase_timeout": me_as.phase_timeout, "weight": me_as.weight,
             "commitment": me_as.commitment}
    if tamper is not None:
        entry = tamper("entry", entry, round_no, attempt)
    await node.store(key, entry, ttl=ttl, subkey=node.owned_subkey)

    poll = FIRST_POLL_SECONDS
    # Writers of entries that are no candidate: a peer whose record says it is in the round, but whose entry is
    # malformed, is not waited for until the deadline.
    malformed: set[str] = set()
    def enough(candidates: dict[str, Candidate]) -> bool:
        # Everyone expected is here, enough of them, and enough that accept connections (clients only cannot reduce:
        # we wait out the window for a server to come, so one that joins meanwhile averages with us).
        return expected <= set(candidates) and len(candidates) >= min_size and \
            sum(not c.client for c in candidates.values()) >= min_servers

    while True:
        candidates = {**await _read_candidates(node, key, excluded, verified, malformed), me: me_as}
        expected -= malformed - set(candidates)
        waited = time.monotonic() - started
        expected -= {peer for peer in expected if peer not in candidates and patience.get(peer, timeout) <= waited}
        if enough(candidates):
            break
        if still_in is not None:
            now_in = still_in()
            if now_in is None:
                logger.info("round %d: the swarm moved on while I waited for a group", round_no)
                return None, max(len(candidates) - 1, 1)
            in_round &= now_in | set(candidates)
            expected &= now_in | set(candidates)
            if enough(candidates):
                break
        if time.monotonic() >= deadline:
            # Stragglers: let entries written at this moment reach every reader before deciding.
            await asyncio.sleep(SETTLE_SECONDS)
            candidates = {**await _read_candidates(node, key, excluded, verified, malformed), me: me_as}
            break
        await asyncio.sleep(min(poll, max(deadline - time.monotonic(), 0.0), *(  # (until a patience runs out)
            max(patience[peer] - (time.monotonic() - started), 0.0) + 0.01 for peer in expected - set(candidates)
            if peer in patience)))
        poll = min(poll * 1.5, POLL_SECONDS)
    if attendance is not None:
        attendance["came"] = set(candidates) - {me}
        attendance["missed"] = (awaited & in_round) - set(candidates) - malformed
    seen = len(candidates) - 1
    peaceful = settled(candidates, attempt_salt(round_no, attempt))
    vouched = lineages(peaceful)
    groups = plan_groups(vouched, target_size, min_size, round_no, attempt, min_servers)
    members = next((group for group in groups if me in group), [])
    if not members:
        why = f"no other candidate holds my state {me_as.digest}: I re-sync once the swarm has averaged the round" \
            if me in peaceful and me not in vouched else "left out by accusations of bad data"
        logger.info("round %d: not in this attempt's group (%s)", round_no, why)
        return None, seen
    if len(members) < min_size:
        return None, seen
    if sum(not candidates[peer].client for peer in members) < max(min_servers, 1):
        # Nobody in it accepts connections, so nobody can reduce (and the leader would publish nothing), or too few
        # to check each other: after the window spent waiting for more, the averager says so once
        # (averager.Averager._say_no_group).
        logger.debug("round %d: fewer than %d candidates of my group accept connections", round_no,
                     max(min_servers, 1))
        return None, seen
    leader = leader_of(members, round_no, attempt)
    if leader == me:
        try:
            final = {"members": members, **group_terms(members, candidates, verified),
                     "swarm_size": sum(len(group) for group in groups)}
        except ValueError as e:
            logger.warning("round %d: %s", round_no, e)
            return None, seen
        if tamper is not None:
            final = tamper("final", final, round_no, attempt)
        if push is not None:
            push.send(members, round_no, attempt, final)
        await node.store(final_key(run_id, round_no, attempt), final, ttl=ttl, subkey=node.owned_subkey)

    def _may_lead(writer: str) -> bool:
        """A candidate the entries leave out, or one whose entry is malformed, leads no group; one whose entry we
        have not read yet is judged once read (below)."""
        return writer in vouched or (writer not in candidates and writer not in malformed)

    # Wait as long as the leader may still be waiting for its own candidates (it may have started later).
    final_deadline = time.monotonic() + timeout + 2 * SETTLE_SECONDS
    others_published = None
    poll = FIRST_POLL_SECONDS
    while time.monotonic() < final_deadline:
        pushed = push.finals(round_no, attempt, excluded) if push is not None else {}
        finals = pushed if leader in pushed else \
            {**await _read_finals(node, run_id, round_no, attempt, excluded, verified), **pushed}
        mine = {writer: final for writer, final in finals.items() if me in final[0] and _may_lead(writer)}
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
                finals = await _read_finals(node, run_id, round_no, attempt, excluded, verified)
                mine = {writer: final for writer, final in finals.items() if me in final[0] and _may_lead(writer)}
            if not mine:
                logger.info("round %d: leader %s formed a group without me", round_no, leader[-8:])
                return None, seen
            chosen, shares, phase_timeout, clients, mix, swarm_size, weights, commitments = \
                mine[leader_of(mine, round_no, attempt)]
            if len(chosen) < min_size or sum(not client for client in clients) < min_servers:
                return None, seen
            if set(chosen) - set(candidates):  # members we have not read yet (they wrote as we read)
                candidates = {**await _read_candidates(node, key, excluded, verified, malformed), **candidates}
            expected = _terms_or_none(chosen, candidates, verified)
            if expected is None or not _same_terms(expected, shares, phase_timeout, clients, mix, weights,
                                                   commitments) or swarm_size > len(candidates) or \
                    _unvouched(chosen, candidates, round_no, attempt):
                # A member may have written its entry again since we read it (a peer that found nobody retries
                # the attempt with what it trained meanwhile), or written one we had not read when the leader did:
                # read once more before judging the leader.
                candidates = {**candidates, **await _read_candidates(node, key, excluded, verified, malformed),
                              me: me_as}
                expected = _terms_or_none(chosen, candidates, verified)
            # The swarm size the leader counted sets how many tokens every member adds to its schedule and the
            # quorum its reference needs: no more candidates than this attempt's entries hold.
            if swarm_size > len(candidates):
                logger.warning("round %d: leader %s counted %d candidates where the entries hold %d; not averaging "
                               "with it", round_no, leader_of(mine, round_no, attempt)[-8:], swarm_size,
                               len(candidates))
                return None, seen
            unvouched = _unvouched(chosen, candidates, round_no, attempt)
            if unvouched:
                logger.warning("round %d: leader %s published a group with %s, whom the entries leave out (a state "
                               "no other candidate holds, or accused); not averaging with it", round_no,
                               leader_of(mine, round_no, attempt)[-8:], ", ".join(peer[-8:] for peer in unvouched))
                return None, seen
            if expected is None or not _same_terms(expected, shares, phase_timeout, clients, mix, weights,
                                                   commitments):
                # The leader chose them, not its members' entries: it may be giving itself (or a slow peer) the
                # whole reduction, or a deadline of its own. Not followed: the next attempt has another leader.
                logger.warning("round %d: leader %s published a group whose shares, deadline or mix its members' "
                               "entries do not give; not averaging with it", round_no, leader_of(mine, round_no,
                                                                                                 attempt)[-8:])
                return None, seen
            return Group.of(round_no, attempt, chosen, shares, phase_timeout, clients, mix, swarm_size, weights,
                            commitments), seen
        if push is not None:
            await push.wait(round_no, attempt, poll)  # a push wakes us at once
        else:
            await asyncio.sleep(poll)
        poll = min(poll * 1.5, POLL_SECONDS)
    logger.info("round %d: no group leader published a group in time", round_no)
    return None, seen


def _unvouched(members: Sequence[str], candidates: dict[str, Candidate], round_no: int, attempt: int) -> list[str]:
    """Members of a published group whose state digest is no lineage (`lineages`) among the entries we read: a
    leader that put them in would have their params mixed into everyone's."""
    vouched = lineages(settled(candidates, attempt_salt(round_no, attempt)))
    return [peer for peer in members if peer in candidates and peer not in vouched]


def _terms_or_none(members: Sequence[str], candidates: dict[str, Candidate], verified: bool) -> Optional[dict]:
    try:
        return group_terms(members, candidates, verified)
    except (KeyError, ValueError):
        return None


def group_terms(members: Sequence[str], candidates: dict[str, Candidate], verified: bool = False) -> dict:
    """What a group's leader publishes besides its members, from the members' own entries alone (so every member
    can check it): the reduction shares from their measured bandwidths (each counted as at most BANDWIDTH_SPREAD
    times the members' lower median, so one declared link cannot take the whole reduction), who is a client, the
    deadline, whether params mix, every member's weight and, where the run checks reducers, nonce commitment.
    Raises KeyError for a member without an entry, ValueError if nobody can reduce or a member declared no
    weight (or, `verified`, no commitment)."""
    entries = [candidates[m] for m in members]
    if any(c.weight is None for c in entries) or (verified and not all(c.commitment for c in entries)):
        raise ValueError("a member's entry declares no weight or nonce commitment")
    bandwidths = sorted(c.bandwidth or 1.0 for c in entries)
    ceiling = BANDWIDTH_SPREAD * bandwidths[(len(bandwidths) - 1) // 2]
    return {"shares": optimal_shares([min(c.bandwidth or 1.0, ceiling) for c in entries],
                                     [not c.client for c in entries]),
            "clients": [c.client for c in entries], "phase_timeout": group_timeout(entries),
            "mix": len({c.digest for c in entries}) > 1,
            "weights": [c.weight for c in entries],
            "commitments": [c.commitment for c in entries] if verified else []}


def _same_terms(expected: dict, shares: list[float], phase_timeout: Optional[float], clients: list[bool],
                mix: bool, weights: list[float], commitments: list[str]) -> bool:
    return (expected["clients"] == clients and expected["mix"] == mix and expected["phase_timeout"] == phase_timeout
            and all(abs(a - b) <= 1e-9 for a, b in zip(expected["shares"], shares))
            and expected["weights"] == weights and expected["commitments"] == commitments)


async def _read_finals(node: SwarmNode, run_id: str, round_no: int, attempt: int,
                       excluded: set[str], verified: bool) -> dict[str, Final]:
    raw = signed_entries(await node.get(final_key(run_id, round_no, attempt)))
    finals = {}
    for writer, value in raw.items():
        final = parse_final(writer, value, excluded, round_no, attempt, verified)
        if final is not None:
            finals[writer] = final
    return finals
