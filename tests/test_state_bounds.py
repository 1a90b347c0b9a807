"""A state holder cannot hold a joiner (and so its training thread) forever: one that dribbles its bytes just
under the stall timeout is dropped once it falls below the minimum rate over a range, its ranges go to honest
holders, and a sync as a whole has a deadline. Real p2p streams, as in test_state_sync.py."""

from __future__ import annotations

import asyncio
import time

import msgpack

from swarm.dht.frames import recv_frame, send_frame
from swarm.peer import state_wire
from swarm.peer.state_serve import StateServer
from swarm.peer.state_wire import MIN_BYTES_PER_S, sync_deadline
from test_state_sync import RANGE, _diloco, _download, _same_state, _trained, network  # noqa: F401 - fixture


class DribblingServer(StateServer):
    """Answers every range with the true header, then one byte every half second: never silent for a whole stall,
    so only the rate bound can drop it."""

    def __init__(self, diloco):
        super().__init__(diloco)
        self.dribbled = 0

    async def handle(self, remote, reader, writer):
        request = msgpack.unpackb(await recv_frame(reader, 1024))
        snapshot = await self.snapshot(request.get("sha256"))
        await send_frame(writer, msgpack.packb(snapshot.header))
        offset = request.get("offset", 0)
        for i in range(request.get("length", 0)):
            await send_frame(writer, snapshot.payload[offset + i:offset + i + 1])
            self.dribbled += 1
            await asyncio.sleep(0.5)


def test_a_dribbling_holder_is_dropped_and_its_ranges_go_to_an_honest_one(network):
    loop, add = network
    source = _trained(0)
    dribbler = DribblingServer(_trained(0))
    holders = [add(dribbler), add(StateServer(source))]
    joiner_state = _diloco(2)
    started = time.monotonic()
    done = _download(loop, add(), holders, joiner_state, source.digest())  # stall 20 s: a frame every 0.5 s is "alive"
    took = time.monotonic() - started
    assert _same_state(joiner_state, source)
    assert done.bytes_by_holder.get(holders[0].peer_id, 0) == 0, "nothing the dribbler started counts as served"
    assert dribbler.dribbled > 0, "the dribbler really was asked for a range"
    bound = 20 + RANGE / MIN_BYTES_PER_S
    assert took < bound + 20, f"the dribbler held the download {took:.0f} s, past its rate bound ({bound:.0f} s)"


def test_a_sync_has_a_deadline_that_grows_with_the_state():
    small, big = sync_deadline(1 << 20), sync_deadline(1 << 30)
    assert small >= 2 * state_wire.STALL_SECONDS and big > small
    assert big == 2 * (state_wire.STALL_SECONDS + (1 << 30) / MIN_BYTES_PER_S)
