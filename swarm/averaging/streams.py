"""The opening side of the all-reduce protocol: streams this peer opens to other members.

A stream is a msgpack header, the receiver's one-word answer ("ok", or "conflict" when it averages that round and
attempt in another group), then frames that depend on the header's phase: chunks (a meta frame and a payload
frame each) and the receiver's "done" for "part", "avg" and "commit"; the reducer's averaged chunks for a client
member's "pull"; "apply" or "abort" for its "decision"; nothing more for "abort" and "ping". A "ring" stream
carries chunks like "part" (see ring.py). The header and metas are typed in messages.py.
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import replace
from typing import Callable, Iterable, Optional

import msgpack
from hivemind.p2p import P2PDaemonError

from swarm.averaging.faults import FaultPlan
from swarm.averaging.matchmaking import Group
from swarm.averaging.messages import Blame, Header
from swarm.dht.node import SwarmNode, recv_frame, send_frame

logger = logging.getLogger(__name__)
MAX_HEADER_BYTES = 64 << 10
STREAM_RETRIES = 3  # re-opens of a stream that broke before the receiver answered


class GroupConflict(RuntimeError):
    """A member is averaging the same round and attempt in a different group."""


class OversizedChunk(ValueError):
    """A chunk's payload frame announced more bytes than the chunk can take; nothing of it was read."""


async def read_chunk(reader: asyncio.StreamReader, max_payload: int,
                     timeout: Optional[float] = None) -> tuple[dict, bytes]:
    """One chunk of a stream: its meta (a dict; anything else reads as empty) and its payload. Each frame must
    arrive whole within `timeout` s (None: no limit), so a sender that dribbles is dropped; raises OversizedChunk
    for a payload over `max_payload` bytes, asyncio.TimeoutError for a late frame."""
    meta = msgpack.unpackb(await asyncio.wait_for(recv_frame(reader, MAX_HEADER_BYTES), timeout))
    try:
        payload = await asyncio.wait_for(recv_frame(reader, max_bytes=max_payload), timeout)
    except ValueError as e:  # (recv_frame's over-the-limit length; nothing else it raises is a ValueError)
        raise OversizedChunk(str(e)) from None
    return (meta if isinstance(meta, dict) else {}), payload


