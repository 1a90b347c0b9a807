"""A state holder cannot hold a joiner (and so its training thread) forever: one that dribbles its bytes just
under the stall timeout is dropped once it falls below the minimum rate over a range, its ranges go to honest
holders, and a sync as a whole has a deadline. Real p2p streams, as in test_state_sync.py. The server's side: a
requester that is silent, dribbles, or stops reading is dropped at a deadline."""

from __future__ import annotations

import asyncio
import time

import msgpack
import pytest
import torch

from swarm.dht.frames import FRAME_HEADER, recv_frame, send_frame
from swarm.config import OuterRecipe
from swarm.dht import frames
from swarm.peer.state import wire as state_wire
from swarm.peer.diloco import DiLoCo
from swarm.peer.state.serve import StateServer
from swarm.peer.state.wire import MIN_BYTES_PER_S, sync_deadline
from conftest import dribble
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


@pytest.mark.slow  # about 7-12 s on the 2-core machines: out of the quick subset
def test_a_dribbling_holder_is_dropped_and_its_ranges_go_to_an_honest_one(network, monkeypatch):
    # (a rate bound 4x the default: 2 s a range instead of 8, which honest holders on 127.0.0.1 beat by far)
    monkeypatch.setattr(frames, "MIN_BYTES_PER_S", 4 * MIN_BYTES_PER_S)
    loop, add = network
    source = _trained(0)
    dribbler = DribblingServer(_trained(0))
    holders = [add(dribbler), add(StateServer(source))]
    joiner_state = _diloco(2)
    started = time.monotonic()
    # (a stall of 3 s: a frame every 0.5 s is "alive", so only the rate bound can drop the dribbler)
    done = _download(loop, add(), holders, joiner_state, source.digest(), stall=3)
    took = time.monotonic() - started
    assert _same_state(joiner_state, source)
    assert done.bytes_by_holder.get(holders[0].peer_id, 0) == 0, "nothing the dribbler started counts as served"
    assert dribbler.dribbled > 0, "the dribbler really was asked for a range"
    bound = 3 + RANGE / frames.MIN_BYTES_PER_S
    assert took < bound + 20, f"the dribbler held the download {took:.0f} s, past its rate bound ({bound:.0f} s)"


def test_a_sync_has_a_deadline_that_grows_with_the_state():
    small, big = sync_deadline(1 << 20), sync_deadline(1 << 30)
    assert small >= 2 * state_wire.STALL_SECONDS and big > small
    assert big == 2 * (state_wire.STALL_SECONDS + (1 << 30) / MIN_BYTES_PER_S)


def test_a_requester_that_sends_nothing_dribbles_or_stops_reading_is_dropped_at_a_deadline(monkeypatch):
    """The state server's side: nobody holds one of its handler slots past the request deadline (silent or
    dribbling) or past the time a joiner must read its answer in (a requester that asks for a range and never
    reads it: real TCP on 127.0.0.1, so its unread bytes push back)."""
    monkeypatch.setattr(frames, "STALL_SECONDS", 0.5)  # answer_seconds reads them there
    monkeypatch.setattr(frames, "MIN_BYTES_PER_S", 1 << 30)
    server = StateServer(DiLoCo(torch.nn.Linear(2048, 2048), OuterRecipe()))  # 32 MB of params and momentum
    server.request_timeout = 0.3

    async def scenario() -> None:
        silent = asyncio.ensure_future(server.handle("mallory", asyncio.StreamReader(), None))
        dribbled = asyncio.StreamReader()
        dribbling = asyncio.ensure_future(server.handle("mallory", dribbled, None))
        await dribble(dribbled, FRAME_HEADER.pack(100) + b"\x00" * 100, until=dribbling)
        await asyncio.wait_for(asyncio.gather(silent, dribbling), 2)
        assert server.dropped == 2
        size = len((await server.current()).payload)
        assert size > 16 << 20, "more than the sockets' buffers hold, so a requester that does not read pushes back"
        answered = asyncio.Event()

        async def serve(reader, writer) -> None:
            try:
                await server.handle("mallory", reader, writer)
            finally:
                answered.set()
                writer.close()

        listener = await asyncio.start_server(serve, "127.0.0.1", 0)
        reader, writer = await asyncio.open_connection(*listener.sockets[0].getsockname()[:2])
        await send_frame(writer, msgpack.packb({"offset": 0, "length": size}))  # ...and never reads a byte
        await asyncio.wait_for(answered.wait(), 5)
        assert server.dropped == 3 and server.bytes_served == 0
        writer.close()
        listener.close()

    asyncio.run(scenario())
