"""The swarm's progress as a peer reads it from the announcements in its view."""

from __future__ import annotations

from types import SimpleNamespace

from swarm.dht.records import PeerRecord
from swarm.peer.announcer import EXTRAPOLATE_SECONDS, Announcer


def record(peer_id: str, state: str, round_no: int, tokens: int, tokens_per_s: float, updated: float,
           progress_round: int | None = None) -> PeerRecord:
    return PeerRecord(peer_id=peer_id, state=state, version="0", run_id="run", round=round_no,
                      tokens_in_round=tokens, block_start=0, block_end=2, tokens_per_s=tokens_per_s,
                      updated=updated, progress_round=progress_round)


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


def test_with_overlap_tokens_count_toward_the_round_after_the_one_in_flight():
    """Peers whose average of round 3 is in flight announce round 3 (their params) but count their tokens toward
    round 4. A peer that applied it already is at round 4. A record from before a peer handed round 3 to the
    background counts toward round 3 only: read as round 4's progress, it would make round 4 due at once."""
    view = [record("a", "training", 3, 1000, 0.0, updated=100.0, progress_round=4),  # round 3's average in flight
            record("b", "training", 4, 2000, 0.0, updated=100.0),                    # applied it
            record("c", "training", 3, 50000, 0.0, updated=100.0)]                   # still collecting round 3
    progress = announcer(view)
    assert progress.swarm_progress(4, 10) == 10 + 1000 + 2000
    assert progress.swarm_progress(3, 10) == 10 + 50000
