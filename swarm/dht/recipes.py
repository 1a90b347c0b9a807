"""The run owner's recipe in the DHT: the bootstrap publishes it under its owned subkey, and every peer (and the
status command) fetches the one its --initial-peers signed, from which the node protects the run's keys."""

from __future__ import annotations

import asyncio
import logging
import time

from swarm.config import Recipe, RecipeError
from swarm.dht.node import SwarmNode
from swarm.dht.records import RECIPE_KEY, choose_recipe, parse_recipes, protected_keys, recipe_value

logger = logging.getLogger(__name__)


TRUSTED_WAIT = 10.0  # s to wait for our --initial-peers' recipe before following a lone one of another owner


async def fetch_recipe(node: SwarmNode, timeout: float, trusted_wait: float = TRUSTED_WAIT) -> Recipe:
    """The run recipe, as its owner signed it: the owner among our --initial-peers, or, once none of them has
    published one for `trusted_wait` seconds (they may be ordinary peers, not the bootstrap), the only one
    published (see records.choose_recipe): anyone can publish a recipe, so a lone one is not followed at once.
    RecipeError if none appears within `timeout`, or it is invalid or ambiguous. From then on this node protects
    the run's keys."""
    started = time.monotonic()
    deadline = started + timeout
    while True:
        recipes, problems = parse_recipes(await node.get(RECIPE_KEY))
        chosen = choose_recipe(recipes, problems, node.initial_peer_ids,
                               accept_untrusted=time.monotonic() - started >= min(trusted_wait, timeout / 2))
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
