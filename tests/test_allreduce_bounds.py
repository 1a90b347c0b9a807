"""What a peer can make the all-reduce server spend: streams from non-members and chunks larger than the sender's
part are refused before they are read (and a reducer's averaged chunks larger than they encode to, when a client
member pulls them), streams over the per-peer and total caps are closed at once, and silent
or dribbling senders are dropped at their read deadline. In one process, on the in-memory network of
test_allreduce_in_memory.py."""

from __future__ import annotations

import asyncio

import msgpack
import pytest
import torch
from test_allreduce_in_memory import PEERS, _Node, _Writer

from swarm.averaging.allreduce import (MAX_EARLY_PER_PEER, MAX_STREAMS, MAX_STREAMS_PER_PEER, Expected,
                                       GroupAllReduce)
from swarm.averaging.common import StreamBound, chunk_bounds, max_encoded_len
from swarm.averaging.deadlines import AdaptiveDeadlines
from swarm.averaging.matchmaking import Group
from swarm.averaging.messages import Header
from swarm.averaging.partition import partition
from swarm.averaging.streams import OversizedChunk
from swarm.compression import CODEC_NAMES, get_codec
from swarm.dht.node import FRAME_HEADER, StreamGate, recv_frame

NUMEL = 300_000
PROTOCOL = "swarm.t.allreduce"


def _frame(data: bytes) -> bytes:
    return FRAME_HEADER.pack(len(data)) + data


class _Stream:
    """A stream from `remote` into `allreduce`'s handler: the test writes with `send`, reads its answers."""

    def __init__(self, allreduce: GroupAllReduce, remote: str):
        self.inbound, self.replies = asyncio.StreamReader(), asyncio.StreamReader()
        self.task = asyncio.ensure_future(self._serve(allreduce, remote))

    async def _serve(self, allreduce: GroupAllReduce, remote: str) -> None:
        writer = _Writer(self.replies)
        try:
            await allreduce._on_stream(remote, self.inbound, writer)
        finally:
            writer.close()  # as SwarmNode's guard closes every served stream

    def send(self, data: bytes) -> "_Stream":
        self.inbound.feed_data(data)
        return self

    def header(self, **fields) -> "_Stream":
        return self.send(_frame(msgpack.packb({"round": 0, "attempt": 0, "phase": "part", "chunks": 0, **fields})))

    async def reply(self) -> bytes:
        """The handler's next answer, or b"" once it closed the stream without one."""
        try:
            return await asyncio.wait_for(recv_frame(self.replies, 16), 2)
        except asyncio.IncompleteReadError:
            return b""


