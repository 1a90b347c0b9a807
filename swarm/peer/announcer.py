"""The peer's heartbeat: re-publish its announcement with an expiry, read everyone else's into a validated
swarm view (from which the trainer reads global progress), and announce OFFLINE on shutdown."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Callable

from swarm.config import Recipe, RecipeError, recipe_from_json
from swarm.dht.node import SwarmNode
from swarm.dht.records import RECIPE_KEY, PeerRecord, parse_peer_records, peers_key
from swarm.monitoring.metrics import PeerMetrics
from swarm.runtime import LoopThread

logger = logging.getLogger(__name__)
RECORD_TTL = 45.0  # a peer that vanishes leaves the swarm view within this many seconds
INTERVAL = 1.0  # progress is read from the view, so it must stay fresh


class Announcer:
    def __init__(self, node: SwarmNode, run_id: str, n_blocks: int, record: Callable[[], PeerRecord],
                 metrics: PeerMetrics):
        self.node, self.key, self.n_blocks, self.record, self.metrics = node, peers_key(run_id), n_blocks, \
            record, metrics
        self.view: list[PeerRecord] = []

    async def refresh(self) -> None:
        await self.node.store(self.key, self.record().to_wire(), ttl=RECORD_TTL, subkey=self.node.peer_id)
        records, rejected = parse_peer_records(await self.node.get(self.key), self.n_blocks)
        if rejected:
            self.metrics.invalid_records.inc(rejected)
        self.view = records

    def refresh_now(self, loop: LoopThread) -> None:
        """Publish our record and re-read the view before returning (used at state changes)."""
        try:
            loop.run(self.refresh(), timeout=10)
        except Exception as e:  # noqa: BLE001 - the heartbeat retries; a missed refresh is not fatal
            logger.debug("announcement refresh failed: %r", e)

    async def run(self) -> None:
        while True:
            try:
                await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - keep the heartbeat alive through transient DHT errors
                logger.debug("heartbeat failed: %r", e)
            await asyncio.sleep(INTERVAL * random.uniform(0.8, 1.2))  # jitter: peers do not pulse together

    async def announce_offline(self) -> None:
        record = self.record()
        await self.node.store(self.key, record.to_wire(), ttl=RECORD_TTL, subkey=self.node.peer_id)

    def swarm_progress(self, round_no: int, my_tokens: int) -> int:
        """Tokens the swarm processed in `round_no`: ours (live) plus what the other peers announced."""
        others = sum(p.tokens_in_round for p in self.view if p.round == round_no and p.peer_id != self.node.peer_id
                     and p.state in ("training", "averaging"))
        return my_tokens + others

    def attempts(self, round_no: int) -> list[int]:
        return [p.attempt for p in self.view if p.round == round_no and p.state == "averaging"]


async def fetch_recipe(node: SwarmNode, timeout: float) -> Recipe:
    """The run recipe the bootstrap published; RecipeError if none appears within `timeout` or it is invalid."""
    deadline = time.monotonic() + timeout
    while True:
        found = (await node.get(RECIPE_KEY)).get("")
        if isinstance(found, dict) and isinstance(found.get("json"), str):
            recipe = recipe_from_json(found["json"])
            if recipe.digest() != found.get("digest"):
                raise RecipeError("the swarm's recipe does not match its published hash; ask the run host")
            return recipe
        if time.monotonic() >= deadline:
            raise RecipeError("found no run recipe in the DHT: is --initial-peers a `swarm-peer bootstrap` node "
                              "of this run?")
        await asyncio.sleep(1.0)


async def publish_recipe(node: SwarmNode, recipe: Recipe, ttl: float) -> None:
    await node.store(RECIPE_KEY, {"json": recipe.canonical_json(), "digest": recipe.digest()}, ttl=ttl)
