"""What the state server and its two clients (replay and download) share: the stream protocol and its framing,
the error a failed sync raises, and fetching keys from several holders at once, a failed key going to another."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from contextlib import asynccontextmanager
from typing import AsyncIterator

import msgpack

# The bulk-bytes helpers live with the frames (the data layer uses them too); re-exported for the state's users.
from swarm.dht.frames import (FRAME_BYTES, MIN_BYTES_PER_S, STALL_SECONDS, failure_reason,  # noqa: F401
                              receive_bytes, send_bytes, send_frame)
from swarm.dht.node import SwarmNode

logger = logging.getLogger(__name__)
REQUESTS_PER_HOLDER = 2  # in flight, so a holder's link does not idle between two ranges
MAX_REPLAY_STEPS = 64  # outer steps a holder lists at most in one answer


class StateSyncError(RuntimeError):
    """No holder could provide the state asked for. `moved_on`: holders answered, serving another state (the swarm
    moved on while we looked: ask again for the newest at once rather than back off)."""

    def __init__(self, message: str, moved_on: bool = False):
        super().__init__(message)
        self.moved_on = moved_on


class MovedOn(ValueError):
    """A holder no longer serves what we fetch from it: its swarm took a round."""


def protocol(run_id: str) -> str:
    return f"swarm.{run_id}.state"


@asynccontextmanager
async def request_stream(node: SwarmNode, holder: str, run_id: str, request: dict,
                         stall: float) -> AsyncIterator[asyncio.StreamReader]:
    """A stream to `holder`'s state server with `request` sent on it: the reader of its answer, closed on exit."""
    reader, writer = await asyncio.wait_for(node.open_stream(holder, protocol(run_id)), stall)
    try:
        await send_frame(writer, msgpack.packb(request))
        yield reader
    finally:
        writer.close()


def sync_deadline(state_bytes: int) -> float:
    """Seconds a whole sync (a replay, then a download) may take: the state at MIN_BYTES_PER_S, twice, plus the
    stalls. Past it the peer trains on with its own state and tries again later."""
    return 2 * (STALL_SECONDS + state_bytes / MIN_BYTES_PER_S)


async def spread(sources: list[str], keys: list, fetch, what: str) -> tuple[dict, Counter, int]:
    """`await fetch(holder, key)` -> (value, bytes) for every key, from all `sources` at once (REQUESTS_PER_HOLDER
    in flight each); a key whose fetch fails goes back for another source, and that source is dropped. Returns
    the values by key (some missing if every source dropped), the bytes from each source, and how many sources
    dropped because they moved on (MovedOn)."""
    values: dict = {}
    todo: asyncio.Queue = asyncio.Queue()
    for key in keys:
        todo.put_nowait(key)
    served: Counter = Counter()
    alive, moved_on = set(sources), set()

    async def fetch_from(holder: str) -> None:
        while holder in alive:
            try:
                key = todo.get_nowait()
            except asyncio.QueueEmpty:
                return
            try:
                value, size = await fetch(holder, key)
            except Exception as e:  # noqa: BLE001 - the key goes back for another holder
                todo.put_nowait(key)
                if isinstance(e, MovedOn):
                    moved_on.add(holder)
                if holder in alive:
                    alive.discard(holder)
                    logger.info("state holder %s dropped mid-%s (%s); %d left", holder[-8:], what,
                                failure_reason(e), len(alive))
                return
            values[key] = value
            served[holder] += size

    while todo.qsize() and alive:  # one key to each source before a second to any: few keys spread too
        await asyncio.gather(*(fetch_from(h) for _ in range(REQUESTS_PER_HOLDER) for h in sorted(alive)))
    return values, served, len(moved_on)