class StreamClient:
    """Opens this peer's streams of one run's all-reduce protocol."""

    def __init__(self, node: SwarmNode, protocol: str, pull_bound: Callable[[str, Header], int], faults: FaultPlan):
        # pull_bound(reducer, header): the largest payload frame we read of the averaged chunks we pull from it
        self.node, self.protocol, self.pull_bound, self.faults = node, protocol, pull_bound, faults
        self._background: set[asyncio.Task] = set()  # held until done: asyncio holds tasks only weakly

    async def send(self, peer: str, header: Header, chunks, stats: dict, die_after_first=None) -> None:
        """Send `header` and then every (meta, payload) that the async iterator `chunks` yields, as they come.

        A stream that fails to open, or breaks before the receiver's answer, is opened again (STREAM_RETRIES
        times at most, backing off with jitter): the receiver's daemon resets a stream it cannot hand to the
        receiver's process at once (its handler socket's queue is full while that process is busy), and nothing
        of ours was used yet (the receiver's slots take only the first copy of anything)."""
        for retry in range(STREAM_RETRIES + 1):
            writer = None
            try:
                reader, writer = await self.node.open_stream(peer, self.protocol)
                await send_frame(writer, msgpack.packb(header.to_wire()))
                answer = await recv_frame(reader, 16)
                break
            except (ConnectionError, asyncio.IncompleteReadError, P2PDaemonError):
                if writer is not None:
                    writer.close()
                if retry == STREAM_RETRIES:
                    raise
                await asyncio.sleep(0.2 * 2 ** retry * (0.5 + random.random()))
        try:
            if answer == b"conflict":
                raise GroupConflict(f"{peer[-8:]} is averaging this round in another group")
            sent = 0
            async for meta, payload in chunks:
                await send_frame(writer, msgpack.packb(meta))
                await send_frame(writer, payload)
                stats["sent"] += len(payload)
                sent += 1
                if die_after_first is not None:
                    self.faults.maybe_die(*die_after_first)  # dies with some chunks delivered, others not
            try:
                confirmed = await recv_frame(reader, 16) == b"done"
            except (ConnectionError, asyncio.IncompleteReadError):
                confirmed = False
            if not confirmed:
                if sent and await self.alive(peer, header):
                    # Every chunk was written and the receiver is alive: whether they arrived, the reducers'
                    # contributor lists and its commit tell everyone. A lost confirmation alone fails no round.
                    logger.info("%s did not confirm the %s stream; the round's accounts decide", peer[-8:],
                                header.phase)
                    return
                raise ConnectionError(f"{peer[-8:]} did not confirm the stream")
        finally:
            writer.close()

    async def alive(self, peer: str, header: Header, timeout: float = 3.0) -> bool:
        """Whether `peer` still answers a stream about this group (a dead peer's daemon resets it at once)."""
        try:
            reader, writer = await asyncio.wait_for(self.node.open_stream(peer, self.protocol), timeout)
            try:
                await send_frame(writer, msgpack.packb(replace(header, phase="ping", chunks=0).to_wire()))
                return await asyncio.wait_for(recv_frame(reader, 16), timeout) == b"ok"
            finally:
                writer.close()
        except Exception:  # noqa: BLE001 - any failure means we cannot count on it
            return False

    def tell_abort(self, group: Group, suspects: Iterable[str] = (), rejected: Iterable[str] = ()) -> None:
        """We gave this attempt up: tell the members we can reach, in the background, so they stop waiting for
        our parts and fail the attempt now rather than at their deadline (they retry without waiting for us).
        `suspects` (did not deliver) and `rejected` (sent bad data) tell a ring's members whom we blame: in a
        ring only a peer's successor sees what it sent."""
        header = Header("abort", group.group_id, group.round, group.attempt,
                        body=Blame(tuple(suspects), tuple(rejected))).to_wire()
        clients = group.clients or (False,) * len(group.members)

        async def tell(peer: str) -> None:
            try:
                reader, writer = await asyncio.wait_for(self.node.open_stream(peer, self.protocol), 5)
                try:
                    await send_frame(writer, msgpack.packb(header))
                    await asyncio.wait_for(recv_frame(reader, 16), 5)
                finally:
                    writer.close()
            except Exception:  # noqa: BLE001 - best effort: their deadline still ends the attempt
                pass

        for peer, client in zip(group.members, clients):
            if peer != self.node.peer_id and not client:
                task = asyncio.ensure_future(tell(peer))
                self._background.add(task)
                task.add_done_callback(self._background.discard)

    async def pull(self, peer: str, header: Header, slot: Callable[[int], asyncio.Future], chunks: int) -> None:
        """As a client member: fetch the averaged chunks of `peer`'s part as it makes them, into `slot(index)`.
        Raises OversizedChunk, reading nothing of it, for a frame larger than its chunk encodes to (pull_bound)."""
        max_payload = self.pull_bound(peer, header)
        reader, writer = await self.node.open_stream(peer, self.protocol)
        try:
            await send_frame(writer, msgpack.packb(header.to_wire()))
            if await recv_frame(reader, 16) == b"conflict":
                raise GroupConflict(f"{peer[-8:]} is averaging this round in another group")
            for index in range(chunks):
                chunk = await read_chunk(reader, max_payload)
                if not slot(index).done():
                    slot(index).set_result(chunk)
        finally:
            writer.close()

    async def ask_decision(self, peer: str, header: Header) -> bool:
        """As a client member: whether `peer` applies the group's average (it does once every member committed)."""
        reader, writer = await self.node.open_stream(peer, self.protocol)
        try:
            await send_frame(writer, msgpack.packb(header.to_wire()))
            if await recv_frame(reader, 16) == b"conflict":
                return False
            return await recv_frame(reader, 16) == b"apply"
        finally:
            writer.close()
