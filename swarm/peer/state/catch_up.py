"""Reaching the swarm's state: after start-up (when the swarm holds a newer round, or other params at ours) and
whenever the swarm's round passes ours. The state is replayed from ours where a live peer still logs the rounds
since, else downloaded (swarm/peer/state/sync.py); a failed try is retried after the round machine's back-off.
"""

from __future__ import annotations

import concurrent.futures
import logging
from typing import Callable

from swarm.peer.state.sync import StateSyncError, sync_deadline, sync_state

logger = logging.getLogger("swarm.peer")


class CatchUp:
    """Brings one peer's DiLoCo state to the swarm's reference; `on_synced()` drops what the peer's local progress
    owed the old state (error feedback, inner optimizer)."""

    def __init__(self, *, loop, node, run_id: str, diloco, rounds, announcer, metrics, events,
                 on_synced: Callable[[], None]):
        self.loop, self.node, self.run_id, self.diloco = loop, node, run_id, diloco
        self.rounds, self.announcer, self.metrics, self.events = rounds, announcer, metrics, events
        self.on_synced = on_synced

    def join(self) -> None:
        """At start-up: take the swarm's state if it is newer than ours, or other params at our round."""
        reference = self.announcer.swarm_reference()
        if reference.holders and (self.diloco.round < reference.round or (
                self.diloco.round == reference.round and reference.digest != self.diloco.digest())):
            self.resync(reference.holders, reference.digest, reason="joining")

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
        (keeping our own state) if no holder could, and then no other try before the round machine allows."""
        self.rounds.set_state("syncing")
        deadline = sync_deadline(8 * self.diloco.numel)  # params and outer momentum, fp32
        try:
            synced = self.loop.run(sync_state(self.node, holders, self.run_id, self.diloco, digest), deadline,
                                   interruptible=True)
        except (StateSyncError, TimeoutError, concurrent.futures.CancelledError) as e:
            moved_on = getattr(e, "moved_on", False)
            if isinstance(e, TimeoutError):
                e = StateSyncError(f"the state sync took longer than its deadline ({deadline:.0f} s)")
            elif isinstance(e, concurrent.futures.CancelledError):
                e = StateSyncError("the state sync was interrupted by the stop")
            self.rounds.resync_failed(moved_on)
            logger.warning("%s; continuing with my own state", e)
            self.events.emit("sync_failed", error=str(e), moved_on=moved_on, reason=reason)
            return False
        how = "replay" if synced.replayed is not None else "download"
        self.metrics.resyncs.labels(how=how).inc()
        self.metrics.resync_bytes.labels(how=how).inc(synced.bytes)
        self.rounds.resynced()
        self.on_synced()
        logger.info("%s (%s)", synced.describe(self.diloco), reason)
        self.events.emit("synced", round=self.diloco.round, digest=self.diloco.digest(), how=how, reason=reason,
                         replayed=synced.replayed.steps if synced.replayed is not None else 0, bytes=synced.bytes)
        return True
