"""The swarm's readings of the peers' announcements (swarm/dht/view.py): pure functions of records and a time, so
no network. `records` are the other peers' (the announcer leaves its own out, see test_announcer.py)."""

from __future__ import annotations

from swarm.dht import view
from swarm.dht.records import ONLINE_STATES, PEER_STATES, ROUND_STATES, TRAINING_STATES, PeerRecord
from swarm.dht.view import EXTRAPOLATE_SECONDS, FRESH_SECONDS, Reference

NOW = 100.0


def record(peer_id: str, state: str = "training", round_no: int = 3, tokens: int = 0, tokens_per_s: float = 0.0,
           updated: float = 99.0, **fields) -> PeerRecord:
    return PeerRecord(peer_id=peer_id, state=state, version="0", run_id="run", round=round_no,
                      tokens_in_round=tokens, block_start=0, block_end=2, tokens_per_s=tokens_per_s,
                      updated=updated, **fields)


def ids(records) -> set[str]:
    return {p.peer_id for p in records}


def test_state_groups_nest_and_cover_every_state():
    assert set(TRAINING_STATES) < set(ROUND_STATES) < set(ONLINE_STATES) < set(PEER_STATES)
    assert set(PEER_STATES) - set(ONLINE_STATES) == {"offline"}


def test_live_peers_are_in_the_asked_states_with_a_fresh_heartbeat():
    records = [record("a"), record("b", "averaging"), record("c", "syncing"), record("d", "offline"),
               record("edge", updated=NOW - FRESH_SECONDS), record("stale", updated=NOW - FRESH_SECONDS - 0.01)]
    assert ids(view.live(records, NOW)) == {"a", "b", "edge"}
    assert ids(view.live(records, NOW, ROUND_STATES)) == {"a", "b", "c", "edge"}
    assert ids(view.online(records)) == {"a", "b", "c", "edge", "stale"}, "online judges no heartbeat"
    assert ids(view.others(records, "a")) == {"b", "c", "d", "edge", "stale"}


def test_progress_extrapolates_training_peers_from_their_last_announcement():
    records = [record("a", "training", 3, 1000, 500.0, updated=99.0),   # 1 s old: +500
               record("b", "averaging", 3, 2000, 500.0, updated=98.0),  # not training: as announced
               record("c", "training", 2, 9999, 500.0, updated=99.0),   # another round: not counted
               record("d", "offline", 3, 9999, 500.0, updated=99.0)]    # gone: not counted
    assert view.swarm_progress(records, 3, 300, NOW) == 300 + 1500 + 2000


def test_extrapolation_is_bounded_and_never_negative():
    stale = record("a", "training", 0, 1000, 100.0, updated=0.0)  # 100 s old (a stopped heartbeat)
    ahead = record("b", "training", 0, 1000, 100.0, updated=NOW + 2.0)  # a clock a little ahead of ours
    assert view.swarm_progress([stale], 0, 0, NOW) == 1000 + int(100.0 * EXTRAPOLATE_SECONDS)
    assert view.swarm_progress([ahead], 0, 0, NOW) == 1000
    assert view.swarm_progress([stale], 0, 0, 0.0) == 1000


def test_with_overlap_tokens_handed_in_count_toward_their_round_and_later_ones_toward_the_next():
    """Peer a handed in round 3 (7000 tokens, its average in flight) and trained 1000 tokens since; b applied round
    3 already; c still collects round 3. A peer still collecting round 3 counts a's 7000 (not 0: it would wait
    for tokens that will never come), a peer past it counts a's 1000 toward round 4 and not its 7000 again."""
    records = [record("a", "training", 3, 1000, updated=NOW, in_flight_tokens=7000),
               record("b", "training", 4, 2000, updated=NOW),
               record("c", "training", 3, 50000, updated=NOW)]
    assert view.swarm_progress(records, 4, 10, NOW) == 10 + 1000 + 2000
    # (c counts for at most PACE_SPREAD times the others' lower median, a's 7000)
    assert view.swarm_progress(records, 3, 10, NOW) == 10 + 7000 + int(view.PACE_SPREAD * 7000)