async def _until(condition, timeout: float = 5.0) -> None:
    """Wait for the handlers' tasks until `condition()` holds (fails the test past `timeout` s)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "the condition never held"
        await asyncio.sleep(0.01)


async def _silent(remote, reader, writer) -> None:
    await asyncio.sleep(60)  # a member that accepts our streams and never answers: our run waits for it


def _server(codec: str = "none", reports: list | None = None) -> GroupAllReduce:
    handlers = {("peerB", PROTOCOL): _silent}
    on_bad_peer = (lambda peer, reason: reports.append((peer, reason))) if reports is not None else None
    return GroupAllReduce(_Node("peerA", handlers), "t", codec, NUMEL, AdaptiveDeadlines(5.0, 30.0),
                          on_bad_peer=on_bad_peer)


@pytest.mark.parametrize("codec", CODEC_NAMES)
def test_every_codec_averages_within_the_frame_bounds_and_they_are_sized_to_the_chunks(codec):
    """The bounds are tight enough to matter (a lossy codec's chunk is far below fp32's) and loose enough that an
    honest group, with a lossless tail and a client member, averages without a refused stream."""

    async def scenario():
        handlers: dict = {}
        clients = (False, False, True)
        servers = [GroupAllReduce(_Node(peer, handlers), "t", codec, NUMEL, AdaptiveDeadlines(5.0, 30.0))
                   for peer in PEERS]
        for server, client in zip(servers, clients):
            if not client:
                await server.start()
        group = Group.of(0, 0, PEERS, [0.5, 0.5, 0.0], 5.0, clients)
        vectors = [torch.randn(NUMEL, generator=torch.Generator().manual_seed(i)) for i in range(3)]
        results = await asyncio.gather(*(s.run(group, v, 1.0, exact_from=200_000) for s, v in zip(servers, vectors)))
        assert all(torch.equal(r.average, results[0].average) for r in results)
        assert not any(s.refused for s in servers), [s.refused for s in servers]
        streams = servers[0].expected_streams(group, NUMEL, exact_from=200_000)
        assert set(streams) == {("part", "peerB"), ("part", "peerC"), ("avg", "peerB")}, "clients reduce nothing"
        pulls = servers[2].expected_streams(group, NUMEL, exact_from=200_000)
        assert set(pulls) == {("pull", "peerA"), ("pull", "peerB")}, "a client pulls each reducer's part"
        # Our part is [0, 150_000) (the sparse codec's: whole chunks of 4096 elements, [0, 151_552)): all of it
        # before the lossless tail, so it travels under the run's codec, and its averages under its average codec.
        chunks = chunk_bounds(*partition(NUMEL, [0.5, 0.5, 0.0], get_codec(codec).alignment())[0])
        largest = max(b - a for a, b in chunks)
        assert streams[("part", "peerB")] == StreamBound(len(chunks), max_encoded_len(get_codec(codec), largest))
        averages = max_encoded_len(get_codec(codec).average_codec(3), largest)
        assert pulls[("pull", "peerA")] == StreamBound(len(chunks), averages), "averages encode as their chunks do"
        if codec != "none":
            assert streams[("part", "peerB")].payload < 0.6 * max_encoded_len(get_codec("none"), 65536)
        # peerB's part, [150_000, 300_000), ends in the lossless tail: its largest chunk is fp32.
        assert streams[("avg", "peerB")].payload >= 4 * 65536

    asyncio.run(scenario())


def test_a_non_member_is_refused_and_a_members_oversized_chunk_is_not_read():
    reports: list = []

    async def scenario():
        server = _server("int8", reports)
        await server.start()
        group = Group.of(0, 0, ("peerA", "peerB"), [0.5, 0.5], 5.0)
        running = asyncio.ensure_future(server.run(group, torch.randn(NUMEL), 1.0))
        await _until(lambda: (0, 0) in server._running)
        bound = server.expected_streams(group, NUMEL)[("part", "peerB")]
        # A non-member naming our group hears "conflict" before it can send a byte of payload.
        outsider = _Stream(server, "mallory").header(group_id=group.group_id, chunks=bound.chunks)
        assert await outsider.reply() == b"conflict" and server.refused["non_member"] == 1
        # A member announcing more chunks than its part has is closed unanswered.
        greedy = _Stream(server, "peerB").header(group_id=group.group_id, chunks=bound.chunks + 1)
        assert await greedy.reply() == b"" and server.refused["unexpected"] == 1
        # A member's chunk frame larger than its chunk can encode to: refused from its length alone (the payload
        # is never sent here, so a server that waited for it would hang), and counted as undecodable data.
        member = _Stream(server, "peerB").header(group_id=group.group_id, chunks=bound.chunks, weight=1.0)
        assert await member.reply() == b"ok"
        member.send(_frame(msgpack.packb({})) + FRAME_HEADER.pack(bound.payload + 1))
        await asyncio.wait_for(member.task, 2)
        assert server.refused["oversized"] == 1 and await member.reply() == b"", "no 'done' for a refused stream"
        for _ in range(100):
            if reports:
                break
            await asyncio.sleep(0.02)
        assert reports == [("peerB", "undecodable")], "its reducer leaves it out of the round"
        running.cancel()

    asyncio.run(scenario())


def test_a_client_members_pull_refuses_a_frame_larger_than_the_reducers_chunk():
    """A client member pulls a reducer's averaged chunks over a stream it opens: a frame announcing more than that
    part's chunk encodes to is refused from its length (it was fp32 of the whole model before)."""

    async def scenario():
        handlers: dict = {}
        group = Group.of(0, 0, ("peerA", "peerC"), [1.0, 0.0], 5.0, (False, True))
        client = GroupAllReduce(_Node("peerC", handlers), "t", "int8", NUMEL, AdaptiveDeadlines(5.0, 30.0))
        bound = client.expected_streams(group, NUMEL)[("pull", "peerA")]
        assert bound.payload < 0.3 * max_encoded_len(get_codec("none"), 65536), "sized to an int8 chunk"
        sizes = [bound.payload, bound.payload + 1]  # the reducer's frames: one as large as allowed, then one more

        async def reducer(remote, reader, writer) -> None:
            await recv_frame(reader, 1 << 16)
            writer.write(_frame(b"ok"))
            for size in sizes:
                writer.write(_frame(msgpack.packb({})) + FRAME_HEADER.pack(size) + b"\0" * min(size, bound.payload))

        handlers[("peerA", PROTOCOL)] = reducer
        client._groups[group.group_id] = Expected(group, client.expected_streams(group, NUMEL))
        slots = [asyncio.get_running_loop().create_future() for _ in sizes]
        with pytest.raises(OversizedChunk):
            await asyncio.wait_for(client.streams.pull("peerA", Header("pull", group.group_id, 0, 0),
                                                       lambda i: slots[i], len(sizes)), 2)
        assert len(slots[0].result()[1]) == bound.payload and not slots[1].done()
        with pytest.raises(ValueError):  # a member it pulls nothing from: nothing is read at all
            await client.streams.pull("peerB", Header("pull", group.group_id, 0, 0), lambda i: slots[i], 1)

    asyncio.run(scenario())


