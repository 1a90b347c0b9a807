"""A group as its leader publishes it (see matchmaking.form_group): who may publish it (leader_of), what a member
accepts (parse_final), and GroupPush, which sends it straight to the members over a stream as it goes into the DHT,
so a member starts the all-reduce without waiting for the DHT write and its next read of it. The DHT entry stays
the record; a pushed group is checked exactly as one read from there."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
from typing import Iterable, Optional

import msgpack

from swarm.dht.frames import recv_frame, send_frame
from swarm.dht.node import SwarmNode
from swarm.words import shown

logger = logging.getLogger(__name__)
MAX_PUSH_BYTES = 1 << 20  # a pushed group: its member ids, shares and flags
PUSHED_KEYS = 16  # (round, attempt) keys whose pushed groups a peer keeps
PUSH_SECONDS = 5.0  # a push must arrive whole within this (its sender waits as long for our answer)


def leader_of(members: Iterable[str], round_no: int, attempt: int) -> str:
    """The member that publishes the group: the one whose id hashes smallest with the round and attempt. (The
    smallest id led every group before, so a key ground for a small id led every round; now a key leads about
    one round in len(members), and a key ground for one round leads that round only.)"""
    return min(members, key=lambda peer: _rank(peer, round_no, attempt))


def _rank(peer: str, round_no: int, attempt: int) -> bytes:
    return hashlib.sha256(f"{round_no}|{attempt}|{peer}".encode()).digest()


# (members, shares, phase_timeout, clients, mix, swarm_size, weights, commitments)
Final = tuple[list[str], list[float], Optional[float], list[bool], bool, int, list[float], list[str]]


COMMITMENT_CHARS = 32  # a nonce commitment: sha256 in hex, cut to 128 bits (verify.nonce_commitment)
FINAL_FIELDS = frozenset({"members", "shares", "phase_timeout", "clients", "mix", "swarm_size", "weights",
                          "commitments"})


def parse_final(writer: str, value: object, excluded: set[str], round_no: int, attempt: int,
                verified: bool = False) -> Optional[Final]:
    """A group of this round and attempt as its leader `writer` published (or pushed) it, or None if it is
    malformed (one schema: every field present, of its type and bounds; every member's weight, and in a run that
    checks its reducers (`verified`) every member's nonce commitment), not the writer's to publish (see
    leader_of), or names an excluded peer. Its terms are then recomputed by each member from the members' own
    entries (matchmaking.group_terms)."""
    if writer in excluded or not isinstance(value, dict) or not FINAL_FIELDS <= value.keys():
        return None
    members, shares = value.get("members"), value.get("shares")
    # Only a leader may publish: it must be the group's leader_of; shares must be a distribution.
    if not (isinstance(members, list) and members and all(isinstance(m, str) for m in members)
            and members == sorted(set(members)) and leader_of(members, round_no, attempt) == writer
            and isinstance(shares, list) and len(shares) == len(members)
            and all(isinstance(s, (int, float)) and not isinstance(s, bool) and math.isfinite(s) and s >= 0
                    for s in shares)
            and abs(sum(shares) - 1) < 1e-6 and not excluded & set(members)
            and (value.get("phase_timeout") is None or is_seconds(value.get("phase_timeout")))):
        return None
    timeout, clients, mix, swarm_size = value["phase_timeout"], value["clients"], value["mix"], value["swarm_size"]
    if not isinstance(clients, list) or len(clients) != len(members) or \
            not all(isinstance(c, bool) for c in clients) or \
            any(c and share > 0 for c, share in zip(clients, shares)) or all(clients):
        return None  # a client never reduces, and someone must
    if not isinstance(mix, bool) or isinstance(swarm_size, bool) or not isinstance(swarm_size, int) or \
            not len(members) <= swarm_size <= 1 << 20:
        return None
    weights, commitments = value["weights"], value["commitments"]
    if not isinstance(weights, list) or len(weights) != len(members) or not all(is_weight(w) for w in weights):
        return None
    if not isinstance(commitments, list) or len(commitments) != (len(members) if verified else 0) or \
            not all(is_hex(c, COMMITMENT_CHARS) for c in commitments):
        return None
    return (members, [float(s) for s in shares], None if timeout is None else float(timeout), clients, mix,
            swarm_size, [float(w) for w in weights], list(commitments))


def is_weight(value: object) -> bool:
    """A contribution's declared weight (tokens): a finite number >= 0 (reducers refuse one over the run's bound)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and \
        0 <= value < 1e18


def is_hex(value: object, length: int) -> bool:
    """A lowercase hex string of exactly `length` characters (a state digest, a nonce commitment)."""
    return isinstance(value, str) and len(value) == length and all(c in "0123456789abcdef" for c in value)


def is_seconds(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and \
        0 < value < 1e6


class GroupPush:
    """A leader's group, pushed to its members over a stream of protocol `swarm.<run>.group` as it is published,
    and the groups pushed to us. The sender is the stream's authenticated remote, and a pushed group is checked as
    one read from the DHT (only its leader_of may publish it), so a push can do nothing a DHT entry cannot."""

    def __init__(self, node: SwarmNode, run_id: str, verified: bool = False):
        """`verified`: the run checks its reducers, so a group carries every member's nonce commitment."""
        self.node, self.protocol, self.verified = node, f"swarm.{run_id}.group", verified
        self._finals: dict[tuple[int, int], dict[str, Final]] = {}
        self._arrived: dict[tuple[int, int], asyncio.Event] = {}
        self._background: set[asyncio.Task] = set()  # held until done: asyncio holds tasks only weakly
        self.push_timeout = PUSH_SECONDS
        self.dropped = 0  # pushes that did not arrive whole in time: their stream was closed

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
        try:  # a sender that sends nothing, or dribbles, holds a handler slot only this long
            frame = await asyncio.wait_for(recv_frame(reader, MAX_PUSH_BYTES), self.push_timeout)
        except asyncio.TimeoutError:
            self.dropped += 1
            logger.debug("dropped a group push stream from %s: nothing whole within %.0f s", remote[-8:],
                         self.push_timeout)
            return
        body = msgpack.unpackb(frame)
        if not isinstance(body, dict):
            raise ValueError(f"malformed group push from {remote}")
        key = (body.get("round"), body.get("attempt"))
        if not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 40 for v in key):
            raise ValueError(f"group push from {remote} names round/attempt {shown(key)}")
        final = parse_final(remote, body.get("final"), set(), *key, self.verified)
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
                    await asyncio.wait_for(recv_frame(reader, 16), PUSH_SECONDS)
                finally:
                    writer.close()
            except Exception as e:  # noqa: BLE001 - it reads the group from the DHT instead
                logger.debug("could not push round %d's group to %s: %s", round_no, peer[-8:], e)

        for peer in members:
            if peer != self.node.peer_id:
                task = asyncio.ensure_future(push(peer))
                self._background.add(task)
                task.add_done_callback(self._background.discard)