def test_a_round_is_due_once_another_live_peer_handed_it_in():
    """Averaging round 3 (or, with overlap, having it in flight) means that peer's view reached the round's
    tokens: round 3 is due for everyone. Not for another round, not from a peer whose heartbeat stopped."""
    averaging = record("a", "averaging", 3, 1000)
    in_flight = record("b", "training", 3, 10, in_flight_tokens=900)
    assert view.handed_in([averaging], 3, NOW) and view.handed_in([in_flight], 3, NOW)
    assert not view.handed_in([averaging, in_flight], 4, NOW)
    assert not view.handed_in([record("a", "training", 3, 1000)], 3, NOW)
    assert not view.handed_in([record("a", "averaging", 3, 1000, updated=90.0)], 3, NOW)


def test_a_peer_whose_average_is_in_flight_takes_part_in_the_next_round():
    """With overlap, a peer's record says round 3 until its round-3 average lands, while it trains round 4: the
    others' matchmaking for round 4 must wait for it (it comes once the average landed), not form groups without
    it. It still counts in round 3, whose group it is in; a stale or offline peer counts in neither."""
    records = [record("a", "training", 3, 10, in_flight_tokens=900),
               record("b", "training", 4, 10),
               record("c", "syncing", 4, 0),
               record("d", "training", 4, 10, updated=90.0),
               record("e", "offline", 4, 10)]
    assert ids(view.in_round(records, 4, NOW)) == {"a", "b", "c"}
    assert ids(view.in_round(records, 3, NOW)) == {"a"}
    assert view.in_round(records, 5, NOW) == []


def test_the_swarms_reference_is_the_majority_digest_of_the_top_round_among_live_peers():
    def at(peer_id, round_no, digest, updated=99.0, state="training", client=False):
        return record(peer_id, state, round_no, updated=updated, digest=digest, client=client)

    assert view.reference([], NOW) == Reference(0, "", []) == (0, "", [])
    records = [at("a", 5, "x"), at("b", 5, "y"), at("c", 5, "y"), at("d", 4, "y"), at("e", 4, "z"),
               at("stale", 6, "w", updated=50.0),  # its heartbeat stopped: its round does not count
               at("gone", 6, "w", state="offline"), at("nodigest", 7, "")]
    reference = view.reference(records, NOW)
    assert (reference.round, reference.digest, reference.holders) == (5, "y", ["b", "c"])
    assert reference == (5, "y", ["b", "c"]), "read by index as well as by name"
    tie = [at("a", 2, "q"), at("b", 2, "p")]
    assert view.reference(tie, NOW) == (2, "p", ["b"]), "a tie goes to the smaller digest, in every view"
    clients = [at("a", 3, "x"), at("b", 3, "y", client=True), at("c", 3, "y", client=True), at("d", 3, "y")]
    assert view.reference(clients, NOW) == (3, "y", ["d"]), "clients vote, but serve no state"


def test_majority_digest_and_top_round():
    records = [record("a", digest="q"), record("b", digest="p"), record("c", digest="q", round_no=5)]
    assert view.majority_digest(records) == "q"
    assert view.majority_digest(records[:2]) == view.majority_digest(records[1::-1]) == "p", "ties: smallest"
    assert view.majority_digest([]) == ""
    assert view.top_round(records) == (5, [records[2]])
    assert view.top_round([]) == (0, [])


