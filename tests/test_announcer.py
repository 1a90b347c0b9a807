"""The swarm's progress as a peer reads it from the announcements in its view."""

from __future__ import annotations

from types import SimpleNamespace

from swarm.dht.records import PeerRecord
from swarm.peer.announcer import EXTRAPOLATE_SECONDS, Announcer


def record(peer_id: str, state: str, round_no: int, tokens: int, tokens_per_s: float, updated: float,
           in_flight_tokens: int | None = None) -> PeerRecord:
    return PeerRecord(peer_id=peer_id, state=state, version="0", run_id="run", round=round_no,
                      tokens_in_round=tokens, block_start=0, block_end=2, tokens_per_s=tokens_per_s,
                      updated=updated, in_flight_tokens=in_flight_tokens)


def announcer(view: list[PeerRecord]) -> Announcer:
    node = SimpleNamespace(peer_id="me", now=lambda: 100.0)
    result = Announcer(node, "run", 2, record=lambda: None, metrics=None)
    result.view = view
    return result


def test_progress_extrapolates_training_peers_from_their_last_announcement():
    view = [record("a", "training", 3, 1000, 500.0, updated=99.0),   # 1 s old: +500
            record("b", "averaging", 3, 2000, 500.0, updated=98.0),  # not training: as announced
            record("c", "training", 2, 9999, 500.0, updated=99.0),   # another round: not counted
            record("d", "offline", 3, 9999, 500.0, updated=99.0),    # gone: not counted
            record("me", "training", 3, 7777, 500.0, updated=99.0)]  # our own record: the live count is used
    assert announcer(view).swarm_progress(3, 300) == 300 + 1500 + 2000


def test_extrapolation_is_bounded_and_never_negative():
    stale = record("a", "training", 0, 1000, 100.0, updated=0.0)  # 100 s old (a stopped heartbeat)
    future = record("b", "training", 0, 1000, 100.0, updated=200.0)  # a clock ahead of ours
    assert announcer([stale]).swarm_progress(0, 0) == 1000 + int(100.0 * EXTRAPOLATE_SECONDS)
    assert announcer([future]).swarm_progress(0, 0) == 1000
    assert announcer([stale]).swarm_progress(0, 0, now=0.0) == 1000


def test_with_overlap_tokens_handed_in_count_toward_their_round_and_later_ones_toward_the_next():
    """Peer a handed in round 3 (7000 tokens, its average in flight) and trained 1000 tokens since; b applied round
    3 already; c still collects round 3. A peer still collecting round 3 counts a's 7000 (not 0: it would wait
    for tokens that will never come), a peer past it counts a's 1000 toward round 4 and not its 7000 again."""
    view = [record("a", "training", 3, 1000, 0.0, updated=100.0, in_flight_tokens=7000),
            record("b", "training", 4, 2000, 0.0, updated=100.0),
            record("c", "training", 3, 50000, 0.0, updated=100.0)]
    progress = announcer(view)
    assert progress.swarm_progress(4, 10) == 10 + 1000 + 2000
    assert progress.swarm_progress(3, 10) == 10 + 7000 + 50000


def test_a_round_is_due_once_another_live_peer_handed_it_in():
    """Averaging round 3 (or, with overlap, having it in flight) means that peer's view reached the round's
    tokens: round 3 is due for everyone. Not for another round, not from our own record, not from a peer whose
    heartbeat stopped."""
    averaging = record("a", "averaging", 3, 1000, 0.0, updated=99.0)
    in_flight = record("b", "training", 3, 10, 0.0, updated=99.0, in_flight_tokens=900)
    assert announcer([averaging]).handed_in(3) and announcer([in_flight]).handed_in(3)
    assert not announcer([averaging, in_flight]).handed_in(4)
    assert not announcer([record("a", "training", 3, 1000, 0.0, updated=99.0)]).handed_in(3)
    assert not announcer([record("me", "averaging", 3, 1000, 0.0, updated=99.0)]).handed_in(3)
    assert not announcer([record("a", "averaging", 3, 1000, 0.0, updated=90.0)]).handed_in(3)


def test_a_peer_whose_average_is_in_flight_takes_part_in_the_next_round():
    """With overlap, a peer's record says round 3 until its round-3 average lands, while it trains round 4: the
    others' matchmaking for round 4 must wait for it (it comes once the average landed), not form groups without
    it. It still counts in round 3, whose group it is in; a stale or offline peer counts in neither."""
    view = [record("a", "training", 3, 10, 0.0, updated=99.0, in_flight_tokens=900),
            record("b", "training", 4, 10, 0.0, updated=99.0),
            record("c", "syncing", 4, 0, 0.0, updated=99.0),
            record("d", "training", 4, 10, 0.0, updated=90.0),
            record("e", "offline", 4, 10, 0.0, updated=99.0)]
    assert {p.peer_id for p in announcer(view).in_round(4)} == {"a", "b", "c"}
    assert {p.peer_id for p in announcer(view).in_round(3)} == {"a"}
    assert announcer(view).in_round(5) == []


def test_the_swarms_reference_is_the_majority_digest_of_the_top_round_among_live_peers():
    def at(peer_id, round_no, digest, updated=99.0, state="training", client=False):
        return PeerRecord(peer_id=peer_id, state=state, version="0", run_id="run", round=round_no,
                          tokens_in_round=0, block_start=0, block_end=2, digest=digest, updated=updated,
                          client=client)

    assert announcer([]).swarm_reference() == (0, "", [])
    view = [at("a", 5, "x"), at("b", 5, "y"), at("c", 5, "y"), at("d", 4, "y"), at("e", 4, "z"),
            at("stale", 6, "w", updated=50.0),  # its heartbeat stopped: its round does not count
            at("gone", 6, "w", state="offline"), at("nodigest", 7, ""), at("me", 9, "m")]
    assert announcer(view).swarm_reference() == (5, "y", ["b", "c"])
    tie = [at("a", 2, "q"), at("b", 2, "p")]
    assert announcer(tie).swarm_reference() == (2, "p", ["b"]), "a tie goes to the smaller digest, in every view"
    clients = [at("a", 3, "x"), at("b", 3, "y", client=True), at("c", 3, "y", client=True), at("d", 3, "y")]
    assert announcer(clients).swarm_reference() == (3, "y", ["d"]), "clients vote, but serve no state"


def test_a_round_can_be_averaged_after_some_group_finished_it_only_with_enough_peers_left_in_it():
    def at(peer_id, round_no):
        return record(peer_id, "training", round_no, 0, 0.0, updated=99.0)

    # Five live peers besides us, groups of 2: three of them still at round 3 with us.
    view = [at("a", 4), at("b", 4), at("c", 3), at("d", 3), at("e", 3)]
    assert announcer(view).others_still_in(3, set(), min_group_size=2, target_group_size=2)
    # Those at round 3 just failed with us: nobody is left to average it with.
    assert not announcer(view).others_still_in(3, {"c", "d", "e"}, min_group_size=2, target_group_size=2)
    # One group holds the whole swarm: a straggler re-syncs rather than averaging apart.
    assert not announcer(view).others_still_in(3, set(), min_group_size=2, target_group_size=8)
    # Peers already past the round count toward the swarm's size but cannot average it.
    assert not announcer([at("a", 4), at("b", 4), at("c", 4)]).others_still_in(3, set(), 2, 2)
