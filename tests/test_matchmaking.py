"""Group formation (`form_group`) in one process: several peers' coroutines share an in-memory DHT that keeps
signed-looking entries as the real one does (under each writer's owned subkey, whose public key gives its peer
id), so what is tested is the waiting and the decisions, with real identities and the real entry checks."""

from __future__ import annotations

import asyncio
import time

import pytest

from hivemind.utils.crypto import RSAPrivateKey

from swarm.averaging.group_push import leader_of
from swarm.averaging.partition import optimal_shares
from swarm.averaging.matchmaking import BANDWIDTH_SPREAD, Candidate, form_group, group_terms, parse_candidate
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


DIGEST = "d" * 16  # a state digest: 16 hex characters (an entry with anything else is malformed)


def _match(node: FakeNode, expected: set[str], still_in=None):
    """Round 1, attempt 0, groups of 2 to 4."""
    return form_group(node, "run", 1, 0, Candidate(DIGEST, 1.0, client=False, weight=1.0), expected, 2, 4, TIMEOUT,
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


def _three_and_their_leader() -> tuple[list[str], FakeNode, list[FakeNode]]:
    """Three nodes on one board: their sorted ids, the leader of round 1 attempt 0 among them, and the other two."""
    board = Board()
    nodes = [FakeNode(board) for _ in range(3)]
    ids = sorted(n.peer_id for n in nodes)
    leader = next(n for n in nodes if n.peer_id == leader_of(ids, 1, 0))
    return ids, leader, [n for n in nodes if n is not leader]


def test_a_leader_s_group_is_followed_only_with_the_terms_its_members_entries_give():
    """A leader publishes its group with itself reducing everything (the honest shares come from the members'
    bandwidths): its members do not average with it, and learn so before the deadline. The same group with the
    shares, deadline and mix the entries give is followed (the other tests)."""
    ids, leader, honest = _three_and_their_leader()

    async def main():
        entry = {"digest": DIGEST, "bandwidth": 1.0, "client": False, "excluded": [], "phase_timeout": None,
                 "weight": 1.0, "commitment": ""}
        await leader.store(group_key("run", 1, 0), entry, ttl=60, subkey=leader.owned_subkey)
        greedy = {"members": ids, "shares": [1.0 if m == leader.peer_id else 0.0 for m in ids],
                  "clients": [False] * 3, "phase_timeout": None, "mix": False, "swarm_size": 3,
                  "weights": [1.0] * 3, "commitments": []}
        await leader.store(final_key("run", 1, 0), greedy, ttl=60, subkey=leader.owned_subkey)
        return await asyncio.gather(*(_match(n, set(ids) - {n.peer_id}) for n in honest))

    started = time.monotonic()
    results = asyncio.run(main())
    assert all(group is None for group, _ in results), results
    assert time.monotonic() - started < TIMEOUT / 2, "they waited out the deadline"
    fair = group_terms(ids, {m: Candidate(DIGEST, 1.0, False, weight=1.0) for m in ids})
    assert max(fair["shares"]) < 0.5 and not fair["mix"], "what the leader should have published"


# ---- the entry's schema: no field can be left out ------------------------------------------------------------
COMMITMENT = "c" * 32
ENTRY = {"digest": DIGEST, "bandwidth": 1e6, "client": False, "excluded": [], "phase_timeout": None, "weight": 8192.0,
         "commitment": COMMITMENT}


@pytest.mark.parametrize("field", sorted(ENTRY))
def test_an_entry_without_any_one_field_is_malformed(field):
    """A missing field is malformed, never a default: an entry without its weight or nonce commitment used to be
    accepted, and the group it joined then carried no weights and no commitments, so nobody's reducer was checked."""
    assert parse_candidate(ENTRY, verified=True) is not None
    assert parse_candidate({k: v for k, v in ENTRY.items() if k != field}, verified=True) is None


@pytest.mark.parametrize("field, value", [
    ("digest", "not-a-digest"), ("digest", 7), ("bandwidth", -1.0), ("bandwidth", float("nan")), ("bandwidth", True),
    ("bandwidth", 1e15), ("client", 1), ("excluded", "peer"), ("excluded", [3]), ("excluded", ["p"] * 1025),
    ("phase_timeout", 0.0), ("phase_timeout", float("inf")), ("weight", None), ("weight", -1.0), ("weight", 1e18),
    ("weight", float("nan")), ("commitment", ""), ("commitment", "C" * 32), ("commitment", "c" * 64)])
def test_an_entry_with_a_field_of_the_wrong_type_or_out_of_bounds_is_malformed(field, value):
    assert parse_candidate({**ENTRY, field: value}, verified=True) is None


def test_a_commitment_is_required_exactly_where_the_run_checks_its_reducers():
    assert parse_candidate({**ENTRY, "commitment": ""}, verified=False) is not None
    assert parse_candidate(ENTRY, verified=False) is None, "a commitment in a run that checks nothing is not ours"


def _match_verified(node: FakeNode, expected: set[str], commitment: str = COMMITMENT):
    return form_group(node, "run", 1, 0, Candidate(DIGEST, 1e6, False, weight=8192.0, commitment=commitment),
                      expected, 2, 4, TIMEOUT, verified=True)


def test_in_a_verified_run_an_entry_without_a_commitment_joins_no_group():
    """Three peers of a run that checks its reducers form a group carrying all three commitments; a fourth whose
    entry has none (or whose code left it out) is no candidate, and the others do not wait for it."""
    board = Board()
    nodes = [FakeNode(board) for _ in range(4)]
    honest, silent = nodes[:3], nodes[3]
    ids = {n.peer_id for n in honest}

    async def main():
        silent_entry = {**ENTRY, "commitment": ""}
        await silent.store(group_key("run", 1, 0), silent_entry, ttl=60, subkey=silent.owned_subkey)
        return await asyncio.gather(*(_match_verified(n, ids - {n.peer_id}) for n in honest))

    results = asyncio.run(main())
    for group, _ in results:
        assert group is not None and set(group.members) == ids, group
        assert group.commitments == (COMMITMENT,) * 3 and len(group.weights) == 3


def test_a_leader_counting_more_candidates_than_the_entries_hold_is_not_followed():
    """The swarm size the leader publishes sets how many tokens each member adds to its schedule (x swarm size /
    group size) and the quorum its reference needs: a leader claiming 2^20 made every member's inner learning rate
    sit at its floor for the rest of the run. Members check it against the entries they read."""
    ids, leader, honest = _three_and_their_leader()

    async def main():
        entry = {**ENTRY, "commitment": "", "bandwidth": 1.0, "weight": 1.0}  # (its terms honest: only the count lies)
        await leader.store(group_key("run", 1, 0), entry, ttl=60, subkey=leader.owned_subkey)
        inflated = {"members": ids, **group_terms(ids, {m: Candidate(DIGEST, 1.0, False, weight=1.0) for m in ids}),
                    "swarm_size": 1 << 20}
        await leader.store(final_key("run", 1, 0), inflated, ttl=60, subkey=leader.owned_subkey)
        return await asyncio.gather(*(_match(n, set(ids) - {n.peer_id}) for n in honest))

    results = asyncio.run(main())
    assert all(group is None for group, _ in results), results


def test_a_declared_link_counts_as_at_most_a_bounded_multiple_of_the_median():
    """Shares follow the members' measured bandwidths, but each counts as at most BANDWIDTH_SPREAD times their lower
    median: an absurd declared link weighs no more than one that much faster (whose reducer, in a verified run, is
    checked like any other; the optimum gives a much faster member most of the vector, as it does an honest one)."""
    ids = ["a", "b", "c", "d"]
    honest = {m: Candidate(DIGEST, 1e6, False, weight=1.0) for m in ids}
    spread = {"a": 25e5, "b": 50e5, "c": 100e5, "d": 200e5}  # mixed 25-200 Mbit/s links: not cut
    shares = group_terms(ids, {m: Candidate(DIGEST, b, False, weight=1.0) for m, b in spread.items()})["shares"]
    assert shares == pytest.approx(optimal_shares(list(spread.values()), [True] * 4), abs=1e-12)
    liar = group_terms(ids, {**honest, "d": Candidate(DIGEST, 1e11, False, weight=1.0)})["shares"]
    capped = group_terms(ids, {**honest, "d": Candidate(DIGEST, BANDWIDTH_SPREAD * 1e6, False, weight=1.0)})["shares"]
    assert liar == capped


def test_a_stranger_declaring_a_state_of_its_own_forces_no_mixing():
    """Issue 37, class 3: one entry with a foreign state digest made a group of four mix params and momentum, and
    every honest member applied the stranger's state. Now a digest that no other candidate declares is no lineage:
    the honest members form their group without it and mix nothing; and when the stranger leads, the group it
    publishes with itself in is not followed."""
    board = Board()
    nodes = [FakeNode(board) for _ in range(4)]
    ids = sorted(n.peer_id for n in nodes)
    stranger = next(n for n in nodes if n.peer_id == leader_of(ids, 1, 0))  # it leads the four, if they form
    honest = [n for n in nodes if n is not stranger]
    honest_ids = {n.peer_id for n in honest}

    async def main():
        entry = {**ENTRY, "commitment": "", "bandwidth": 1.0, "weight": 1.0, "digest": "f" * 16}
        await stranger.store(group_key("run", 1, 0), entry, ttl=60, subkey=stranger.owned_subkey)
        everyone = {m: Candidate(DIGEST if m in honest_ids else "f" * 16, 1.0, False, weight=1.0) for m in ids}
        mixing = {"members": ids, **group_terms(ids, everyone), "swarm_size": 4}
        assert mixing["mix"]
        await stranger.store(final_key("run", 1, 0), mixing, ttl=60, subkey=stranger.owned_subkey)
        return await asyncio.gather(*(_match(n, set(ids) - {n.peer_id}) for n in honest))

    for group, _ in asyncio.run(main()):
        assert group is not None and set(group.members) == honest_ids and not group.mix, group


def test_peers_all_in_client_mode_wait_the_window_for_one_that_accepts_connections_and_average_through_it():
    """Behind NAT nobody can reduce for anybody: peers all in client mode wait out the matchmaking window for a peer
    that accepts connections and then give the attempt up with no group (the old code formed a group of clients,
    whose leader could publish nothing, then retried forever); one that comes within the window joins them, the
    group forms before the deadline, and that peer reduces the whole vector."""
    board = Board()
    nodes = [FakeNode(board) for _ in range(3)]
    ids = {n.peer_id for n in nodes}
    server = sorted(ids)[1]

    def match(node, attempt: int, timeout: float, expected: set[str] = ids):
        return form_group(node, "run", 1, attempt, Candidate(DIGEST, 1.0, client=node.peer_id != server,
                                                             weight=1.0), expected - {node.peer_id}, 2, 4, timeout)

    async def clients_alone():  # (expecting only each other: all there at once, and still no group)
        return await asyncio.gather(*(match(n, 0, 2.0, ids - {server}) for n in nodes if n.peer_id != server))

    started = time.monotonic()
    results = asyncio.run(clients_alone())
    assert 2.0 <= time.monotonic() - started < TIMEOUT / 2
    assert all(group is None and seen == 1 for group, seen in results), results

    async def server_comes_late():
        async def late(node):  # (a newcomer: the clients do not expect it)
            await asyncio.sleep(1.0)
            return await match(node, 1, TIMEOUT)
        return await asyncio.gather(*(match(n, 1, TIMEOUT, ids - {server}) if n.peer_id != server else late(n)
                                      for n in nodes))

    started = time.monotonic()
    results = asyncio.run(server_comes_late())
    assert time.monotonic() - started < TIMEOUT / 2
    assert all(group is not None and set(group.members) == ids for group, _ in results), results
    group = results[0][0]
    assert [share > 0 for share in group.shares] == [peer == server for peer in group.members]
    assert list(group.clients) == [peer != server for peer in group.members]


def test_a_run_of_checked_groups_forms_none_with_a_lone_server_among_clients_and_one_with_two():
    """averaging.checked_groups (min_servers 2): clients receive no reports, so a lone server among them would reduce
    every part with nobody to check it. Three peers of which one accepts connections wait out the window and form
    no group (the old rule, min_servers 1, formed one); with a second server, four form one group before the
    deadline and only the two servers reduce."""
    board = Board()
    nodes = [FakeNode(board) for _ in range(4)]
    ids = sorted(n.peer_id for n in nodes)
    servers = set(ids[1:3])

    def match(node, attempt: int, timeout: float, expected: set[str], least: int):
        return form_group(node, "run", 1, attempt, Candidate(DIGEST, 1.0, client=node.peer_id not in servers,
                                                             weight=1.0), expected - {node.peer_id}, 3, 4, timeout,
                          min_servers=least)

    three = [n for n in nodes if n.peer_id != ids[2]]  # (one server, two clients)

    async def lone_server(least: int, attempt: int):
        return await asyncio.gather(*(match(n, attempt, 2.0, {m.peer_id for m in three}, least) for n in three))

    started = time.monotonic()
    assert all(group is None for group, _ in asyncio.run(lone_server(2, 0)))
    assert 2.0 <= time.monotonic() - started < TIMEOUT / 2
    assert all(group is not None for group, _ in asyncio.run(lone_server(1, 1))), "(the rule it replaces)"

    async def two_servers():
        return await asyncio.gather(*(match(n, 2, TIMEOUT, set(ids), 2) for n in nodes))

    started = time.monotonic()
    results = asyncio.run(two_servers())
    assert time.monotonic() - started < TIMEOUT / 2
    assert all(group is not None and list(group.members) == ids for group, _ in results), results
    group = results[0][0]
    assert [share > 0 for share in group.shares] == [peer in servers for peer in group.members]


def test_a_peer_that_never_came_is_waited_for_only_as_long_as_its_patience_and_reported_missed():
    """A peer announced in the round that writes no entry (a liar whose heartbeat says it trains, or one stuck)
    kept every attempt waiting the whole window. With a patience of 1 s for it (Averager halves it each matchmaking
    it misses), the others form their group after about 1 s, and report it missed; the peers that came are
    reported as come."""
    board = Board()
    nodes = [FakeNode(board) for _ in range(3)]
    ghost = FakeNode(board).peer_id  # (never writes an entry)
    ids = {n.peer_id for n in nodes}
    attendances = [{} for _ in nodes]

    async def main():
        return await asyncio.gather(*(
            form_group(n, "run", 1, 0, Candidate(DIGEST, 1.0, client=False, weight=1.0), ids | {ghost} - {n.peer_id},
                       2, 4, TIMEOUT, patience={ghost: 1.0}, attendance=attendance)
            for n, attendance in zip(nodes, attendances)))

    started = time.monotonic()
    results = asyncio.run(main())
    assert 1.0 <= time.monotonic() - started < TIMEOUT / 4
    assert all(group is not None and set(group.members) == ids for group, _ in results), results
    for n, attendance in zip(nodes, attendances):
        assert attendance == {"came": ids - {n.peer_id}, "missed": {ghost}}, attendance