def test_a_round_can_be_averaged_after_some_group_finished_it_only_with_enough_peers_left_in_it():
    def at(peer_id, round_no):
        return record(peer_id, "training", round_no)

    # Five live peers besides us, groups of 2: three of them still at round 3 with us.
    records = [at("a", 4), at("b", 4), at("c", 3), at("d", 3), at("e", 3)]
    assert view.others_still_in(records, 3, NOW, set(), min_group_size=2, target_group_size=2)
    # Those at round 3 just failed with us: nobody is left to average it with.
    assert not view.others_still_in(records, 3, NOW, {"c", "d", "e"}, min_group_size=2, target_group_size=2)
    # One group holds the whole swarm: a straggler re-syncs rather than averaging apart.
    assert not view.others_still_in(records, 3, NOW, set(), min_group_size=2, target_group_size=8)
    # Peers already past the round count toward the swarm's size but cannot average it.
    assert not view.others_still_in([at("a", 4), at("b", 4), at("c", 4)], 3, NOW, set(), 2, 2)
    # Peers whose heartbeat stopped count for nothing.
    stale = [record(p.peer_id, "training", p.round, updated=NOW - FRESH_SECONDS - 1) for p in records]
    assert not view.others_still_in(stale, 3, NOW, set(), min_group_size=2, target_group_size=2)


def test_attempts_of_a_round_come_from_its_training_peers_however_old():
    records = [record("a", attempt=2), record("b", "averaging", attempt=1, updated=0.0),
               record("c", "syncing", attempt=7), record("d", round_no=4, attempt=9)]
    assert sorted(view.attempts(records, 3)) == [1, 2]
    assert view.attempts(records, 5) == []


def test_at_round_counts_training_peers_of_that_round():
    records = [record("a"), record("b", "averaging"), record("c", "syncing"), record("d", round_no=4)]
    assert ids(view.at_round(records, 3)) == {"a", "b"}


def test_one_record_claiming_a_newer_state_does_not_move_the_reference():
    """A forged reference (round + 1, a digest of its author's making) leads nobody anywhere: a state is followed
    only once a quorum of distinct live peers announce it."""
    def at(peer_id, round_no, digest, client=False):
        return record(peer_id, "training", round_no, digest=digest, client=client)

    honest = [at("a", 7, "good"), at("b", 7, "good"), at("c", 7, "good")]
    forged = honest + [at("liar", 8, "evil")]
    assert view.reference(forged, NOW, quorum=2) == (7, "good", ["a", "b", "c"])
    assert view.reference(forged, NOW, quorum=1) == (8, "evil", ["liar"]), "without the quorum, as before"
    moved_on = honest[:1] + [at("b", 8, "next"), at("c", 8, "next"), at("liar", 8, "evil")]
    assert view.reference(moved_on, NOW, quorum=2) == (8, "next", ["b", "c"]), "two honest peers moved on"
    assert view.reference([at("a", 8, "x", client=True), at("b", 8, "x")], NOW, quorum=2) == (8, "x", ["b"]), \
        "a client vouches for a state though it serves none"
    assert view.reference(honest, NOW, quorum=4) == (0, "", []), "no round with the quorum: nothing to follow"


