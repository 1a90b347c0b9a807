"""The outer-round state machine (swarm/peer/rounds.py) and the averager's retries (swarm/peer/averager.py), in
one process: a fake clock, a fake reduce, and a fake node (announcer, matchmaking, all-reduce) instead of peers."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from swarm.averaging.common import AllReduceError, AllReduceResult
from swarm.averaging.faults import FaultPlan
from swarm.averaging.matchmaking import Group
from swarm.dht.view import Reference
from swarm.monitoring.metrics import PeerMetrics
from swarm.peer.averager import Averager, LinkEstimate
from swarm.peer.pipeline.placement import upstream_finished
from swarm.peer.rounds import (MAX_IMMEDIATE_RETRIES, RESYNC_BACKOFF, RESYNC_RETRY, Averaged, Contribution,
                               NotAveraged, Rounds)
from swarm.runtime import LoopThread


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def machine(overlap: bool = False, steps_per_round=None, clock=None) -> Rounds:
    return Rounds(overlap=overlap, tokens_per_round=1000, steps_per_round=steps_per_round, retry_tokens=250,
                  clock=clock or Clock())


def contribution(rounds: Rounds, round_no: int = 0, snapshot: bool = False) -> Contribution:
    return Contribution(round_no, torch.zeros(4), rounds.tokens_in_round, "digest",
                        torch.zeros(4) if snapshot else None)


def test_due_when_the_swarm_reaches_the_round_tokens_or_another_peer_handed_in():
    rounds = machine()
    assert not rounds.due(swarm_tokens=0, handed_in=True), "nothing trained: nothing to hand in"
    rounds.trained(100)
    assert not rounds.due(swarm_tokens=900, handed_in=False)
    assert rounds.due(swarm_tokens=1000, handed_in=False)
    assert rounds.due(swarm_tokens=500, handed_in=True), "another peer's view reached the round's tokens"
    # Issue 37, class 6: a record saying "averaging" is its writer's word: alone it ended every round after one
    # inner step. It counts once our own view reached half the round.
    assert not rounds.due(swarm_tokens=100, handed_in=True)


def test_a_serving_stage_is_due_once_most_of_the_stage_before_finished_the_round_even_with_nothing_trained():
    # A last-stage peer that got no microbatch in its round while its stage's others averaged it without waiting
    # for it, and the first stage's peers stopped at --until-round: it waited for tokens that never came, for good.
    rounds = machine()
    assert not rounds.due(swarm_tokens=0, handed_in=True, upstream_done=False)
    assert rounds.due(swarm_tokens=0, handed_in=False, upstream_done=True), "no more microbatches of this round"
    # Most of the stage before's peers that took part in round 3 announce round 4 (those behind it say nothing).
    assert upstream_finished([4, 4], 3) and upstream_finished([4, 4, 3], 3) and upstream_finished([4, 1, 0], 3)
    assert not upstream_finished([4, 3], 3), "one peer's word ends no round"
    assert not upstream_finished([4, 3, 3], 3) and not upstream_finished([], 3)
    assert not upstream_finished([6, 6], 3), "a stage far ahead is another matter (its round is not ours)"


def test_due_after_a_fixed_step_count_when_the_recipe_sets_one():
    rounds = machine(steps_per_round=3)
    for _ in range(2):
        rounds.trained(10)
    assert not rounds.due(swarm_tokens=10**9, handed_in=True)
    rounds.trained(10)
    assert rounds.due(swarm_tokens=0, handed_in=False)


def test_a_failed_round_retries_with_the_next_attempt_after_more_training():
    rounds = machine()
    rounds.trained(1000)
    outcome = rounds.hand_in(contribution(rounds), lambda c, attempt: NotAveraged(c, attempt + 2))
    assert isinstance(outcome, NotAveraged) and rounds.state == "training"
    rounds.failed(outcome)
    assert rounds.next_attempt == 3
    assert not rounds.due(swarm_tokens=10**6, handed_in=True), "train retry_tokens more before the next try"
    rounds.trained(249)
    assert not rounds.due(swarm_tokens=10**6, handed_in=False)
    rounds.trained(1)
    assert rounds.due(swarm_tokens=10**6, handed_in=False)
    # Alone: nobody used that attempt's keys, so the next try reuses its number.
    seen = []
    outcome = rounds.hand_in(contribution(rounds), lambda c, attempt: seen.append(attempt) or NotAveraged(
        c, attempt, alone=True))
    rounds.failed(outcome)
    assert seen == [3] and rounds.next_attempt == 3


def test_the_state_is_averaging_while_a_round_is_averaged_without_overlap():
    rounds = machine()
    rounds.start_training()
    rounds.trained(1000)
    states = []
    rounds.hand_in(contribution(rounds), lambda c, attempt: states.append(rounds.snapshot().state) or
                   NotAveraged(c, attempt))
    assert states == ["averaging"] and rounds.snapshot().state == "training"


def test_a_landed_round_starts_the_next_at_attempt_zero_and_counts_from_zero():
    clock = Clock()
    rounds = machine(clock=clock)
    rounds.start_training()
    rounds.trained(1000)
    rounds.begin_attempt(0, 2, announced=[1])
    outcome = rounds.hand_in(contribution(rounds), lambda c, attempt: Averaged(c, 2, None, None))
    clock.now += 7.5
    assert rounds.landed(outcome) == 7.5
    snap = rounds.snapshot()
    assert (snap.tokens_in_round, snap.attempt, rounds.next_attempt, rounds.rounds_done) == (0, 0, 0, 1)
    assert rounds.retry_after_tokens == 0


def test_overlap_hands_in_to_the_background_and_announces_the_tokens_apart():
    rounds = machine(overlap=True)
    rounds.trained(1000)
    release = threading.Event()

    def reduce(c, attempt):
        release.wait(10)
        return Averaged(c, attempt, None, None)

    assert rounds.hand_in(contribution(rounds, snapshot=True), reduce) is None
    snap = rounds.snapshot()
    assert (snap.tokens_in_round, snap.in_flight_tokens) == (0, 1000)
    assert rounds.counting_round(5) == 6, "new tokens count toward the next round while this one is in flight"
    with pytest.raises(RuntimeError):
        rounds.hand_in(contribution(rounds), reduce)
    rounds.trained(300)
    assert rounds.poll() is None and rounds.in_flight
    release.set()
    deadline = time.monotonic() + 10
    while (outcome := rounds.poll()) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert isinstance(outcome, Averaged) and not rounds.in_flight
    rounds.landed(outcome)
    snap = rounds.snapshot()
    assert (snap.tokens_in_round, snap.in_flight_tokens) == (300, None), "the steps made meanwhile stay counted"
    assert rounds.counting_round(6) == 6
    rounds.close()


def test_overlap_failure_puts_the_handed_in_tokens_back_into_the_round():
    rounds = machine(overlap=True)
    rounds.trained(1000)
    rounds.hand_in(contribution(rounds, snapshot=True), lambda c, attempt: NotAveraged(c, attempt))
    rounds.trained(200)
    outcome = rounds.wait()
    rounds.failed(outcome)
    snap = rounds.snapshot()
    assert (snap.tokens_in_round, snap.in_flight_tokens) == (1200, None)
    assert rounds.retry_after_tokens == 1200 + 250
    rounds.close()


def test_an_averaging_that_raises_is_a_failed_round_not_a_dead_peer():
    rounds = machine(overlap=True)
    rounds.trained(1000)

    def broken(c, attempt):
        raise ValueError("bug")

    rounds.hand_in(contribution(rounds, snapshot=True), broken)
    outcome = rounds.wait()
    assert isinstance(outcome, NotAveraged)
    rounds.failed(outcome)
    assert rounds.snapshot().tokens_in_round == 1000
    rounds.close()


def test_no_snapshot_ever_counts_a_round_tokens_twice_or_loses_them():
    """The announcer reads snapshots from another thread at any moment; the tokens we announce (in the round plus
    in flight) must always equal what was trained and not yet averaged, through hand-ins, failures and landings.
    The process tests found rounds due too early when a record counted in-flight tokens twice."""
    rounds = machine(overlap=True)
    trained_unaveraged = [0]
    lock = threading.Lock()
    stop, bad = threading.Event(), []

    def reader():
        while not stop.is_set():
            with lock:
                snap = rounds.snapshot()
                expected = trained_unaveraged[0]
            if snap.tokens_in_round + (snap.in_flight_tokens or 0) != expected:
                bad.append((snap, expected))

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for i in range(200):
            with lock:
                rounds.trained(10)
                trained_unaveraged[0] += 10
            if i % 20 == 19:  # handing in and failing move tokens but never change their sum: no test lock
                rounds.hand_in(contribution(rounds, snapshot=True),
                               (lambda c, a: NotAveraged(c, a)) if i % 40 == 19 else
                               (lambda c, a: Averaged(c, a, None, None)))
                outcome = rounds.wait()
                if isinstance(outcome, Averaged):
                    with lock:
                        rounds.landed(outcome)
                        trained_unaveraged[0] -= outcome.contribution.weight
                else:
                    rounds.failed(outcome)
    finally:
        stop.set()
        thread.join()
        rounds.close()
    assert not bad, bad[:3]


def test_resync_timing_backs_off_unless_the_holders_only_moved_on():
    clock = Clock()
    rounds = machine(overlap=True, clock=clock)
    assert rounds.resync_due()
    rounds.resync_failed(moved_on=True)
    assert not rounds.resync_due()
    clock.now += RESYNC_RETRY
    assert rounds.resync_due()
    rounds.resync_failed(moved_on=False)
    clock.now += RESYNC_BACKOFF - 0.5
    assert not rounds.resync_due()
    clock.now += 0.5
    assert rounds.resync_due()
    # A re-sync leaves the round: the average in flight is moot, and the new round counts from attempt 0.
    rounds.trained(1000)
    rounds.hand_in(contribution(rounds, snapshot=True), lambda c, a: Averaged(c, a, None, None))
    rounds.begin_attempt(0, 4, announced=[])
    rounds.leave_round()
    rounds.resynced()
    snap = rounds.snapshot()
    assert not rounds.in_flight and snap.in_flight_tokens is None and snap.tokens_in_round == 0
    assert (snap.attempt, rounds.next_attempt) == (0, 0)
    rounds.close()


def test_exclusions_last_the_round_and_unresponsive_peers_only_the_next_attempt():
    rounds = machine()
    assert rounds.begin_attempt(3, 0, announced=[2, 1]) == 2, "peers that failed together retry together"
    assert rounds.attempt_failed(3, "bad_data", suspects=set(), rejected={"liar"}, retries=1)
    assert rounds.excluded(3) == ({"liar"}, set())
    assert rounds.attempt_failed(3, "timeout", suspects={"slow"}, rejected=set(), retries=2)
    assert rounds.excluded(3) == ({"liar"}, {"slow"})
    assert rounds.attempt_failed(3, "timeout", suspects={"other"}, rejected=set(), retries=3)
    assert rounds.excluded(3) == ({"liar"}, {"other"}), "a slow peer is welcome back after one attempt"
    assert rounds.failed_peers(3) == {"liar", "other"}
    assert rounds.excluded(4) == (set(), set())
    rounds.begin_attempt(4, 0, announced=[])
    assert rounds.excluded(3) == (set(), set()), "a new round forgets the last one's exclusions"


def test_when_a_failed_attempt_is_redone_at_once():
    rounds = machine()
    assert not rounds.attempt_failed(0, "timeout", suspects=set(), rejected=set(), retries=1), \
        "nobody to blame: train on, views must change first"
    assert rounds.attempt_failed(0, "conflict", suspects=set(), rejected=set(), retries=1)
    assert not rounds.attempt_failed(0, "timeout", suspects={"x"}, rejected=set(),
                                     retries=MAX_IMMEDIATE_RETRIES + 1)


# ---- the averager against a fake node ---------------------------------------------------------------------------
class FakeAnnouncer:
    def __init__(self, peers=("a", "b", "c")):
        self.peers = list(peers)
        self.reference = Reference(0, "digest", list(peers))
        self.announced_attempts: list[int] = []
        self.others_in = True

    def attempts(self, round_no):
        return list(self.announced_attempts)

    def refresh_now(self, loop):
        pass

    def in_round(self, round_no):
        return [SimpleNamespace(peer_id=p) for p in self.peers]

    def swarm_reference(self):
        return self.reference

    def others_still_in(self, round_no, failed, min_group_size, target_group_size):
        return self.others_in


class FakeAllReduce:
    def __init__(self, failures):
        self.failures = list(failures)  # AllReduceErrors to raise, one per run, before succeeding
        self.runs, self.decided = [], []
        self.deadlines = SimpleNamespace(measured=lambda: None)
        self.verifiable = False  # (this run's reducers are not checked)

    def commitment(self, round_no, attempt):
        return ""

    async def run(self, group, vector, weight, exact_from):
        self.runs.append((group.attempt, group.members, vector.numel(), exact_from))
        if self.failures:
            raise self.failures.pop(0)
        return AllReduceResult(vector.clone(), vector.clone(), weight * len(group.members), len(group.members),
                               100, 100, 0.5)

    async def decide(self, round_no, attempt, group_id):
        self.decided.append((round_no, attempt, group_id))


@pytest.fixture
def loop():
    thread = LoopThread()
    yield thread
    thread.close()


def averager(loop, rounds, announcer, allreduce, groups):
    calls = []

    async def matchmaking(node, run_id, round_no, attempt, me_as, expected, min_size, target, timeout, *,
                          excluded, not_waiting_for, still_in, push, verified, min_servers=1, patience=None,
                          attendance=None):
        calls.append({"attempt": attempt, "excluded": set(excluded), "not_waiting_for": set(not_waiting_for),
                      "expected": set(expected)})
        members = groups.pop(0) if groups else None
        if members is None:
            return None, 0
        return Group.of(round_no, attempt, members, [1 / len(members)] * len(members), mix=False), len(members)

    recipe = SimpleNamespace(run_id="run", averaging=SimpleNamespace(
        min_group_size=2, target_group_size=8, matchmaking_timeout=5.0, allreduce_timeout=10.0, group_bounds=(2, 1)))
    built = Averager(loop=loop, node=None, recipe=recipe, allreduce=allreduce, group_push=None,
                     announcer=announcer, rounds=rounds, faults=FaultPlan(None), metrics=PeerMetrics(),
                     link=LinkEstimate(), client_mode=False, flat_state=lambda: torch.zeros(4),
                     matchmaking=matchmaking)
    return built, calls


def test_a_peer_that_never_comes_is_waited_for_half_as_long_each_time_and_fully_again_once_it_comes(loop):
    """The averager's patience with a peer that was waited for in vain: the whole window, then half of it each
    matchmaking it misses again, the whole window once it comes; at most MAX_NO_SHOWS peers remembered."""
    from swarm.peer import averager as averager_module
    rounds, announcer = machine(), FakeAnnouncer()
    built, calls = averager(loop, rounds, announcer, FakeAllReduce([]), [])
    patiences = []

    async def matchmaking(*args, patience=None, attendance=None, **kwargs):
        patiences.append(dict(patience))
        attendance.update(script.pop(0))
        return None, 0

    built.matchmaking = matchmaking
    script = [{"came": {"a"}, "missed": {"ghost"}}, {"came": {"a"}, "missed": {"ghost"}}, {"came": {"ghost"}}, {}]
    contribution = SimpleNamespace(round_no=3, digest="d" * 16, weight=1.0)
    for attempt in range(4):
        built.match(contribution, attempt)
    assert patiences == [{}, {"ghost": 2.5}, {"ghost": 1.25}, {}], patiences
    for k in range(averager_module.MAX_NO_SHOWS + 5):
        built._attended({"missed": {f"p{k}"}})
    assert len(built.no_shows) == averager_module.MAX_NO_SHOWS and "p0" not in built.no_shows


def test_the_averager_redoes_a_round_at_once_without_the_member_that_failed(loop):
    rounds, announcer = machine(), FakeAnnouncer()
    announcer.announced_attempts = [1]
    allreduce = FakeAllReduce([AllReduceError("timeout", "c did not deliver", suspects={"c"})])
    worker, calls = averager(loop, rounds, announcer, allreduce, [("a", "b", "c"), ("a", "b")])
    rounds.trained(1000)
    outcome = rounds.hand_in(contribution(rounds), worker.reduce)
    assert isinstance(outcome, Averaged) and outcome.attempt == 2
    assert [run[0] for run in allreduce.runs] == [1, 2], "the announced attempt first, then the next at once"
    assert calls[1]["not_waiting_for"] == {"c"} and calls[1]["excluded"] == set()
    assert rounds.snapshot().attempt == 2


def test_the_averager_leaves_bad_senders_out_for_the_rest_of_the_round(loop):
    rounds, announcer = machine(), FakeAnnouncer()
    allreduce = FakeAllReduce([AllReduceError("bad_data", "garbage", suspects=set(), rejected={"b"}),
                               AllReduceError("timeout", "slow", suspects={"c"})])
    worker, calls = averager(loop, rounds, announcer, allreduce, [("a", "b", "c"), ("a", "c"), ("a", "d")])
    rounds.trained(1000)
    outcome = rounds.hand_in(contribution(rounds), worker.reduce)
    assert isinstance(outcome, Averaged)
    assert [c["excluded"] for c in calls] == [set(), {"b"}, {"b"}]
    assert [c["not_waiting_for"] for c in calls] == [set(), set(), {"c"}]


def test_the_averager_gives_up_after_the_immediate_retries(loop):
    rounds, announcer = machine(), FakeAnnouncer()
    failures = [AllReduceError("timeout", "lost", suspects={"c"}) for _ in range(MAX_IMMEDIATE_RETRIES + 1)]
    allreduce = FakeAllReduce(failures)
    worker, calls = averager(loop, rounds, announcer, allreduce, [("a", "c")] * 10)
    rounds.trained(1000)
    outcome = rounds.hand_in(contribution(rounds), worker.reduce)
    assert isinstance(outcome, NotAveraged) and not outcome.alone
    assert len(allreduce.runs) == MAX_IMMEDIATE_RETRIES + 1
    rounds.failed(outcome)
    assert rounds.next_attempt == outcome.attempt + 1


def test_no_group_tells_the_others_at_once_and_alone_keeps_the_attempt(loop):
    rounds, announcer = machine(), FakeAnnouncer()
    allreduce = FakeAllReduce([])
    worker, _ = averager(loop, rounds, announcer, allreduce, [])
    rounds.trained(1000)
    outcome = rounds.hand_in(contribution(rounds), worker.reduce)
    assert isinstance(outcome, NotAveraged) and outcome.alone
    assert allreduce.decided == [(0, 0, None)], "members that counted on us hear we are not coming"


def test_the_averager_stops_when_the_swarm_moved_on_without_us(loop):
    rounds, announcer = machine(), FakeAnnouncer()
    announcer.reference = Reference(3, "newer", ["a"])
    announcer.others_in = False
    allreduce = FakeAllReduce([])
    worker, calls = averager(loop, rounds, announcer, allreduce, [("a", "b")])
    rounds.trained(1000)
    outcome = rounds.hand_in(contribution(rounds, round_no=1), worker.reduce)
    assert isinstance(outcome, NotAveraged) and not calls and not allreduce.runs
