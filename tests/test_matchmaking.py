"""Group formation (`form_group`) in one process: several peers' coroutines share an in-memory DHT that keeps
signed-looking entries as the real one does (under each writer's owned subkey, whose public key gives its peer
id), so what is tested is the waiting and the decisions, with real identities and the real entry checks."""

from __future__ import annotations

import asyncio
import time

from hivemind.utils.crypto import RSAPrivateKey

from swarm.averaging.group_push import leader_of
from swarm.averaging.matchmaking import Candidate, form_group, group_terms
from swarm.dht.records import final_key, group_key
from swarm.dht.validation import Identity

TIMEOUT = 20.0  # matchmaking timeout: far longer than any of these tests may take when it works


class Board:
    """The DHT as form_group sees it: key -> {subkey: value}."""

    def __init__(self) -> None:
        self.entries: dict[str, dict[str, object]] = {}


class FakeNode:
    def __init__(self, board: Board) -> None:
        identity = Identity(RSAPrivateKey(), path="", ephemeral=False)
        self.board, self.peer_id, self.owned_subkey = board, identity.peer_id, identity.owned_subkey

    async def store(self, key: str, value: object, ttl: float, subkey: str | None = None) -> bool:
        self.board.entries.setdefault(key, {})[subkey or ""] = value
        return True

    async def get(self, key: str) -> dict[str, object]:
        return dict(self.board.entries.get(key, {}))


def _match(node: FakeNode, expected: set[str], still_in=None):
    """Round 1, attempt 0, groups of 2 to 4."""
    return form_group(node, "run", 1, 0, Candidate("digest", 1.0, client=False), expected, 2, 4, TIMEOUT,
                      still_in=still_in)


def test_peers_of_the_round_form_one_group_without_waiting_out_the_deadline():
    board = Board()
    nodes = [FakeNode(board) for _ in range(3)]
    ids = {n.peer_id for n in nodes}

    async def main():
        return await asyncio.gather(*(_match(n, ids - {n.peer_id}) for n in nodes))

    started = time.monotonic()
    results = asyncio.run(main())
    assert time.monotonic() - started < TIMEOUT / 2
    assert all(group is not None and set(group.members) == ids and seen == 2 for group, seen in results)
    assert len({group.group_id for group, _ in results}) == 1


def test_a_peer_that_left_the_round_is_no_longer_waited_for():
    """Two peers wait for a third that, as its announcements then show, averaged this round elsewhere: they form
    their group as soon as the announcements say so, not at the matchmaking deadline."""
    board = Board()
    a, b, gone = (FakeNode(board) for _ in range(3))
    left_at = time.monotonic() + 1.0

    def still_in():
        return {a.peer_id, b.peer_id} | ({gone.peer_id} if time.monotonic() < left_at else set())

    async def main():
        return await asyncio.gather(_match(a, {b.peer_id, gone.peer_id}, still_in),
                                    _match(b, {a.peer_id, gone.peer_id}, still_in))

    results = asyncio.run(main())
    assert time.monotonic() - left_at < TIMEOUT / 2, "they waited for the peer that had left"
    assert all(group is not None and set(group.members) == {a.peer_id, b.peer_id} for group, _ in results)


def test_a_peer_left_alone_gives_up_once_the_swarm_moved_on():
    """The partner of a peer that died mid-round retries the round; the other group finishes it meanwhile and its
    announcements show the next round: the partner stops waiting (so it can re-sync) instead of waiting out the
    deadline, and reports that it saw others (a failed round, not a lonely one)."""
    board = Board()
    me, other = FakeNode(board), FakeNode(board)
    moved_at = time.monotonic() + 1.0

    def still_in():
        return {other.peer_id} if time.monotonic() < moved_at else None

    async def main():
        return await _match(me, {other.peer_id}, still_in)

    group, seen = asyncio.run(main())
    assert time.monotonic() - moved_at < TIMEOUT / 2, "it waited out the matchmaking deadline"
    assert group is None and seen >= 1


def test_a_missing_peer_still_in_the_round_is_waited_for():
    """The contrast: while the announcements still show the expected peer in the round, we wait for it."""
    board = Board()
    a, b, late = (FakeNode(board) for _ in range(3))
    ids = {a.peer_id, b.peer_id, late.peer_id}

    async def main():
        waiting = [asyncio.ensure_future(_match(n, ids - {n.peer_id}, lambda: ids)) for n in (a, b)]
        await asyncio.sleep(2.0)
        assert not any(w.done() for w in waiting), "they formed a group without a peer still in the round"
        results = await asyncio.gather(_match(late, ids - {late.peer_id}, lambda: ids), *waiting)
        return results

    results = asyncio.run(main())
    assert all(group is not None and set(group.members) == ids for group, _ in results)


def test_a_leader_s_group_is_followed_only_with_the_terms_its_members_entries_give():
    """A leader publishes its group with itself reducing everything (the honest shares come from the members'
    bandwidths): its members do not average with it, and learn so before the deadline. The same group with the
    shares, deadline and mix the entries give is followed (the other tests)."""
    board = Board()
    nodes = [FakeNode(board) for _ in range(3)]
    ids = sorted(n.peer_id for n in nodes)
    leader = next(n for n in nodes if n.peer_id == leader_of(ids, 1, 0))
    honest = [n for n in nodes if n is not leader]

    async def main():
        entry = {"digest": "digest", "bandwidth": 1.0, "client": False, "excluded": [], "phase_timeout": None}
        await leader.store(group_key("run", 1, 0), entry, ttl=60, subkey=leader.owned_subkey)
        greedy = {"members": ids, "shares": [1.0 if m == leader.peer_id else 0.0 for m in ids],
                  "clients": [False] * 3, "phase_timeout": None, "mix": False, "swarm_size": 3}
        await leader.store(final_key("run", 1, 0), greedy, ttl=60, subkey=leader.owned_subkey)
        return await asyncio.gather(*(_match(n, set(ids) - {n.peer_id}) for n in honest))

    started = time.monotonic()
    results = asyncio.run(main())
    assert all(group is None for group, _ in results), results
    assert time.monotonic() - started < TIMEOUT / 2, "they waited out the deadline"
    fair = group_terms(ids, {m: Candidate("digest", 1.0, False) for m in ids})
    assert max(fair["shares"]) < 0.5 and not fair["mix"], "what the leader should have published"