def test_with_an_anchor_only_a_majority_of_the_last_group_moves_a_peer():
    """Two colluding peers announce round + 1 with the same forged state: the quorum of live peers (two, after a
    group of three) lets them lead; the anchor, the others of the last group this peer averaged in, does not,
    unless a majority of those hold the state. Of two digests at one round, the anchored one is followed though
    fewer announce it. An anchor whose peers are gone is dropped; one that merely went quiet is not."""
    def at(peer_id, round_no, digest, state="training", **kwargs):
        return record(peer_id, state, round_no, digest=digest, **kwargs)

    group = frozenset({"a", "b"})  # we averaged round 6 with a and b
    honest = [at("a", 7, "good"), at("b", 7, "good")]
    colluding = honest + [at("x", 8, "evil"), at("y", 8, "evil")]
    assert view.reference(colluding, NOW, quorum=2) == (8, "evil", ["x", "y"]), "the quorum alone is taken"
    assert view.reference(colluding, NOW, quorum=2, anchor=group) == (7, "good", ["a", "b"])
    outvoted = honest + [at("x", 7, "evil"), at("y", 7, "evil"), at("z", 7, "evil")]
    assert view.reference(outvoted, NOW, quorum=2, anchor=group) == (7, "good", ["a", "b"])
    half = [at("a", 8, "next"), at("b", 7, "good"), at("x", 8, "next")]
    assert view.reference(half, NOW, quorum=2, anchor=group) == (0, "", []), "one of two is no majority: wait"
    moved = [at("a", 8, "next"), at("b", 8, "next"), at("x", 8, "next")]
    assert view.reference(moved, NOW, quorum=2, anchor=group) == (8, "next", ["a", "b", "x"])
    bigger = frozenset({"a", "b", "c", "d"})  # of four others, three make the majority
    assert view.reference([at(p, 9, "n") for p in "abx"], NOW, quorum=2, anchor=bigger).round == 0
    assert view.reference([at(p, 9, "n") for p in "abcx"], NOW, quorum=2, anchor=bigger).round == 9
    # The anchor holds while a majority of its peers is online, whatever they announce.
    assert view.anchored(colluding, NOW, group) == group
    quiet = [at("a", 7, "", state="joining"), at("b", 7, "good")] + colluding[2:]
    assert view.anchored(quiet, NOW, group) == group, "a member that stopped announcing a state still counts"
    gone = [at("a", 7, "good", state="offline"), at("b", 7, "good", updated=NOW - FRESH_SECONDS - 1)]
    assert view.anchored(gone + colluding[2:], NOW, group) == frozenset(), "they left: the quorum alone decides"
    assert view.anchored(colluding, NOW, frozenset()) == frozenset()


def test_the_quorum_is_a_majority_of_the_last_group_and_two_unless_one_peer_is_all_there_is():
    assert view.quorum(last_group_size=0, vouchers=5) == 2, "a joiner: two distinct peers, never one"
    assert view.quorum(last_group_size=3, vouchers=5) == 2
    assert view.quorum(last_group_size=6, vouchers=7) == 4, "two of six cannot move a group of six"
    assert view.quorum(last_group_size=6, vouchers=4) == 3, "peers left: all but one of those there are"
    assert view.quorum(last_group_size=2, vouchers=2) == 2, "with two others, one alone is never followed"
    assert view.quorum(last_group_size=0, vouchers=1) == 1, "a swarm of two follows its other peer"
    assert view.quorum(last_group_size=0, vouchers=0) == 1
    records = [record(p, round_no=4, digest="d") for p in "abc"] + [record("e", round_no=5, digest=""),
                                                                      record("old", round_no=4, digest="d",
                                                                             updated=NOW - FRESH_SECONDS - 1)]
    assert view.vouchers(records, NOW) == 3, "distinct live peers that announce a state"


def test_a_record_from_the_future_is_no_peer_and_one_peer_s_pace_is_bounded_by_the_others():
    """One signed record with a huge token count and an `updated` time far ahead used to make every round due after
    one inner step, and stayed live for its whole lifetime without a heartbeat. A record dated more than
    FUTURE_SECONDS ahead is neither live nor counted; a count within the clock's slack is bounded: among two or more
    others, no peer counts for more than PACE_SPREAD times their lower median (a pair cannot out-vote it)."""
    liar = record("liar", "training", 3, 10 ** 9, 10.0 ** 9, updated=NOW + 3600)
    honest = [record(p, "training", 3, 1000, 0.0, updated=NOW) for p in "ab"]
    assert ids(view.live([liar, *honest], NOW)) == {"a", "b"}
    assert view.swarm_progress([liar, *honest], 3, 500, NOW) == 500 + 2000, "the future record counts for nothing"
    loud = record("liar", "training", 3, 10 ** 9, 0.0, updated=NOW + 1.0)  # within the clock slack: bounded
    assert view.swarm_progress([loud, *honest], 3, 500, NOW) == 500 + 2000 + int(view.PACE_SPREAD * 1000)
    assert view.swarm_progress([loud, honest[0]], 3, 500, NOW) == 500 + 1000 + int(view.PACE_SPREAD * 1000)
    assert view.swarm_progress([loud], 3, 500, NOW) == 500 + 10 ** 9, "a pair (us and it): as it says"
