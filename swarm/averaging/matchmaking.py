"""Group formation for one outer round: peers that reached the averaging point announce themselves under the
round's key, wait for the peers they expect, and adopt the member list published by the group's leader (the
smallest peer id among the candidates). Every member checks the same group id in the all-reduce, so a peer
whose view differed fails that round cleanly instead of averaging with the wrong set.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Optional

from swarm.dht.node import SwarmNode
from swarm.dht.records import final_key, group_key

logger = logging.getLogger(__name__)
POLL_SECONDS = 0.2
SETTLE_SECONDS = 0.4


@dataclass(frozen=True)
class Group:
    round: int
    attempt: int
    members: tuple[str, ...]  # sorted peer ids
    group_id: str

    @classmethod
    def of(cls, round_no: int, attempt: int, members: Iterable[str]) -> "Group":
        ordered = tuple(sorted(set(members)))
        digest = hashlib.sha256(f"{round_no}|{attempt}|{'|'.join(ordered)}".encode()).hexdigest()[:32]
        return cls(round_no, attempt, ordered, digest)


def choose_members(entries: dict[str, str], target_size: int) -> list[str]:
    """Candidates that share the most common params digest (ties: the smallest digest), sorted by peer id and
    capped at `target_size`. A pure function, so every peer with the same view picks the same members."""
    if not entries:
        return []
    counts = Counter(entries.values())
    best = min(counts, key=lambda digest: (-counts[digest], digest))
    return sorted(peer for peer, digest in entries.items() if digest == best)[:target_size]


async def _read_entries(node: SwarmNode, key: str) -> dict[str, str]:
    raw = await node.get(key)
    return {peer: value["digest"] for peer, value in raw.items()
            if isinstance(value, dict) and isinstance(value.get("digest"), str)}


async def form_group(node: SwarmNode, run_id: str, round_no: int, attempt: int, digest: str, expected: set[str],
                     min_size: int, target_size: int, timeout: float) -> Optional[Group]:
    """Find this round's group; None if no group of at least `min_size` formed within about `timeout` s.

    `expected` are peers believed to be in this round (from their announcements): we wait for them, but never
    past the deadline, so a peer that crashed only delays the round."""
    me = node.peer_id
    started = time.monotonic()
    deadline = started + timeout
    key = group_key(run_id, round_no, attempt)
    await node.store(key, {"digest": digest}, ttl=3 * timeout + 30, subkey=me)

    entries: dict[str, str] = {me: digest}
    while True:
        entries = {**await _read_entries(node, key), me: digest}
        if len(entries) >= target_size or (expected <= set(entries) and len(entries) >= min_size):
            break
        if time.monotonic() >= deadline:
            break
        await asyncio.sleep(POLL_SECONDS)
    await asyncio.sleep(SETTLE_SECONDS)  # let entries written at the same moment reach every reader
    entries = {**await _read_entries(node, key), me: digest}
    members = choose_members(entries, target_size)
    if me not in members:
        logger.info("round %d: my params digest is not the group's; skipping this round", round_no)
        return None
    if members[0] == me:
        await node.store(final_key(run_id, round_no, attempt), {"members": members}, ttl=3 * timeout + 30, subkey=me)

    final_deadline = time.monotonic() + max(5.0, timeout / 2)
    while time.monotonic() < final_deadline:
        finals = await _read_finals(node, run_id, round_no, attempt)
        if finals:
            await asyncio.sleep(SETTLE_SECONDS)  # a smaller-id leader may be writing at this moment
            finals = await _read_finals(node, run_id, round_no, attempt)
            leader = min(finals)
            chosen = finals[leader]
            if me not in chosen:
                logger.info("round %d: leader %s formed a group without me", round_no, leader[-8:])
                return None
            if len(chosen) < min_size:
                return None
            return Group.of(round_no, attempt, chosen)
        await asyncio.sleep(POLL_SECONDS)
    logger.info("round %d: no group leader published a group in time", round_no)
    return None


async def _read_finals(node: SwarmNode, run_id: str, round_no: int, attempt: int) -> dict[str, list[str]]:
    raw = await node.get(final_key(run_id, round_no, attempt))
    finals = {}
    for writer, value in raw.items():
        members = value.get("members") if isinstance(value, dict) else None
        # Only a leader may publish: its own id must be the smallest member.
        if (isinstance(members, list) and members and all(isinstance(m, str) for m in members)
                and min(members) == writer):
            finals[writer] = members
    return finals
