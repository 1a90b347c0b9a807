"""The matchmaking faults of scripts/attack_bench.py's scenarios, in one process: each rewrites what its peer writes
(faults.FaultPlan.tamper, FaultPlan.accusations), says so in a `fault` event, and the honest peers' matchmaking
(form_group over an in-memory DHT, real identities, the real entry checks) leaves the liar out or refuses its
group. The bench runs the same faults in real swarms."""

from __future__ import annotations

import asyncio

import pytest
from hivemind.utils.crypto import RSAPrivateKey

from swarm.averaging.faults import LIED_SWARM_SIZE, TAMPERING, FaultPlan
from swarm.averaging.group_push import leader_of
from swarm.averaging.grouping import Candidate, attempt_salt, settled
from swarm.averaging.matchmaking import MAX_BANDWIDTH, form_group, parse_candidate
from swarm.dht.records import final_key, group_key
from swarm.dht.validation import Identity

pytestmark = pytest.mark.timeout(60)
TIMEOUT = 5.0  # matchmaking timeout; a group that forms does so at once
DIGEST, COMMITMENT = "d" * 16, "c" * 32


class Events:
    def __init__(self) -> None:
        self.emitted: list[dict] = []

    def emit(self, event: str, **fields) -> None:
        self.emitted.append({"event": event, **fields})


class FakeNode:
    """One peer's view of an in-memory DHT shared by all (key -> {owned subkey: value})."""

    def __init__(self, board: dict) -> None:
        identity = Identity(RSAPrivateKey(), path="", ephemeral=False)
        self.board, self.peer_id, self.owned_subkey = board, identity.peer_id, identity.owned_subkey

    async def store(self, key: str, value: object, ttl: float, subkey: str | None = None) -> bool:
        self.board.setdefault(key, {})[subkey or ""] = value
        return True

    async def get(self, key: str) -> dict:
        return dict(self.board.get(key, {}))


def _match(node: FakeNode, ids: set[str], tamper=None):
    """Round 1, attempt 0 of a run that checks its reducers, in groups of 2 to 4."""
    return form_group(node, "run", 1, 0, Candidate(DIGEST, 1e6, False, weight=8192.0, commitment=COMMITMENT),
                      ids - {node.peer_id}, 2, 4, TIMEOUT, verified=True, tamper=tamper)


def _swarm_with_liar(kind: str, leading: bool = False):
    """Three honest peers and one with `kind`, which is the leader of all four in round 1, attempt 0 if `leading`
    and not otherwise: their matchmaking results, the liar's events and the board."""
    board: dict = {}
    nodes = [FakeNode(board) for _ in range(4)]
    ids = {n.peer_id for n in nodes}
    liar = next(n for n in nodes if (n.peer_id == leader_of(ids, 1, 0)) == leading)
    events = Events()
    plan = FaultPlan(f"{kind}@0", events)

    async def main():
        return await asyncio.gather(*(_match(n, ids, plan.tamper if n is liar else None) for n in nodes))

    results = dict(zip((n.peer_id for n in nodes), asyncio.run(main())))
    return liar.peer_id, ids - {liar.peer_id}, results, events.emitted, board


def test_every_tampering_kind_parses_and_only_they_tamper():
    for kind in TAMPERING + ("accuse-one",):
        assert FaultPlan(f"{kind}@3").phase == kind
    with pytest.raises(ValueError):
        FaultPlan("tamper-everything@0")
    entry = {"digest": DIGEST, "bandwidth": 1e6}
    assert FaultPlan("scaled@0").tamper("entry", entry, 5, 0) is entry
    assert FaultPlan("unverified-entry@6").tamper("entry", entry, 5, 0) is entry, "not before its round"


def test_an_entry_without_a_commitment_declaring_the_largest_link_is_no_candidate():
    liar, honest, results, events, board = _swarm_with_liar("unverified-entry")
    written = next(v for v in board[group_key("run", 1, 0)].values() if "commitment" not in v)
    assert written["bandwidth"] == MAX_BANDWIDTH and parse_candidate(written, verified=True) is None
    for peer in honest:
        group, _ = results[peer]
        assert group is not None and set(group.members) == honest, "the honest peers average without it"
    assert any(e["event"] == "fault" and e["kind"] == "unverified-entry" and e["phase"] == "entry" for e in events)


def test_an_unverified_entrant_that_would_lead_costs_the_honest_peers_no_attempt():
    liar, honest, results, events, board = _swarm_with_liar("unverified-entry", leading=True)
    for peer in honest:
        group, _ = results[peer]
        assert group is not None and set(group.members) == honest


@pytest.mark.parametrize("leading", [False, True])
def test_a_digest_no_other_candidate_declares_is_mixed_into_no_group(leading):
    liar, honest, results, events, board = _swarm_with_liar("foreign-digest", leading)
    digests = {v["digest"] for v in board[group_key("run", 1, 0)].values()}
    assert len(digests) == 2, "the liar declared a digest of its own"
    for peer in honest:
        group, _ = results[peer]
        assert group is not None and set(group.members) == honest and not group.mix
    # (the liar's own view may hold a group of four, which it leads: nobody else follows it)
    assert any(e["event"] == "fault" and e["kind"] == "foreign-digest" for e in events)


def test_a_leader_that_publishes_an_inflated_swarm_size_is_not_followed():
    liar, honest, results, events, board = _swarm_with_liar("inflated-swarm-size", leading=True)
    finals = list(board[final_key("run", 1, 0)].values())
    assert [f["swarm_size"] for f in finals] == [LIED_SWARM_SIZE]
    assert all(results[peer][0] is None for peer in honest), "no member averages under its count"
    assert any(e["event"] == "fault" and e["phase"] == "final" for e in events)


def test_one_accusation_without_evidence_costs_its_writer_the_attempt_not_the_peer_it_names():
    events = Events()
    others = {f"peer-{i}" for i in range(3)}
    accused = FaultPlan("accuse-one@0", events).accusations(set(), others, 2)
    assert accused == {"peer-0"} and events.emitted[0]["accused"] == ["peer-0"]
    candidates = {peer: Candidate(DIGEST, 1.0, False, weight=1.0) for peer in others}
    candidates["accuser"] = Candidate(DIGEST, 1.0, False, excluded=("peer-0",), weight=1.0)
    left_out = [sorted(set(candidates) - set(settled(candidates, attempt_salt(2, a)))) for a in range(200)]
    assert all(out == ["accuser"] for out in left_out), "the accuser leaves, never the accused or anyone else"
    # Two that accuse each other: the tie goes by a per-attempt hash, each out of about half the attempts.
    candidates["peer-0"] = Candidate(DIGEST, 1.0, False, excluded=("accuser",), weight=1.0)
    left_out = [sorted(set(candidates) - set(settled(candidates, attempt_salt(2, a)))) for a in range(200)]
    assert all(out in (["peer-0"], ["accuser"]) for out in left_out), "one of the two, never anyone else"
    assert 60 <= sum(out == ["peer-0"] for out in left_out) <= 140
