"""The outer round as a state machine: when a round is due, handing a contribution to the averaging (in the
background with overlap), its typed outcome, and what a failure, a re-sync or a diverged round leave behind
(attempt numbers, excluded peers, tokens still owed, when to try a state download again).

One `Rounds` object per peer is the only state the training thread shares with the averaging thread; the
announcer reads it through `snapshot()`, an immutable copy taken under its lock.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import torch

logger = logging.getLogger(__name__)
MAX_IMMEDIATE_RETRIES = 3  # then train on and try again later: failures that keep coming need fresh views
RESYNC_BACKOFF = 10.0  # s of training after a failed state download before the next try...
RESYNC_RETRY = 1.0  # ...or after one that failed only because the holders had moved on to newer params
# Another peer's "averaging" makes our round due once our own view of the swarm's tokens reached this share of the
# round's: views lag each other by a heartbeat or two of tokens, far less than half a round.
HANDED_IN_SHARE = 0.5


@dataclass(frozen=True)
class Contribution:
    """What this peer brings to one outer round's average."""

    round_no: int
    pseudo_gradient: torch.Tensor  # flat fp32: global minus local params (+ error-feedback residual)
    weight: int  # tokens processed in the round
    digest: str  # of the global state it is relative to
    snapshot: Optional[torch.Tensor] = None  # overlap: local params when it was taken
    prepared_seconds: float = 0.0  # what the training thread spent making it (pseudo-gradient, snapshot)


@dataclass(frozen=True)
class Averaged:
    """The group averaged the contribution: `result` is ready to apply."""

    contribution: Contribution
    attempt: int
    result: Any  # AllReduceResult
    group: Any  # matchmaking.Group
    # Seconds spent in each phase of the averaging, over all its attempts: "announce" (our record refreshed
    # before matchmaking), "matchmaking", "allreduce" and "verification" (the reducers' checks, after the commits)
    phases: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class NotAveraged:
    """No average this time. `alone`: no group formed and nobody else was seen, so nobody used this attempt's
    keys and the next try may reuse its number."""

    contribution: Contribution
    attempt: int
    alone: bool = False


Outcome = Union[Averaged, NotAveraged]
Reduce = Callable[[Contribution, int], Outcome]


@dataclass(frozen=True)
class RoundSnapshot:
    """What the announcer publishes of the round machine, as of one moment."""

    state: str  # syncing, training, averaging, offline
    tokens_in_round: int  # tokens trained toward the round we count toward (see Rounds.counting_round)
    in_flight_tokens: Optional[int]  # overlap: tokens of the contribution whose average is in flight
    attempt: int  # the attempt of our round we take part in (peers that failed together retry together)
    steps_in_round: int


@dataclass
class _Exclusions:
    """Peers left out of one round: `rejected` sent bad data (out until the round is over), `unresponsive` did
    not deliver in the last attempt (not waited for in the next one only: a slow peer is welcome back)."""

    round_no: int = -1
    rejected: set[str] = field(default_factory=set)
    unresponsive: set[str] = field(default_factory=set)


