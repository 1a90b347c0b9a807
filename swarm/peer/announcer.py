"""The peer's heartbeat: re-publish its announcement (under its own signed subkey) with an expiry, read everyone
else's into a validated swarm view (from which the trainer reads global progress and picks its blocks), and
announce OFFLINE on shutdown. Also publishing and fetching the run owner's signed recipe."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from typing import Callable

from swarm.config import Recipe, RecipeError
from swarm.dht.node import SwarmNode
from swarm.dht.records import (RECIPE_KEY, PeerRecord, choose_recipe, parse_peer_records, parse_recipes, peers_key,
                               protected_keys, recipe_value)
from swarm.monitoring.metrics import PeerMetrics
from swarm.peer.block_selection import choose_block_range
from swarm.runtime import LoopThread

logger = logging.getLogger(__name__)
RECORD_TTL = 45.0  # a peer that vanishes leaves the swarm view within this many seconds
INTERVAL = 1.0  # progress is read from the view, so it must stay fresh
EXTRAPOLATE_SECONDS = 3 * INTERVAL  # how far ahead of its last announcement another peer's progress is estimated
FRESH_SECONDS = 5 * INTERVAL  # a record older than this is from a peer whose heartbeat stopped


class Announcer:
    def __init__(self, node: SwarmNode, run_id: str, n_blocks: int, record: Callable[[], PeerRecord],
                 metrics: PeerMetrics):
        self.node, self.key, self.n_blocks, self.record, self.metrics = node, peers_key(run_id), n_blocks, \
            record, metrics
        self.view: list[PeerRecord] = []

    async def refresh(self) -> None:
        await self.node.store(self.key, self.record().to_wire(), ttl=RECORD_TTL, subkey=self.node.owned_subkey)
        await self.read_view()

    async def read_view(self) -> list[PeerRecord]:
        records, rejected = parse_peer_records(await self.node.get(self.key), self.n_blocks)
        if rejected:
            self.metrics.invalid_records.inc(rejected)
        self.view = records
        return records

    async def choose_blocks(self, capacity: int) -> tuple[int, int]:
        """The block range [start, end) to host: where the swarm (without us) has the least throughput."""
        others = [p for p in await self.read_view() if p.peer_id != self.node.peer_id]
        return choose_block_range(others, self.n_blocks, capacity)

    def refresh_now(self, loop: LoopThread) -> None:
        """Publish our record and re-read the view before returning (used at state changes)."""
        try:
            loop.run(self.refresh(), timeout=10)
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
            await asyncio.sleep(INTERVAL * random.uniform(0.8, 1.2))  # jitter: peers do not pulse together

    async def announce_offline(self) -> None:
        record = self.record()
        await self.node.store(self.key, record.to_wire(), ttl=RECORD_TTL, subkey=self.node.owned_subkey)

    def swarm_progress(self, round_no: int, my_tokens: int, now: float | None = None) -> int:
        """Tokens the swarm processed toward the contributions of round `round_no`: ours (live) plus the other
        peers', each extrapolated from its last announcement at its announced speed while it is training (at most
        EXTRAPOLATE_SECONDS ahead). With overlap, a peer whose contribution of `round_no` is in flight counts with
        the tokens it handed in, and its tokens since count toward the round after.

        Announcements are up to a heartbeat or two old: read as they are, a swarm of fast peers reaches the round's
        tokens in one peer's view seconds before another's, and the first peer then waits that long in matchmaking
        for the last."""
        now = self.node.now() if now is None else now
        others = 0.0
        for p in self.view:
            if p.peer_id == self.node.peer_id or p.state not in ("training", "averaging"):
                continue
            if p.in_flight_tokens is not None and p.round == round_no:
                others += p.in_flight_tokens
                continue
            if p.counting_round != round_no:
                continue
            others += p.tokens_in_round
            if p.state == "training":
                others += p.tokens_per_s * min(max(now - p.updated, 0.0), EXTRAPOLATE_SECONDS)
        return my_tokens + int(others)

    def handed_in(self, round_no: int, now: float | None = None) -> bool:
        """Whether another live peer already handed in its contribution of `round_no` (it is averaging it, or
        with overlap has it in flight): its view of the swarm reached the round's tokens, so the round is due here
        too. Without this, each peer kept training until its own view (read once a heartbeat) caught up, and
        rounds without overlap carried 10-16% more tokens than the target."""
        return any(p.round == round_no and (p.state == "averaging" or p.in_flight_tokens is not None)
                   for p in self.live(now=now))

    def in_round(self, round_no: int, now: float | None = None) -> list[PeerRecord]:
        """Live peers that take part in `round_no`: at that round, or (with overlap) training toward it while
        their contribution of the round before is in flight. Matchmaking waits for these; a peer with an average
        in flight enters the next round's matchmaking only once that average landed, and counting it out (by its
        record's round alone) let groups form without it: at 20 Mbit/s, two peers of four sat out a round and
        re-synced, at 65% utilisation instead of 95%."""
        return [p for p in self.live(("training", "averaging", "syncing"), now=now)
                if p.takes_part_in(round_no)]

    def live(self, states: tuple[str, ...] = ("training", "averaging"), now: float | None = None) -> list[PeerRecord]:
        """Other peers in one of `states` whose heartbeat is fresh (a crashed peer's record lingers until it
        expires; a few missed heartbeats are enough to stop counting on it)."""
        fresh_after = (self.node.now() if now is None else now) - FRESH_SECONDS
        return [p for p in self.view if p.peer_id != self.node.peer_id and p.updated >= fresh_after
                and p.state in states]

    def swarm_reference(self) -> tuple[int, str, list[str]]:
        """(highest round of live peers, the digest most of them hold, the peers holding it that serve it). A peer
        whose heartbeat stopped (its record lingers until it expires) is not live: it can serve nothing. A client
        peer (it accepts no streams) counts toward the majority but is no holder to ask."""
        live = [p for p in self.live() if p.digest]
        if not live:
            return 0, "", []
        top = max(p.round for p in live)
        at_top = [p for p in live if p.round == top]
        counts = Counter(p.digest for p in at_top)
        digest = min(counts, key=lambda d: (-counts[d], d))
        return top, digest, [p.peer_id for p in at_top if p.digest == digest and not p.client]

    def others_still_in(self, round_no: int, failed: set[str], min_group_size: int, target_group_size: int) -> bool:
        """Whether `round_no` can still be averaged here although some group already finished it: the swarm
        averages in several groups (more live peers than a group holds) and enough peers are still at this round
        to form one. A lone straggler of a single-group swarm re-syncs instead. Peers in `failed` (they just failed
        to deliver in this round) do not count: a member SIGKILLed mid-round keeps a fresh-looking record for a few
        seconds, and its partner would wait a whole matchmaking timeout for it instead of re-syncing at once."""
        live = [p for p in self.live() if p.round >= round_no and p.peer_id not in failed]
        return len(live) + 1 > target_group_size and \
            sum(p.takes_part_in(round_no) for p in live) + 1 >= max(min_group_size, 2)

    def attempts(self, round_no: int) -> list[int]:
        return [p.attempt for p in self.view if p.round == round_no and p.state in ("training", "averaging")]


async def fetch_recipe(node: SwarmNode, timeout: float) -> Recipe:
    """The run recipe, as its owner signed it: the owner among our --initial-peers, or the only one published
    (see records.choose_recipe). RecipeError if none appears within `timeout`, or it is invalid or ambiguous.
    From then on this node protects the run's keys."""
    deadline = time.monotonic() + timeout
    while True:
        recipes, problems = parse_recipes(await node.get(RECIPE_KEY))
        chosen = choose_recipe(recipes, problems, node.initial_peer_ids)
        if chosen is not None:
            owner, recipe = chosen
            if owner not in node.initial_peer_ids:
                logger.info("following the recipe of %s, the only run owner in the DHT (not one of "
                            "--initial-peers)", owner)
            node.protect(protected_keys(recipe.run_id))
            return recipe
        if time.monotonic() >= deadline:
            raise RecipeError("found no run recipe in the DHT: is --initial-peers a `swarm-peer bootstrap` node "
                              "of this run?")
        await asyncio.sleep(1.0)


async def publish_recipe(node: SwarmNode, recipe: Recipe, ttl: float) -> None:
    """Publish the recipe under our owned subkey: this node becomes the run owner (peers trust it by peer id)."""
    node.protect(protected_keys(recipe.run_id))
    await node.store(RECIPE_KEY, recipe_value(recipe), ttl=ttl, subkey=node.owned_subkey)