def test_streams_over_the_per_peer_cap_are_closed_at_once_and_silent_ones_at_the_header_deadline():
    async def scenario():
        server = _server()
        server.header_timeout = 0.3
        idle = [_Stream(server, "mallory") for _ in range(MAX_STREAMS_PER_PEER + 5)]
        await _until(lambda: server.refused["busy"] == 5)
        assert server.refused["busy"] == 5 and sum(s.task.done() for s in idle) == 5
        honest = _Stream(server, "peerB").header(group_id="g", chunks=0)  # another peer is still served
        await server.decide(0, 0, "g")
        assert await honest.reply() == b"ok"
        await asyncio.wait_for(asyncio.gather(*(s.task for s in idle)), 1.0)  # dropped at the header deadline
        assert server.refused["slow"] == MAX_STREAMS_PER_PEER and server._streams.count == 0
        # A sender dribbling its header a byte at a time is dropped at the same deadline.
        dribbler = _Stream(server, "mallory")
        for byte in _frame(msgpack.packb({"phase": "ping"}))[:6]:
            dribbler.send(bytes([byte]))
            await asyncio.sleep(0.1)
        await asyncio.wait_for(dribbler.task, 1.0)
        assert server.refused["slow"] == MAX_STREAMS_PER_PEER + 1

    asyncio.run(scenario())


def test_strangers_filling_the_total_cap_do_not_shut_out_a_member_of_our_group():
    async def scenario():
        server = _server()
        sybils = [_Stream(server, f"sybil{k}") for k in range(MAX_STREAMS // MAX_STREAMS_PER_PEER)
                  for _ in range(MAX_STREAMS_PER_PEER)]
        await _until(lambda: server._streams.count == len(sybils))
        assert not any(s.task.done() for s in sybils), "all served: the total cap is full"
        assert await _Stream(server, "peerC").reply() == b"" and server.refused["busy"] == 1
        group = Group.of(0, 0, ("peerA", "peerB"), [0.5, 0.5], 5.0)
        running = asyncio.ensure_future(server.run(group, torch.randn(NUMEL), 1.0))
        await _until(lambda: (0, 0) in server._running)
        commit = _Stream(server, "peerB").header(group_id=group.group_id, phase="commit")
        assert await commit.reply() == b"ok", "a member of our group is served over the total cap"
        assert server.refused["busy"] == 1
        running.cancel()
        for stream in sybils:
            stream.task.cancel()

    asyncio.run(scenario())


def test_early_streams_wait_for_our_matchmaking_within_a_small_bound():
    """A member that found the group before us starts streaming at once: such streams wait for our decision, but
    only MAX_EARLY_PER_PEER per peer; the rest are closed unanswered (the sender retries a moment later)."""

    async def scenario():
        server = _server()
        early = [_Stream(server, "peerB").header(group_id="g", round=7) for _ in range(MAX_EARLY_PER_PEER + 3)]
        await _until(lambda: server.refused["early"] == 3)
        assert server.refused["early"] == 3 and sum(s.task.done() for s in early) == 3
        await server.decide(7, 0, "g")
        replies = [await s.reply() for s in early]
        assert replies.count(b"ok") == MAX_EARLY_PER_PEER and replies.count(b"") == 3
        # Keys already decided are answered at once, however many streams ask.
        later = [_Stream(server, "peerB").header(group_id="other", round=7) for _ in range(MAX_EARLY_PER_PEER + 3)]
        assert [await s.reply() for s in later] == [b"conflict"] * (MAX_EARLY_PER_PEER + 3)

    asyncio.run(scenario())


def test_stream_gate_caps_per_peer_and_in_all():
    gate = StreamGate(per_peer=2, total=3)
    assert gate.admit("a") and gate.admit("a") and not gate.admit("a")
    assert gate.admit("b") and not gate.admit("c"), "the total cap holds for a peer with no stream yet"
    gate.release("a")
    assert gate.admit("c") and gate.count == 3 and gate.serving == {"a": 1, "b": 1, "c": 1}
    assert not gate.admit("d") and gate.admit("d", over_total=True)
    assert gate.admit("d", over_total=True) and not gate.admit("d", over_total=True), "the per-peer cap still holds"
