"""The peer's heartbeat: re-publish its announcement (under its own signed subkey) with an expiry, read everyone
else's into a validated swarm view (from which the trainer reads global progress and picks its blocks), and
announce OFFLINE on shutdown. The readings of that view are swarm/dht/view.py's, at the DHT's time."""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Callable, Sequence

from swarm.dht import view
from swarm.dht.node import SwarmNode
from swarm.dht.records import TRAINING_STATES, PeerRecord, parse_peer_records, peers_key
from swarm.dht.view import HEARTBEAT_SECONDS, Reference
from swarm.monitoring.metrics import PeerMetrics
from swarm.runtime import LoopThread

logger = logging.getLogger(__name__)
RECORD_TTL = 45.0  # a peer that vanishes leaves the swarm view within this many seconds


class Announcer:
    def __init__(self, node: SwarmNode, run_id: str, n_blocks: int, record: Callable[[], PeerRecord],
                 metrics: PeerMetrics):
        self.node, self.key, self.n_blocks, self.record, self.metrics = node, peers_key(run_id), n_blocks, \
            record, metrics
        self.view: list[PeerRecord] = []
        self.last_group_size = 0  # members of the last group we averaged in (0: none yet)
        # The others of that group, if it was the swarm's only group: a majority of them must hold any state we
        # follow (view.anchored); none yet, or after a round of several groups (Moshpit-style), whose members
        # hold different states by design.
        self.last_group: frozenset[str] = frozenset()

    async def refresh(self) -> None:
        await self.node.store(self.key, self.record().to_wire(), ttl=RECORD_TTL, subkey=self.node.owned_subkey)
        await self.read_view()

    async def read_view(self) -> list[PeerRecord]:
        records, rejected = parse_peer_records(await self.node.get(self.key), self.n_blocks)
        if rejected:
            self.metrics.invalid_records.inc(rejected)
        self.view = records
        return records

    def refresh_now(self, loop: LoopThread) -> None:
        """Publish our record and re-read the view before returning (used at state changes)."""
        try:
            loop.run(self.refresh(), timeout=10, interruptible=True)  # (longer than a stop allows)
        except Exception as e:  # noqa: BLE001 - the heartbeat retries; a missed refresh is not fatal
            logger.debug("announcement refresh failed: %r", e)

    def refresh_soon(self, loop: LoopThread) -> None:
        """Publish our record and re-read the view in the background."""
        loop.submit(self._refresh_quietly())

    async def _refresh_quietly(self) -> None:
        try:
            await self.refresh()
        except Exception as e:  # noqa: BLE001 - the heartbeat retries; a missed refresh is not fatal
            logger.debug("announcement refresh failed: %r", e)

    async def run(self) -> None:
        while True:
            try:
                for peer_id in await self.node.rejoin():
                    logger.info("reconnected to initial peer %s", peer_id)
                await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - keep the heartbeat alive through transient DHT errors
                logger.debug("heartbeat failed: %r", e)
            await asyncio.sleep(HEARTBEAT_SECONDS * random.uniform(0.8, 1.2))  # jitter: peers do not pulse together

    async def announce_offline(self) -> None:
        record = self.record()
        await self.node.store(self.key, record.to_wire(), ttl=RECORD_TTL, subkey=self.node.owned_subkey)

    # Readings of the view (see swarm/dht/view.py): of the other peers' records, at the DHT's time unless `now`.
    def others(self) -> list[PeerRecord]:
        """The other peers' records: our own numbers are read live, not as we last announced them."""
        return view.others(self.view, self.node.peer_id)

    def _now(self, now: float | None) -> float:
        return self.node.now() if now is None else now

    def swarm_progress(self, round_no: int, my_tokens: int, now: float | None = None) -> int:
        return view.swarm_progress(self.others(), round_no, my_tokens, self._now(now))

    def handed_in(self, round_no: int, now: float | None = None) -> bool:
        return view.handed_in(self.others(), round_no, self._now(now))

    def in_round(self, round_no: int, now: float | None = None) -> list[PeerRecord]:
        return view.in_round(self.others(), round_no, self._now(now))

    def live(self, states: tuple[str, ...] = TRAINING_STATES, now: float | None = None) -> list[PeerRecord]:
        return view.live(self.others(), self._now(now), states)

    def averaged_with(self, members: Sequence[str], swarm_size: int) -> None:
        """We averaged a round in a group of `members`, split from `swarm_size` candidates (the leader's count)."""
        self.last_group_size = len(members)
        self.last_group = frozenset(members) - {self.node.peer_id} if swarm_size <= len(members) else frozenset()

    def swarm_reference(self) -> Reference:
        """The state to follow: vouched for by a quorum of live peers (view.quorum of `last_group_size`, the size
        of the last group we averaged in) and by a majority of that group's other members (view.anchored); before
        we averaged at all, the state most live peers announce (view.joiner_reference)."""
        others, now = self.others(), self.node.now()
        if not self.last_group_size:
            return view.joiner_reference(others, now)
        quorum = view.quorum(self.last_group_size, view.vouchers(others, now))
        return view.reference(others, now, quorum, view.anchored(others, now, self.last_group))

    def others_still_in(self, round_no: int, failed: set[str], min_group_size: int, target_group_size: int) -> bool:
        return view.others_still_in(self.others(), round_no, self.node.now(), failed, min_group_size,
                                    target_group_size)

    def attempts(self, round_no: int) -> list[int]:
        return view.attempts(self.view, round_no)  # our own record too: our last announced attempt counts
