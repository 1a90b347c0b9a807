"""The averaging of one contribution: matchmaking and the group all-reduce, retried at once without members that
failed, and the estimate of our link that matchmaking uses for the reduction shares. It touches no model state,
so it may run on a background thread; what it decides about attempts and exclusions lives in `Rounds`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from swarm.averaging.allreduce import AllReduceError
from swarm.averaging.matchmaking import Candidate, form_group
from swarm.events import EventLog
from swarm.peer.rounds import Averaged, Contribution, NotAveraged, Outcome, Rounds
from swarm.words import counted

logger = logging.getLogger("swarm.peer")
DEFAULT_BANDWIDTH = 12.5e6  # bytes/s (100 Mbit/s) until the first all-reduce measures the real link
MAX_NO_SHOWS = 1024  # peers a peer remembers as no-shows (see Averager.no_shows): Sybil records are many


@dataclass
class LinkEstimate:
    """What we tell matchmaking about our link (for the reduction shares), refined by every all-reduce: what it
    moved per second is a lower bound on the link."""

    bandwidth: float = DEFAULT_BANDWIDTH  # bytes/s, both ways together
    up: float = 0.0  # bytes/s sent in the last all-reduce (announced)
    down: float = 0.0

    def update(self, bytes_sent: int, bytes_received: int, seconds: float) -> None:
        if seconds > 0 and bytes_sent:
            self.bandwidth = 0.5 * self.bandwidth + 0.5 * (bytes_sent + bytes_received) / seconds
            self.up, self.down = bytes_sent / seconds, bytes_received / seconds


class Averager:
    """Averages contributions with the swarm: `reduce` is what `Rounds.hand_in` runs.

    `flat_state()` gives our global params and outer momentum, which a mixing group (members of different
    params) averages too; `matchmaking` is matchmaking.form_group (tests hand in their own)."""

    def __init__(self, *, loop, node, recipe, allreduce, group_push, announcer, rounds: Rounds, faults, metrics,
                 link: LinkEstimate, client_mode: bool, flat_state: Callable[[], torch.Tensor], events=None,
                 matchmaking=form_group, stopping: Optional[threading.Event] = None):
        self.loop, self.node, self.recipe = loop, node, recipe
        self.allreduce, self.group_push, self.announcer = allreduce, group_push, announcer
        self.rounds, self.faults, self.metrics, self.link = rounds, faults, metrics, link
        self.client_mode = client_mode
        self.flat_state = flat_state
        self.matchmaking = matchmaking
        self.events = events if events is not None else EventLog()
        self.stopping = stopping  # set by a stop signal: no new attempt starts after it
        self._waiting_said = ""  # what the last "no group" line said, so a peer waiting alone says it once
        # peer -> matchmakings in a row it was waited for, in its round by its announcements, and never came: we
        # wait half as long for it each time (a peer that announces itself and never comes, a liar or one stuck,
        # cost every round the whole window), and the whole window again once it comes
        self.no_shows: dict[str, int] = {}

    def reduce(self, contribution: Contribution, attempt: int) -> Outcome:
        """Matchmaking and all-reduce of `contribution`, starting at `attempt`; redone at once (a new attempt)
        without members that failed mid-round, up to rounds.MAX_IMMEDIATE_RETRIES times. A stop signal cancels
        the network work: the round is then not averaged here (to the group, as if we had died)."""
        try:
            return self._reduce(contribution, attempt)
        except concurrent.futures.CancelledError:
            logger.info("round %d: averaging interrupted by the stop", contribution.round_no)
            return NotAveraged(contribution, attempt)

    def _reduce(self, contribution: Contribution, attempt: int) -> Outcome:
        round_no, retries, phases = contribution.round_no, 0, {}

        @contextlib.contextmanager
        def timed(phase: str):  # (every attempt's time counts toward its phase)
            began = time.monotonic()
            try:
                yield
            finally:
                phases[phase] = phases.get(phase, 0.0) + time.monotonic() - began

        while True:
            if self.stopping is not None and self.stopping.is_set():  # a stop that came after its cancellations
                raise concurrent.futures.CancelledError()
            if self.moved_on(round_no):
                return NotAveraged(contribution, attempt)  # the training thread re-syncs
            attempt = self.rounds.begin_attempt(round_no, attempt, self.announcer.attempts(round_no))
            with timed("announce"):
                self.announcer.refresh_now(self.loop)
            self.faults.maybe_die("matchmaking", round_no)
            with timed("matchmaking"):
                group, others_seen = self.match(contribution, attempt)
            if group is None:
                # Peers that put us in their group hear at once that we are not coming.
                self.loop.run(self.allreduce.decide(round_no, attempt, None), timeout=10, interruptible=True)
                self.metrics.averaging_failures.labels(reason="no_group").inc()
                self._say_no_group(round_no, attempt, others_seen)
                self.events.emit("no_group", round=round_no, attempt=attempt)
                return NotAveraged(contribution, attempt, alone=not others_seen)
            self._waiting_said = ""
            try:
                with timed("allreduce"):
                    result = self.run(group, contribution)
                phases["allreduce"] -= result.verification_seconds  # (its own phase: checking the reducers)
                phases["verification"] = result.verification_seconds
                return Averaged(contribution, attempt, result, group, phases)
            except (AllReduceError, TimeoutError) as e:
                reason = getattr(e, "reason", "timeout")
                self.metrics.averaging_failures.labels(reason=reason).inc()
                logger.warning("round %d: averaging failed (%s): %s", round_no, reason, e)
                self.events.emit("averaging_failed", round=round_no, attempt=attempt, reason=reason,
                                 suspects=sorted(getattr(e, "suspects", ())),
                                 rejected=sorted(getattr(e, "rejected", ())))
                retries += 1
                if not self.rounds.attempt_failed(round_no, reason, getattr(e, "suspects", set()),
                                                  getattr(e, "rejected", set()), retries):
                    return NotAveraged(contribution, attempt)
                attempt += 1  # a member failed mid-round, or views differed: redo the round at once

    def _say_no_group(self, round_no: int, attempt: int, others_seen: int) -> None:
        """Why no group formed, in one line: too few peers for averaging.min_group_size is said once (DEBUG while it
        lasts), so a peer waiting for a partner says what it waits for instead of repeating every attempt."""
        need, least_servers = self.recipe.averaging.group_bounds
        servers = self._servers_online() if self.client_mode or least_servers > 1 else None
        if self.client_mode and servers == 0:
            why = ("no peer of the swarm accepts connections: every peer online is in client mode (behind NAT or "
                   "--client-mode), so nobody can reduce the average; this peer averages as soon as one that "
                   "accepts connections joins (with a public address, a forwarded port or a router that maps ports)")
            level = logging.DEBUG if why == self._waiting_said else logging.INFO
            self._waiting_said = why
        elif servers is not None and servers + (not self.client_mode) < least_servers:
            why = (f"this run forms only groups whose reducers are checked (averaging.checked_groups), so a group "
                   f"needs {least_servers} peers that accept connections, to check each other's reductions (a "
                   f"client receives no reports), and the swarm has {servers + (not self.client_mode)}; this peer "
                   "averages once another joins (with a public address, a forwarded port or a router that maps "
                   "ports)")
            level = logging.DEBUG if why == self._waiting_said else logging.INFO
            self._waiting_said = why
        elif others_seen + 1 < need:
            why = (f"waiting for {counted(need - 1 - others_seen, 'more peer')}: this run averages in groups of at "
                   f"least {need} (averaging.min_group_size, or 3 with checked_groups) and matchmaking saw "
                   f"{counted(others_seen, 'other peer')}")
            level = logging.DEBUG if why == self._waiting_said else logging.INFO
            self._waiting_said = why
        else:
            why = f"no group formed with the {counted(others_seen, 'other peer')} matchmaking saw (attempt {attempt})"
            level, self._waiting_said = logging.INFO, ""
        logger.log(level, "round %d: %s; training on", round_no, why)

    def _servers_online(self) -> Optional[int]:
        """How many other peers training now accept connections (None: no other peer trains; ours we know)."""
        live = self.announcer.live()
        return sum(not record.client for record in live) if live else None


    def match(self, contribution: Contribution, attempt: int) -> tuple[Optional[Any], int]:
        """(the group we average with, or None; how many other peers matchmaking saw).

        We wait for the peers of this round, unless their heartbeat stopped (crashed peers' records linger until
        they expire; a few missed heartbeats are enough not to wait for them). Peers with other params come too:
        with more peers than one group holds, groups of different params mix. So do peers still starting up at
        this round (a new swarm's round 0): left out, they would only re-sync afterwards. While we wait, peers
        that leave the round are no longer waited for; once the swarm has moved on without us, we stop waiting
        and re-sync."""
        r, round_no = self.recipe.averaging, contribution.round_no
        least_members, least_servers = r.group_bounds
        rejected, unresponsive = self.rounds.excluded(round_no)
        rejected = self.faults.accusations(rejected, self.in_round(round_no), round_no)
        me_as = Candidate(contribution.digest, self.link.bandwidth, client=self.client_mode,
                          phase_timeout=self.allreduce.deadlines.measured(), weight=float(contribution.weight),
                          commitment=self.allreduce.commitment(round_no, attempt))
        # (an injected fault that rewrites what we write; named only then, so a matchmaking of a test's stays as is)
        tampering = {"tamper": self.faults.tamper} if self.faults.tampers else {}
        patience = {peer: r.matchmaking_timeout / 2 ** count for peer, count in self.no_shows.items()}
        attendance: dict[str, set[str]] = {}
        try:
            return self.loop.run(self.matchmaking(
                self.node, self.recipe.run_id, round_no, attempt, me_as, self.in_round(round_no), least_members,
                r.target_group_size, r.matchmaking_timeout, excluded=rejected, not_waiting_for=unresponsive,
                still_in=lambda: None if self.moved_on(round_no) else self.in_round(round_no),
                push=self.group_push, verified=self.allreduce.verifiable, min_servers=least_servers,
                patience=patience, attendance=attendance, **tampering),
                timeout=3 * r.matchmaking_timeout + 30, interruptible=True)
        except TimeoutError:
            return None, 1
        finally:
            self._attended(attendance)

    def _attended(self, attendance: dict[str, set[str]]) -> None:
        """Count the peers a matchmaking waited for in vain (`no_shows`), and forget those that came."""
        for peer in attendance.get("came", ()):
            self.no_shows.pop(peer, None)
        for peer in attendance.get("missed", ()):
            self.no_shows[peer] = self.no_shows.pop(peer, 0) + 1  # (re-inserted: the oldest first, for the bound)
        while len(self.no_shows) > MAX_NO_SHOWS:
            del self.no_shows[next(iter(self.no_shows))]

    def run(self, group, contribution: Contribution):
        """The all-reduce itself; a mixing group (members of different global params) also averages the params
        and outer momentum, losslessly (`exact_from`)."""
        vector, exact_from = contribution.pseudo_gradient, None
        if group.mix:
            vector, exact_from = torch.cat([vector, self.flat_state()]), vector.numel()
        return self.loop.run(self.allreduce.run(group, vector, contribution.weight, exact_from),
                             timeout=self.recipe.averaging.allreduce_timeout + 10, interruptible=True)

    def in_round(self, round_no: int) -> set[str]:
        return {p.peer_id for p in self.announcer.in_round(round_no)}

    def moved_on(self, round_no: int) -> bool:
        """Whether the swarm finished this round without us and nobody is left to average it with."""
        r = self.recipe.averaging
        return self.announcer.swarm_reference().round > round_no and not self.announcer.others_still_in(
            round_no, self.rounds.failed_peers(round_no), r.group_bounds[0], r.target_group_size)
