"""A leader pushes the group it publishes straight to its members (GroupPush), between real nodes on 127.0.0.1:
a member holds it at once, checked as a DHT entry is, and a push of a group the sender may not publish is
dropped."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import msgpack
import pytest

from swarm.averaging.group_push import GroupPush, leader_of
from swarm.dht.frames import FRAME_HEADER
from swarm.dht.node import NetworkOptions, SwarmNode
from swarm.runtime import LoopThread
from conftest import dribble


@pytest.fixture(scope="module")
def pair():
    loop = LoopThread()
    first = SwarmNode([], NetworkOptions())
    second = SwarmNode(first.visible_maddrs(), NetworkOptions())
    pushes = {node.peer_id: GroupPush(node, "push-test") for node in (first, second)}
    for push in pushes.values():
        loop.run(push.start(), timeout=30)
    yield loop, (first, second), pushes
    for node in (first, second):
        node.shutdown()
    loop.close()


def _final(members: list[str]) -> dict:
    return {"members": members, "shares": [0.5, 0.5], "clients": [False, False], "phase_timeout": None,
            "mix": False, "swarm_size": 2, "weights": [1.0, 1.0], "commitments": []}


def _roles(nodes, pushes, round_no: int, attempt: int):
    """(members, leader id, the leader's push, the member's push) of this round and attempt (leader_of)."""
    members = sorted(node.peer_id for node in nodes)
    leader = leader_of(members, round_no, attempt)
    member = next(peer for peer in members if peer != leader)
    return members, leader, pushes[leader], pushes[member]


def test_a_pushed_group_reaches_the_member_at_once(pair):
    loop, nodes, pushes = pair
    members, leader, leader_push, member_push = _roles(nodes, pushes, 7, 0)

    async def scenario() -> float:
        started = time.monotonic()
        waiting = asyncio.ensure_future(member_push.wait(7, 0, 20.0))
        leader_push.send(members, 7, 0, _final(members))
        await waiting
        return time.monotonic() - started

    waited = loop.run(scenario(), timeout=30)
    assert waited < 10, "a push ends the member's wait (the timeout was 20 s)"
    assert member_push.finals(7, 0, set()) == {leader: (members, [0.5, 0.5], None, [False, False], False, 2, [1.0, 1.0], [])}
    assert member_push.finals(7, 0, {leader}) == {}, "an excluded leader's group is not taken"
    assert member_push.finals(7, 1, set()) == {}, "another attempt's group is another key"


def test_a_push_of_a_group_the_sender_may_not_publish_is_dropped(pair):
    loop, nodes, pushes = pair

    async def push(pusher: GroupPush, members: list[str], key: tuple[int, int], final: dict) -> None:
        pusher.send(members, *key, final)  # (in the loop: send pushes in background tasks)
        # Until the receiver answered or dropped the stream: it has judged the push by then.
        await asyncio.wait(set(pusher._background), timeout=30)

    # The member pushes a group whose leader (leader_of) is the other peer: it may not publish that.
    members, leader, leader_push, member_push = _roles(nodes, pushes, 8, 0)
    loop.run(push(member_push, members, (8, 0), _final(members)), timeout=40)
    assert leader_push.finals(8, 0, set()) == {}
    members, leader, leader_push, member_push = _roles(nodes, pushes, 9, 0)
    loop.run(push(leader_push, members, (9, 0), {**_final(members), "shares": [0.9, 0.9]}), timeout=40)  # no sum 1
    assert member_push.finals(9, 0, set()) == {}
    # ...while a good push the same way arrives (so the two above failed for what they said).
    members, leader, leader_push, member_push = _roles(nodes, pushes, 9, 1)
    loop.run(push(leader_push, members, (9, 1), _final(members)), timeout=40)
    assert leader in member_push.finals(9, 1, set())


def test_a_push_that_does_not_arrive_whole_in_time_is_dropped_at_its_deadline():
    """A sender that opens a push stream and sends nothing, or dribbles its frame, holds a handler slot no longer
    than the push deadline; a whole push is still answered."""

    async def scenario() -> None:
        push = GroupPush(SimpleNamespace(peer_id="me"), "t")
        push.push_timeout = 0.3
        silent = asyncio.ensure_future(push._on_stream("mallory", asyncio.StreamReader(), _Sink()))
        dribbled = asyncio.StreamReader()
        dribbling = asyncio.ensure_future(push._on_stream("mallory", dribbled, _Sink()))
        frame = msgpack.packb({"round": 1, "attempt": 0, "final": {}})
        await dribble(dribbled, FRAME_HEADER.pack(len(frame)) + frame, until=dribbling)
        await asyncio.wait_for(asyncio.gather(silent, dribbling), 2)
        assert push.dropped == 2
        members = ["leader", "other"]
        leader = leader_of(members, 1, 0)
        whole, answer = asyncio.StreamReader(), _Sink()
        frame = msgpack.packb({"round": 1, "attempt": 0, "final": _final(members)})
        whole.feed_data(FRAME_HEADER.pack(len(frame)) + frame)
        await asyncio.wait_for(push._on_stream(leader, whole, answer), 2)
        assert answer.data.endswith(b"ok") and leader in push.finals(1, 0, set()) and push.dropped == 2

    asyncio.run(scenario())


class _Sink:
    """The handler's end of an in-memory stream: keeps what it writes."""

    def __init__(self):
        self.data = b""

    def write(self, data: bytes) -> None:
        self.data += bytes(data)

    async def drain(self) -> None:
        pass
