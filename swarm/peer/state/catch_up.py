"""Reaching the swarm's state: after start-up (when the swarm holds a newer round, or other params at ours) and
whenever the swarm's round passes ours. The state is replayed from ours where a live peer still logs the rounds
since, else downloaded (swarm/peer/state/sync.py); a failed try is retried after the round machine's back-off.
"""

from __future__ import annotations

import concurrent.futures
import logging
from typing import Callable, Optional

from swarm.dht.view import Reference
from swarm.peer.state.sync import StateSyncError, sync_deadline, sync_state

logger = logging.getLogger("swarm.peer")
MOVED_ON_TRIES = 4  # tries of one sync whose holders moved on (each after a fresh read of the view)


class CatchUp:
    """Brings one peer's DiLoCo state to the swarm's reference; `on_synced()` drops what the peer's local progress
    owed the old state (error feedback, inner optimizer)."""

    def __init__(self, *, loop, node, run_id: str, diloco, rounds, announcer, metrics, events,
                 on_synced: Callable[[], None], kept: Optional[Callable[[], Reference]] = None):
        self.loop, self.node, self.run_id, self.diloco = loop, node, run_id, diloco
        self.rounds, self.announcer, self.metrics, self.events = rounds, announcer, metrics, events
        self.on_synced, self.kept = on_synced, kept

    def join(self) -> None:
        """At start-up: take the swarm's state if it is newer than ours, or other params at our round. A pipeline
        stage that no other live peer trains (all its hosts left), or whose state we could not take from them, takes
        the state its keepers vouch for (`kept`, swarm/peer/pipeline/keeper.py) where that is newer than ours."""
        reference = self.announcer.swarm_reference()
        if reference.holders and (self.diloco.round < reference.round or (
                self.diloco.round == reference.round and reference.digest != self.diloco.digest())):
            if self.resync(reference.holders, reference.digest, reason="joining"):
                return
        elif reference.holders or self.announcer.live():
            return  # we hold the swarm's state, or our stage's peers train on one we do not follow (yet)
        kept = self.kept() if self.kept is not None else None
        if kept is not None and kept.holders and kept.round > self.diloco.round:
            logger.info("taking the state of round %d that our stage's keepers hold", kept.round)
            self.resync(kept.holders, kept.digest, reason="the stage's backup")

    def behind(self) -> bool:
        """While training: re-sync if the swarm is at a newer round than ours (unless a failed try asks us to
        train on first); True if we tried."""
        reference = self.announcer.swarm_reference()
        if not (reference.round > self.diloco.round and reference.holders and self.rounds.resync_due()):
            return False
        logger.info("the swarm is at round %d and I am at %d: re-syncing", reference.round, self.diloco.round)
        self.rounds.leave_round()
        self.resync(reference.holders, reference.digest, reason="behind the swarm")
        self.rounds.set_state("training")  # (on failure: train on until the round machine allows another try)
        return True

    def resync(self, holders: list[str], digest: str, reason: str) -> bool:
        """Bring our state to the swarm's (state digest `digest`, held by `holders`; see sync_state); False
        (keeping our own state) if no holder could, and then no other try before the round machine allows.

        Holders that answered with a newer state (the swarm took a round while we read its announcements: in a
        swarm of short rounds, every time) are asked again at once for the state the view vouches for now, up to
        MOVED_ON_TRIES times: a joiner that waited a second between tries could stay a round behind for good."""
        self.diloco.settle()  # (the replay, on the event loop, reads our digest: never wait for it there)
        self.rounds.set_state("syncing")
        deadline = sync_deadline(8 * self.diloco.numel)  # params and outer momentum, fp32
        for tries_left in range(MOVED_ON_TRIES - 1, -1, -1):
            try:
                synced = self.loop.run(sync_state(self.node, holders, self.run_id, self.diloco, digest), deadline,
                                       interruptible=True)
                break
            except StateSyncError as e:
                newer = self._moved_to(digest) if e.moved_on and tries_left else None
                if newer is None:
                    return self._failed(e, reason)
                holders, digest = newer
            except TimeoutError:
                return self._failed(StateSyncError(f"the state sync took longer than its deadline ({deadline:.0f} s)"),
                                    reason)
            except concurrent.futures.CancelledError:
                return self._failed(StateSyncError("the state sync was interrupted by the stop"), reason)
        how = "replay" if synced.replayed is not None else "download"
        self.metrics.resyncs.labels(how=how).inc()
        self.metrics.resync_bytes.labels(how=how).inc(synced.bytes)
        self.rounds.resynced()
        self.on_synced()
        logger.info("%s (%s)", synced.describe(self.diloco), reason)
        self.events.emit("synced", round=self.diloco.round, digest=self.diloco.digest(), how=how, reason=reason,
                         replayed=synced.replayed.steps if synced.replayed is not None else 0, bytes=synced.bytes)
        return True

    def _moved_to(self, old_digest: str) -> Optional[tuple[list[str], str]]:
        """(holders, digest) of the swarm's reference as the view reads it now, if that is another state than
        `old_digest` and newer than ours (the same rules of whom to follow as any reference: swarm/dht/view.py)."""
        try:
            self.loop.run(self.announcer.read_view(), timeout=10, interruptible=True)
        except (TimeoutError, concurrent.futures.CancelledError, RuntimeError):
            return None
        reference = self.announcer.swarm_reference()
        if reference.holders and reference.digest != old_digest and reference.round >= self.diloco.round:
            return reference.holders, reference.digest
        return None

    def _failed(self, e: StateSyncError, reason: str) -> bool:
        self.rounds.resync_failed(e.moved_on)
        logger.warning("%s; continuing with my own state", e)
        self.events.emit("sync_failed", error=str(e), moved_on=e.moved_on, reason=reason)
        return False
