"""A leader pushes the group it publishes straight to its members (GroupPush), between real nodes on 127.0.0.1:
a member holds it at once, checked as a DHT entry is, and a push of a group the sender may not publish is
dropped."""

from __future__ import annotations

import asyncio
import time

import pytest

from swarm.averaging.matchmaking import GroupPush
from swarm.dht.node import NetworkOptions, SwarmNode
from swarm.runtime import LoopThread


@pytest.fixture(scope="module")
def pair():
    loop = LoopThread()
    first = SwarmNode([], NetworkOptions())
    second = SwarmNode(first.visible_maddrs(), NetworkOptions())
    leader, member = sorted([first, second], key=lambda node: node.peer_id)  # the leader is the smallest id
    pushes = [GroupPush(node, "push-test") for node in (leader, member)]
    for push in pushes:
        loop.run(push.start(), timeout=30)
    yield loop, leader, member, pushes
    for node in (first, second):
        node.shutdown()
    loop.close()


def _final(members: list[str]) -> dict:
    return {"members": members, "shares": [0.5, 0.5], "clients": [False, False], "phase_timeout": None,
            "mix": False, "swarm_size": 2}


def test_a_pushed_group_reaches_the_member_at_once(pair):
    loop, leader, member, (leader_push, member_push) = pair
    members = [leader.peer_id, member.peer_id]

    async def scenario() -> float:
        started = time.monotonic()
        waiting = asyncio.ensure_future(member_push.wait(7, 0, 20.0))
        leader_push.send(members, 7, 0, _final(members))
        await waiting
        return time.monotonic() - started

    waited = loop.run(scenario(), timeout=30)
    assert waited < 10, "a push ends the member's wait (the timeout was 20 s)"
    assert member_push.finals(7, 0, set()) == {leader.peer_id: (members, [0.5, 0.5], None, [False, False], False, 2)}
    assert member_push.finals(7, 0, {leader.peer_id}) == {}, "an excluded leader's group is not taken"
    assert member_push.finals(7, 1, set()) == {}, "another attempt's group is another key"


def test_a_push_of_a_group_the_sender_may_not_publish_is_dropped(pair):
    loop, leader, member, (leader_push, member_push) = pair
    # The member pushes a group whose smallest id (its leader) is the other peer: it may not publish that.
    members = [leader.peer_id, member.peer_id]

    async def push(pusher: GroupPush, key: tuple[int, int], final: dict) -> None:
        pusher.send(members, *key, final)  # (in the loop: send pushes in background tasks)
        # Until the receiver answered or dropped the stream: it has judged the push by then.
        await asyncio.wait(set(pusher._background), timeout=30)

    loop.run(push(member_push, (8, 0), _final(members)), timeout=40)
    loop.run(push(leader_push, (9, 0), {**_final(members), "shares": [0.9, 0.9]}), timeout=40)  # no distribution
    assert leader_push.finals(8, 0, set()) == {}
    assert member_push.finals(9, 0, set()) == {}
    # ...while a good push the same way arrives (so the two above failed for what they said).
    loop.run(push(leader_push, (9, 1), _final(members)), timeout=40)
    assert leader.peer_id in member_push.finals(9, 1, set())
