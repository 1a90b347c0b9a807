"""Backups of a pipeline stage's state, so that a stage whose every host left goes on from where it was, not from the
recipe's init. Each stage peer keeps the state (global params and outer momentum) of the stage after its own, the
last stage's peers the first's (`kept_stage`): at every round of that stage that is a multiple of the recipe's
`pipeline.keep_every`, it takes that stage's state as a joiner does (replaying the outer steps since the state it
kept where a holder still logs them, else downloading; from the holders a quorum of the stage's live peers vouches
for, swarm/dht/view.py), announces the round and state digest it keeps in its own record (`kept_round`,
`kept_digest`), and serves the state on that stage's state protocol, as the stage's own peers do.

A peer that joins a stage no other live peer trains (or whose state it could not take from them) takes the state
the stage's keepers vouch for (view.kept_reference), by the rule any reference follows: where two or more keepers
announce one, two must agree, so one keeper's lie leads nobody while another keeper contradicts it (keepers take
the same rounds, so honest ones agree); a lone keeper is followed as a lone peer is (view.quorum). The download
checks what any download checks (the bytes' sha256, the tensors' state digest), and only a state newer than the
joiner's own (its checkpoint's) replaces it.

The kept state lives in host memory, 8 bytes a parameter of the kept stage (no model, no replay log); a CPU peer
keeps one only if it fits within --max-memory beside its own stage's training. A client-mode peer keeps none: it
could serve it to nobody."""

from __future__ import annotations

import asyncio
import logging
from typing import Callable, Optional

import torch

from swarm.config import Recipe
from swarm.dht import view
from swarm.dht.node import SwarmNode
from swarm.dht.records import PeerRecord, parse_peer_records, peers_key
from swarm.model.memory import fmt_bytes
from swarm.model.stages import Stage, materialize
from swarm.peer.diloco import DiLoCo
from swarm.peer.pipeline.placement import memory_limits
from swarm.peer.state.sync import StateSyncError, serve_state, sync_deadline, sync_state
from swarm.settings import PeerSettings

logger = logging.getLogger(__name__)


def kept_stage(stage: int, stages: int) -> int:
    """The stage whose state the peers of `stage` keep."""
    return (stage + 1) % stages


def keepers_of(stage: int, stages: int) -> int:
    """The stage whose peers keep the state of `stage`."""
    return (stage - 1) % stages


class Keeper:
    """The state of stage `stage` (the one after ours) that this peer keeps, serves and announces."""

    def __init__(self, node: SwarmNode, recipe: Recipe, stage: int, module: torch.nn.Module):
        self.node, self.stage, self.every = node, stage, recipe.pipeline.keep_every
        self.run_id = recipe.stage_run_id(stage)
        self.diloco = DiLoCo.state_only(module, recipe.outer)
        self.kept = False  # whether we took the stage's state once (before: nothing to announce)
        self._taking: Optional[asyncio.Task] = None  # the take under way, if any

    @classmethod
    def build(cls, node: SwarmNode, settings: PeerSettings, part, meta_model: Callable[[], torch.nn.Module],
              device: torch.device | str) -> Optional["Keeper"]:
        """The keeper of the stage after `part`'s (a Part), its params initialised as that stage's own peers
        initialise them, on a model built on the meta device for it alone (`meta_model()`); None for a whole model,
        a client-mode peer, a recipe that keeps no backups (keep_every 0), or a CPU peer within whose --max-memory
        8 bytes a parameter of the kept stage would not fit beside its own stage's training."""
        recipe = part.recipe
        if part.whole or settings.network.client_mode or recipe.pipeline.keep_every == 0:
            return None
        stage, model = kept_stage(part.index, part.stages), meta_model()
        module = Stage(model, *part.all_bounds[stage], recipe.pipeline.bottleneck)
        size, need, limit = 8 * sum(p.numel() for p in module.parameters()), part.needs[part.index], \
            memory_limits(settings)[0]
        if limit is not None and torch.device(device).type == "cpu" and need + size > limit:
            logger.info("pipeline: keeping no backup of stage %d: its %s would not fit within --max-memory beside "
                        "our stage's %s", stage, fmt_bytes(size), fmt_bytes(need))
            return None
        materialize(model, module, recipe.model.seed, "cpu")
        logger.info("pipeline: keeping a backup of stage %d's state (%s), taken every %d of its rounds", stage,
                    fmt_bytes(size), recipe.pipeline.keep_every)
        return cls(node, recipe, stage, module)

    async def start(self) -> None:
        """Serve the kept state on the stage's state protocol (Part._watch then offers the stage's records)."""
        await serve_state(self.node, self.run_id, self.diloco)

    def fields(self) -> dict:
        """What our record announces of the state we keep (kept_round, kept_digest): nothing before we took one."""
        if not self.kept:
            return {}
        round_no, digest = self.diloco.identity()
        return {"kept_round": round_no, "kept_digest": digest}

    def offer(self, records: list[PeerRecord]) -> None:
        """The kept stage's records, as Part._watch reads them every few seconds: take the state its peers vouch for
        (view.joiner_reference: we averaged with none of them) on a task of its own, where it is at a round that is
        a multiple of keep_every, newer than ours or other than ours at our round, and no take is under way. Call it
        on the event loop."""
        if self._taking is not None and not self._taking.done():
            return
        reference = view.joiner_reference(records, self.node.now())
        round_no, digest = self.diloco.identity()
        if reference.holders and reference.round and not reference.round % self.every and \
                reference.round >= round_no and (reference.round, reference.digest) != (round_no, digest):
            self._taking = asyncio.create_task(self.take(reference))

    async def take(self, reference: view.Reference) -> None:
        """Bring the kept state to `reference` (sync_state); a failure is logged, and the next offer tries again."""
        try:
            await asyncio.to_thread(self.diloco.settle)  # (the replay reads our digest: never wait for its hash here)
            synced = await asyncio.wait_for(sync_state(self.node, reference.holders, self.run_id, self.diloco,
                                                       reference.digest), sync_deadline(8 * self.diloco.numel))
        except Exception as e:  # noqa: BLE001 - no holder served it, or it took too long: the next offer tries again
            logger.info("pipeline: could not take stage %d's state for its backup: %s", self.stage,
                        e if isinstance(e, StateSyncError) else repr(e))
            return
        self.kept = True
        logger.info("pipeline: backup of stage %d: %s", self.stage,
                    await asyncio.to_thread(synced.describe, self.diloco))


async def backup_reference(node: SwarmNode, recipe: Recipe, stage: int) -> view.Reference:
    """The state of our `stage` that its keepers vouch for now (view.kept_reference of the records of the stage
    before it)."""
    keepers = recipe.stage_run_id(keepers_of(stage, recipe.pipeline.stages))
    records, _ = parse_peer_records(await node.get(peers_key(keepers)))
    return view.kept_reference(records, node.now())
