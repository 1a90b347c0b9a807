"""The announcer's readings of its swarm view: the other peers' records (never our own, whose numbers the peer
reads live) at the DHT's time, through swarm/dht/view.py (whose readings test_view.py covers)."""

from __future__ import annotations

from types import SimpleNamespace

from swarm.dht.records import ROUND_STATES, PeerRecord
from swarm.dht.view import FRESH_SECONDS, Reference
from swarm.peer.announcer import Announcer

NOW = 100.0


def record(peer_id: str, state: str = "training", round_no: int = 3, tokens: int = 0, updated: float = 99.0,
           **fields) -> PeerRecord:
    return PeerRecord(peer_id=peer_id, state=state, version="0", run_id="run", round=round_no,
                      tokens_in_round=tokens, block_start=0, block_end=2, updated=updated, **fields)


def announcer(view: list[PeerRecord]) -> Announcer:
    node = SimpleNamespace(peer_id="me", now=lambda: NOW)
    result = Announcer(node, "run", 2, record=lambda: None, metrics=None)
    result.view = view
    return result


def test_readings_leave_out_our_own_record():
    """Our record (from the last heartbeat) is in the view; counted, it would add our tokens twice, make a round
    due because we averaged it, and list us among the holders and peers of a round."""
    lone = announcer([record("me", "averaging", 9, 7777, digest="m")])
    assert lone.others() == []
    assert lone.swarm_progress(9, 10) == 10
    assert not lone.handed_in(9)
    assert lone.in_round(9) == [] and lone.live() == []
    assert lone.swarm_reference() == Reference(0, "", [])
    assert not lone.others_still_in(9, set(), min_group_size=1, target_group_size=0)


def test_readings_are_at_the_nodes_time_unless_told():
    """A record FRESH_SECONDS old is live at the node's time; one a moment older is not, unless read earlier."""
    old = record("a", updated=NOW - FRESH_SECONDS - 1)
    reader = announcer([old, record("b", updated=NOW)])
    assert {p.peer_id for p in reader.live()} == {"b"}
    assert {p.peer_id for p in reader.live(now=NOW - 1)} == {"a", "b"}
    assert {p.peer_id for p in reader.live(ROUND_STATES, now=NOW - 1)} == {"a", "b"}
    assert {p.peer_id for p in reader.in_round(3, now=NOW - 1)} == {"a", "b"}


def test_swarm_reference_reads_by_name_and_by_index():
    view = [record("a", round_no=5, digest="x"), record("b", round_no=5, digest="x"),
            record("me", round_no=6, digest="y")]
    reference = announcer(view).swarm_reference()
    assert reference.round == 5 and reference.digest == "x" and reference.holders == ["a", "b"]
    swarm_round, digest, holders = reference
    assert (swarm_round, digest, holders) == (5, "x", ["a", "b"]) and reference[0] == 5


def test_the_reference_needs_the_quorum_of_the_last_group_we_averaged_in():
    view = [record(p, round_no=4, digest="d") for p in "abc"] + [record("liar", round_no=5, digest="evil")]
    reader = announcer(view)
    assert reader.swarm_reference() == (4, "d", ["a", "b", "c"]), "one record does not move a joiner"
    reader.last_group_size = 6
    assert reader.swarm_reference() == (4, "d", ["a", "b", "c"]), "the liar's record does not raise the bar past 3"
    reader.view = [record(p, round_no=4, digest="d") for p in "abcde"] + [record(p, round_no=5, digest="evil")
                                                                           for p in ("c2", "liar")]
    assert reader.swarm_reference() == (4, "d", list("abcde")), "two of a group of six cannot move it"
    reader.last_group_size = 2
    assert reader.swarm_reference() == (5, "evil", ["c2", "liar"]), "two distinct peers: a group of two's majority"
    assert announcer([record("liar", round_no=5, digest="evil"), record("a", round_no=4, digest="d")]
                     ).swarm_reference() == (0, "", []), "one against one: neither is followed"
    assert announcer([record("partner", round_no=5, digest="p")]).swarm_reference() == (5, "p", ["partner"]), \
        "a swarm of two: the peer follows its only other peer"


def test_attempts_count_our_own_announced_attempt():
    """Peers that failed together retry together at the highest attempt any of them announced, ours included."""
    assert sorted(announcer([record("a", attempt=1), record("me", attempt=4)]).attempts(3)) == [1, 4]