class Rounds:
    """The outer-round state machine of one peer (see the module docstring).

    The averaging itself (matchmaking and all-reduce) is the `reduce(contribution, attempt) -> Outcome` handed
    to `hand_in`; it runs on the calling thread, or on a background thread when `overlap` is set.
    """

    def __init__(self, *, overlap: bool, tokens_per_round: int,
                 steps_per_round: Union[None, int, Callable[[], Optional[int]]], retry_tokens: int,
                 clock: Callable[[], float] = time.monotonic):
        self.overlap = overlap
        self.tokens_per_round = tokens_per_round
        # A fixed inner step count per round instead of the swarm's tokens: a number, or a function of nothing that
        # gives the count of the round we train toward (Streaming DiLoCo's syncs differ by a step), or None.
        self.steps_per_round = steps_per_round
        self.retry_tokens = retry_tokens  # tokens to train after a failed round before trying again
        self.clock = clock
        self._lock = threading.RLock()
        self.state = "syncing"
        self.tokens_in_round = self.steps_in_round = 0
        self.in_flight_tokens: Optional[int] = None
        self.attempt = 0  # announced: the attempt of the round in progress
        self.next_attempt = 0  # where the next try of this round starts
        self.retry_after_tokens = 0
        self.resync_after = 0.0  # monotonic time before which no state download (or replay) is tried again
        self.rounds_done = 0
        self.round_started = clock()
        self._pending: Optional[tuple[concurrent.futures.Future, Contribution]] = None
        self._background: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._exclusions = _Exclusions()

    # ---- read by other threads -------------------------------------------------------------------------------
    def snapshot(self) -> RoundSnapshot:
        with self._lock:
            return RoundSnapshot(self.state, self.tokens_in_round, self.in_flight_tokens, self.attempt,
                                 self.steps_in_round)

    def counting_round(self, global_round: int) -> int:
        """The round our tokens_in_round count toward: with overlap, the next one as soon as this round's
        contribution went to the background all-reduce (its tokens are announced apart, so peers still collecting
        this round count them, and peers past it do not count them twice)."""
        with self._lock:
            return global_round + (self.in_flight_tokens is not None)

    def set_state(self, state: str) -> None:
        with self._lock:
            self.state = state

    # ---- training thread -------------------------------------------------------------------------------------
    def trained(self, tokens: int) -> None:
        """An inner step added `tokens` to the round."""
        with self._lock:
            self.tokens_in_round += tokens
            self.steps_in_round += 1

    def due(self, swarm_tokens: int, handed_in: bool, upstream_done: bool = False) -> bool:
        """Whether to hand in a contribution now: the swarm's tokens toward our round reached the recipe's (or
        another peer already handed its in, so its view reached them, and ours reached HANDED_IN_SHARE of them: a
        record saying "averaging" is its writer's word, and one liar could otherwise end every round after one
        inner step), or the recipe's fixed step count; never before the tokens a failed round asks us to train
        first. A serving stage whose stage before is done with our round (`upstream_done`, by most of its peers'
        word: pipeline/part.py, behind) gets no more microbatches of it: its round is due with what it has, even
        nothing (a contribution of weight 0 still takes the group's average; waiting for tokens that never come
        left such a peer in its round for good once its stage's other peers averaged without it)."""
        steps = self.steps_per_round() if callable(self.steps_per_round) else self.steps_per_round
        if steps:
            due = self.steps_in_round >= steps
        else:
            due = upstream_done or swarm_tokens >= self.tokens_per_round or (
                self.tokens_in_round > 0 and handed_in and swarm_tokens >= HANDED_IN_SHARE * self.tokens_per_round)
        return due and self.tokens_in_round >= self.retry_after_tokens

    @property
    def in_flight(self) -> bool:
        return self._pending is not None

    def hand_in(self, contribution: Contribution, reduce: Reduce) -> Optional[Outcome]:
        """Average `contribution`. Without overlap, returns its outcome (state "averaging" meanwhile). With
        overlap, starts it in the background and returns None: the next round's tokens count from zero while its
        own are announced as in flight, and `poll()` or `wait()` returns the outcome."""
        if self._pending is not None:
            raise RuntimeError("an average is already in flight: wait() for it before handing in another")
        if self.overlap:
            with self._lock:
                self.tokens_in_round = self.steps_in_round = 0
                self.in_flight_tokens = contribution.weight
            if self._background is None:
                self._background = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="averaging")
            self._pending = (self._background.submit(reduce, contribution, self.next_attempt), contribution)
            return None
        self.set_state("averaging")
        try:
            return reduce(contribution, self.next_attempt)
        finally:
            self.set_state("training")  # before the new round is announced: "averaging" it would make it due

    def poll(self) -> Optional[Outcome]:
        """The outcome of the average in flight once it is done, else None."""
        if self._pending is None or not self._pending[0].done():
            return None
        return self.wait()

    def wait(self, due: bool = False) -> Optional[Outcome]:
        """Block until the average in flight is done and return its outcome (None if there is none). `due`: our
        next round came due meanwhile, and the time waited (not computing) is said."""
        if self._pending is None:
            return None
        future, contribution = self._pending
        self._pending, waited = None, self.clock()
        try:
            return future.result()
        except Exception:  # noqa: BLE001 - a bug in the averaging must not lose the round's tokens
            logger.exception("round %d: averaging raised", contribution.round_no)
            return NotAveraged(contribution, self.next_attempt)
        finally:
            if due:
                logger.info("round due while the last average was in flight: waited %.2f s for it",
                            self.clock() - waited)

    def start_training(self) -> None:
        with self._lock:
            self.state = "training"
            self.round_started = self.clock()

    def landed(self, outcome: Averaged) -> float:
        """The outcome's average was applied (the outer step moved our round): a new round starts at attempt 0.
        The attempt we announce is read as the one of our announced round, and a stale one made every later round
        follow it (and so never average along a ring again). Returns the seconds the round took."""
        with self._lock:
            seconds = self.clock() - self.round_started
            self.in_flight_tokens = None  # our tokens since count toward the round we are now in
            if outcome.contribution.snapshot is None:
                self.tokens_in_round = self.steps_in_round = 0
            self.next_attempt = self.retry_after_tokens = self.attempt = 0
            self.rounds_done += 1
            self.round_started = self.clock()
            return seconds

    def failed(self, outcome: NotAveraged) -> None:
        """Arrange the retry of a round that was not averaged: the next attempt number, the handed-in tokens back
        into the round (they are still in our local params, so in the next contribution), and some training
        before the next try, so a lonely swarm does not spin on matchmaking."""
        with self._lock:
            self.next_attempt = outcome.attempt + (0 if outcome.alone else 1)
            if outcome.contribution.snapshot is not None:
                self.in_flight_tokens = None
                self.tokens_in_round += outcome.contribution.weight
            self.retry_after_tokens = self.tokens_in_round + self.retry_tokens

    def dropped(self) -> None:
        """Local progress is gone (diverged, or replaced by the swarm's state): the round counts from zero."""
        with self._lock:
            self.tokens_in_round = self.steps_in_round = 0

    def leave_round(self) -> None:
        """We re-sync to a newer round: an average in flight belongs to a round we leave, its outcome is moot."""
        with self._lock:
            self._pending = None
            self.in_flight_tokens = None

    def resync_due(self) -> bool:
        return self.clock() >= self.resync_after

    def resynced(self) -> None:
        """Our state is now the swarm's: a fresh round, attempts from 0."""
        with self._lock:
            self.dropped()
            self.next_attempt = self.retry_after_tokens = self.attempt = 0

    def resync_failed(self, moved_on: bool) -> None:
        """Holders that moved on answered at once and will serve their newer state: ask again soon. Others failed
        us: do not hammer them."""
        self.resync_after = self.clock() + (RESYNC_RETRY if moved_on else RESYNC_BACKOFF)

    def close(self) -> None:
        if self._background is not None:
            self._background.shutdown(wait=False)

    # ---- averaging thread: attempts and exclusions -------------------------------------------------------------
    def begin_attempt(self, round_no: int, attempt: int, announced: list[int]) -> int:
        """Start an attempt at `round_no`: peers that failed this round together retry together, so follow the
        highest attempt number announced for it. Exclusions of an earlier round are forgotten."""
        with self._lock:
            if self._exclusions.round_no != round_no:
                self._exclusions = _Exclusions(round_no)
            self.attempt = max([attempt] + announced)
            return self.attempt

    def excluded(self, round_no: int) -> tuple[set[str], set[str]]:
        """(peers that sent bad data this round, peers that did not deliver in its last attempt)."""
        with self._lock:
            if self._exclusions.round_no != round_no:
                return set(), set()
            return set(self._exclusions.rejected), set(self._exclusions.unresponsive)

    def failed_peers(self, round_no: int) -> set[str]:
        rejected, unresponsive = self.excluded(round_no)
        return rejected | unresponsive

    def attempt_failed(self, round_no: int, reason: str, suspects: set[str], rejected: set[str],
                       retries: int) -> bool:
        """Record an all-reduce that failed (`retries` failures so far in this hand-in, this one included); True
        to redo the round at once with a new attempt number: a member failed mid-round (it is left out) or views
        differed (a conflict). Otherwise, or after MAX_IMMEDIATE_RETRIES, train on and try later."""
        with self._lock:
            if self._exclusions.round_no != round_no:
                self._exclusions = _Exclusions(round_no)
            self._exclusions.rejected |= rejected
            self._exclusions.unresponsive = set(suspects)
        if not (suspects | rejected) and reason not in ("conflict", "unverified"):
            return False  # (an unverified average whose blame we cannot place: its culprits' accusations part them)
        return retries <= MAX_IMMEDIATE_RETRIES
