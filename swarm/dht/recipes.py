"""The run owner's recipe in the DHT: the bootstrap publishes it under its owned subkey, and every peer (and the
status command) fetches the one its --initial-peers signed, from which the node protects the run's keys and, for a
private run, admits only the owner's invitees (swarm/dht/admission.py)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Mapping, Optional

from swarm.config import Recipe, RecipeError
from swarm.dht.node import SwarmNode
from swarm.dht.records import (RECIPE_KEY, choose_recipe, owner_dataset, parse_recipes, protected_keys,
                               recipe_value)
from swarm.dht.validation import subkey_owner_key

logger = logging.getLogger(__name__)


TRUSTED_WAIT = 10.0  # s to wait for our --initial-peers' recipe before following a lone one of another owner
INVITES = "invites"  # the recipe record's field of invites the owner signed for its --allowlist


async def fetch_recipe(node: SwarmNode, timeout: float, trusted_wait: float = TRUSTED_WAIT) -> Recipe:
    """The run recipe (see fetch_run)."""
    recipe, _ = await fetch_run(node, timeout, trusted_wait)
    return recipe


async def fetch_run(node: SwarmNode, timeout: float,
                    trusted_wait: float = TRUSTED_WAIT) -> tuple[Recipe, Optional[str]]:
    """The run recipe, and the id of the dataset its owner shares (None if it shares none), as its owner signed it: the
    owner among our --initial-peers, or, once none of them has published one for `trusted_wait` seconds (they may be
    ordinary peers, not the bootstrap), the only one published (see records.choose_recipe): anyone can publish a recipe,
    so a lone one is not followed at once. RecipeError if none appears within `timeout`, or it is invalid or ambiguous.
    From then on this node protects the run's keys, and in a private run admits only the owner and its invitees
    (node.admission; a peer then takes its own invite with Admission.join_with)."""
    started = time.monotonic()
    deadline = started + timeout
    while True:
        raw = await node.get(RECIPE_KEY)
        recipes, problems = parse_recipes(raw)
        chosen = choose_recipe(recipes, problems, node.initial_peer_ids,
                               accept_untrusted=time.monotonic() - started >= min(trusted_wait, timeout / 2))
        if chosen is not None:
            owner, recipe = chosen
            if owner not in node.initial_peer_ids:
                logger.info("following the recipe of %s, the only run owner in the DHT (not one of "
                            "--initial-peers)", owner)
            node.protect(protected_keys(recipe))
            if recipe.admission == "invite":
                _enter_private_run(node, owner, recipe.run_id, raw)
                await node.read_revocations()  # so that a revoked invite stops its peer at join, not later
            return recipe, owner_dataset(raw, owner)
        if time.monotonic() >= deadline:
            raise RecipeError("found no run recipe in the DHT: is --initial-peers a `swarm-peer bootstrap` node "
                              "of this run?")
        await asyncio.sleep(1.0)


def _enter_private_run(node: SwarmNode, owner: str, run_id: str, raw: Mapping[str, Any]) -> None:
    for subkey, value in raw.items():
        owned = subkey_owner_key(subkey)
        if owned is not None and owned[0] == owner:
            admission = node.private_run(owner, owned[1], run_id)
            offered = value.get(INVITES) if isinstance(value, dict) else None
            if isinstance(offered, dict):
                admission.offered = {peer: token for peer, token in offered.items()
                                     if isinstance(peer, str) and isinstance(token, str)}
            return


async def publish_recipe(node: SwarmNode, recipe: Recipe, ttl: float, invites: Mapping[str, str] = (),
                         dataset: Optional[str] = None) -> None:
    """Publish the recipe under our owned subkey: this node becomes the run owner (peers trust it by peer id). A
    private run's recipe also carries `invites` ({peer id: token}, see admission.allowlist_invites); a run whose
    data we share, its `dataset` id (swarm.data.dataset)."""
    node.protect(protected_keys(recipe))
    value = recipe_value(recipe, dataset)
    if recipe.admission == "invite":
        node.private_run(node.peer_id, node.identity.public_key.decode(), recipe.run_id)
        if invites:
            value[INVITES] = dict(invites)
    await node.store(RECIPE_KEY, value, ttl=ttl, subkey=node.owned_subkey)


def take_part(node: SwarmNode, recipe: Recipe, invite: Optional[str]) -> None:
    """This peer's admission to the run it fetched: in a private run `invite` (else the owner's allowlist invite for
    us) must admit us, or AdmissionError says what to do; an open run needs none."""
    if node.admission is not None:
        node.admission.join_with(node.identity, invite)
    elif invite:
        logger.warning("--invite is not needed: run %s is open to everyone", recipe.run_id)
