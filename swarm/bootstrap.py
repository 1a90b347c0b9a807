"""`swarm-peer bootstrap`: a long-lived DHT entry point that publishes the run recipe, reads the swarm from the DHT
every few seconds, and serves it on --metrics-port as Prometheus metrics (/metrics), a status page (/) and JSON
(/api/swarm)."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from prometheus_client import CollectorRegistry, ProcessCollector

from swarm import __version__
from swarm.config import DataRecipe, Recipe, RecipeError, load_recipe
from swarm.settings import BootstrapSettings
from swarm.dht.admission import (REVOCATION_FIELD, InviteError, Revocation, allowlist_invites, load_revocation,
                                 revocation_file, revocations_key)
from swarm.dht.dialback import serve_dialback
from swarm.dht.node import NetworkOptions, NodeError, SwarmNode
from swarm.dht.recipes import publish_recipe
from swarm.dht.records import RECIPE_RULE
from swarm.events import EventLog
from swarm.monitoring.http import MonitoringServer
from swarm.monitoring.metrics import ProcessTreeMemory, SwarmGauges
from swarm.monitoring.status_page import REFRESH_SECONDS, StatusBoard
from swarm.monitoring.swarm_status import SwarmExporter, read_swarm
from swarm.runtime import LoopThread, install_stop_handlers
from swarm.words import counted

logger = logging.getLogger("swarm.bootstrap")
RECIPE_TTL = 600.0
REPUBLISH_SECONDS = 60.0
VIEW_SECONDS = REFRESH_SECONDS  # the status page re-reads as often as we re-read the DHT
ALLOWLIST_DAYS = 30.0  # lifetime of the invites a bootstrap signs for its --allowlist at each start


def run_bootstrap(settings: BootstrapSettings) -> int:
    recipe = load_recipe(settings.recipe_file) if settings.recipe_file else Recipe()
    if recipe.pipeline.stages == "auto":  # peers only ever see a number of stages
        # (Imported here, as the dataset below: torch and transformers take seconds to load, which a bootstrap of a
        # run with a number of stages never needs.)
        from swarm.model.memory import resolve_stages

        recipe = resolve_stages(recipe, settings.data_dir or settings.cache_dir)
        logger.info("pipeline.stages: auto: %d stage%s, each training within %.0f MB", recipe.pipeline.stages,
                    "" if recipe.pipeline.stages == 1 else "s", recipe.pipeline.stage_memory)
    if settings.private:
        recipe = recipe.model_copy(update={"admission": "invite"})
    if recipe.admission == "invite" and settings.network.identity_path is None:
        raise RecipeError("the recipe makes the run private (admission: invite): start the bootstrap with "
                          "--identity-path FILE, the key its invites are signed with")
    metrics = settings.metrics
    events = EventLog(settings.events_file)
    stop = threading.Event()
    _stop_on_signals(stop)
    manifest = None
    if _shares_data(recipe, settings.share_data):
        # Before anything is published: a peer that saw the recipe without its dataset would look for the files on
        # its own disk. (Imported here: torch and transformers take seconds to load, which others need not wait.)
        from swarm.data.prepare import CorpusError
        from swarm.data.dataset import share_dataset

        started = time.monotonic()
        try:
            manifest = share_dataset(recipe, settings.cache_dir, settings.data_dir)
        except (CorpusError, RecipeError) as e:  # no such files, a corpus that cannot be split, a path outside
            # --data-dir: peers would each stop on it, blaming files they were never meant to hold
            logger.error("cannot share the run's data, so no peer could train: %s: fix the recipe or its files in "
                         "%s (--data-dir), or pass --no-share-data if every peer holds the recipe's files",
                         _naming_the_field(str(e)), settings.data_dir or settings.cache_dir)
            return 2
    if manifest is not None:
        logger.info("sharing the run's dataset %s: %d files, %.1f MB (%d training tokens), prepared in %.1f s",
                    manifest.id[:12], len(manifest.files), manifest.total_bytes / 1e6, manifest.train_tokens,
                    time.monotonic() - started)
    loop = LoopThread()
    try:
        # It serves no bulk streams but the dataset's files, whatever the settings' default for peers.
        direct = settings.network.direct_streams and manifest is not None
        node = SwarmNode([], NetworkOptions(**{**settings.network.model_dump(), "direct_streams": direct}))
    except NodeError as e:
        logger.error("%s", e)
        loop.close()
        return 1
    server = None
    try:
        try:
            revocations = RevocationList(node, settings.network.identity_path, recipe.run_id) \
                if recipe.admission == "invite" else None
            invites = allowlist_invites(node.identity, recipe.run_id, settings.allowlist, ALLOWLIST_DAYS) \
                if settings.allowlist else {}
        except InviteError as e:
            logger.error("%s", e)
            return 1
        for peer_id in sorted(set(invites) & set(revocations.revoked() if revocations is not None else ())):
            logger.warning("allowlist %s: peer %s is revoked (%s): signing it no invite; take it off the list, "
                           "and send it a new invite (swarm-peer invite) to admit it again", settings.allowlist,
                           peer_id, revocations.path)
            del invites[peer_id]
        if sum(len(peer) + len(token) + 8 for peer, token in invites.items()) > RECIPE_RULE.max_bytes // 2:
            logger.error("allowlist %s is too long (%d peers) to publish with the recipe: list at most a few "
                         "hundred and send the others tokens (swarm-peer invite)", settings.allowlist, len(invites))
            return 1
        dataset = None if manifest is None else manifest.id
        if manifest is not None:
            from swarm.data.share import DataServer, announce_holding, serve_data
            from swarm.data.dataset import DATASETS_DIR, FileStore

            files = DataServer(manifest, FileStore(Path(settings.cache_dir) / DATASETS_DIR))
            loop.run(serve_data(node, recipe.run_id, files), timeout=30)
            loop.submit(announce_holding(node, recipe.run_id, manifest.id, lambda: len(manifest.files)))
        if revocations is not None:  # before the recipe: a peer reads the list as soon as it has the recipe
            loop.run(revocations.publish(), timeout=30)
        loop.run(publish_recipe(node, recipe, RECIPE_TTL, invites, dataset), timeout=30)
        loop.run(serve_dialback(node, __version__), timeout=30)  # peers learn whether the swarm can dial them
        view = SwarmMonitor(StatusBoard(recipe.run_id, recipe.digest(), node.peer_id))
        if metrics.port is not None:
            try:
                server = MonitoringServer(view.registry, view.board.payload, metrics.host, metrics.port)
            except OSError as e:
                logger.error("cannot serve metrics on %s:%d: %s", metrics.host, metrics.port, e.strerror)
                return 1
            url = f"http://{metrics.host}:{server.port}"
            logger.info("metrics at %s/metrics, status page at %s/ (its data at %s/api/swarm)", url, url, url)
        maddrs = node.visible_maddrs()
        logger.info("bootstrap of run %s (recipe %s) is up as %s", recipe.run_id, recipe.digest()[:12],
                    node.peer_id)
        invite_flag = " --invite TOKEN" if recipe.admission == "invite" and not invites else ""
        print("Peers join this swarm with:", flush=True)
        for maddr in maddrs:
            print(f"  swarm-peer join --initial-peers {maddr}{invite_flag}", flush=True)
        if recipe.admission == "invite":
            print(f"This run is private ({counted(len(invites), 'peer')} on the allowlist). Invite a peer with:\n"
                  f"  swarm-peer invite PEER_ID --identity-path {settings.network.identity_path} --run-id "
                  f"{recipe.run_id}\nTake a peer's invites back with:\n"
                  f"  swarm-peer revoke PEER_ID --identity-path {settings.network.identity_path} --run-id "
                  f"{recipe.run_id}", flush=True)
        events.emit("listening", peer_id=node.peer_id, maddrs=[str(m) for m in maddrs], run_id=recipe.run_id,
                    metrics_port=server.port if server is not None else None)
        loop.submit(_maintain(node, recipe, view, invites, dataset, revocations, on_gone=stop.set))
        stop.wait()
        if not node.dht.is_alive():  # (its p2pd was killed: _maintain said so)
            return 1
        logger.info("stopping")
        return 0
    finally:
        if server is not None:
            server.close()
        node.shutdown()
        loop.close()
        events.emit("stopped")
        events.close()


def _shares_data(recipe: Recipe, asked: Optional[bool]) -> bool:
    """Whether we share the run's data: as asked, else when the recipe names local files (the bundled corpus with
    the trained BPE and a built-in model needs none: every peer has them)."""
    if asked is not None:
        return asked
    defaults = DataRecipe()
    return recipe.data.source != defaults.source or recipe.data.tokenizer != defaults.tokenizer or \
        recipe.model.config_file is not None


def _naming_the_field(message: str) -> str:
    """A data error's message, led by the recipe field it is about where it does not name one already."""
    if message.startswith(("model.", "data.", "recipe field")):
        return message
    if message.startswith("tokenizer"):
        return f"data.tokenizer: {message}"
    if "shards need at least" in message:
        return f"data.num_shards: {message}"
    if message.startswith("bpe vocab_size"):
        return f"data.vocab_size: {message}"
    return f"data.source: {message}"


def _stop_on_signals(stop: threading.Event) -> None:
    """SIGINT and SIGTERM set `stop` (see `install_stop_handlers` for the forked DHT process)."""
    install_stop_handlers(lambda signum: stop.set())


class SwarmMonitor:
    """Everything the bootstrap derives from each read of the swarm: the registry behind /metrics (SwarmExporter's
    gauges, our extra swarm-wide gauges, process metrics, the memory of our process tree) and the status board
    (latest view + loss history) behind the page and /api/swarm."""

    def __init__(self, board: StatusBoard):
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        ProcessTreeMemory(self.registry)  # with the DHT process and p2pd
        self.exporter, self.gauges, self.board = SwarmExporter(self.registry), SwarmGauges(self.registry), board

    async def refresh(self, node: SwarmNode, recipe: Recipe) -> None:
        summary = await read_swarm(node, recipe)  # issue #3: coverage
        self.exporter.update(summary)
        self.gauges.update(summary)
        self.board.update(summary)


async def _maintain(node: SwarmNode, recipe: Recipe, view: SwarmMonitor, invites: dict[str, str],
                    dataset: Optional[str], revocations: Optional["RevocationList"], on_gone: Callable[[], None]
                    ) -> None:
    since_publish = 0.0
    while True:
        try:
            if revocations is not None and revocations.reload():  # `swarm-peer revoke` wrote a newer list
                await revocations.publish()
            if since_publish >= REPUBLISH_SECONDS:
                if revocations is not None:
                    await revocations.publish()
                await publish_recipe(node, recipe, RECIPE_TTL, invites, dataset)
                since_publish = 0.0
            await view.refresh(node, recipe)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a transient DHT error must not stop the bootstrap
            if not node.dht.is_alive():  # (our DHT process is gone, its p2pd killed: nobody can reach us)
                logger.error("%s", e)
                on_gone()
                return
            logger.warning("could not refresh the swarm view: %s", e)
            view.board.failed(str(e) or type(e).__name__)
        await asyncio.sleep(VIEW_SECONDS)
        since_publish += VIEW_SECONDS


class RevocationList:
    """A private run's revocation list, which `swarm-peer revoke` keeps beside the owner key (revocation_file): read
    at start and again whenever the file changes (checked every VIEW_SECONDS), and published under
    revocations_key(run id) with the recipe. A list that is not the owner's for this run stops the start (InviteError);
    one that turns up later is not taken (the list held is kept), nor is a deleted file: peers keep the newest list
    they saw anyway."""

    def __init__(self, node: SwarmNode, identity_path: str, run_id: str):
        self.node, self.run_id, self.path = node, run_id, revocation_file(identity_path, run_id)
        self.admission = node.private_run(node.peer_id, node.identity.public_key.decode(), run_id)  # as the recipe
        self.revocation: Optional[Revocation] = None
        self._stamp: Optional[tuple[int, int]] = None
        self.reload(at_start=True)

    def revoked(self) -> list[str]:
        return list(self.revocation.revoked) if self.revocation is not None else []

    def reload(self, at_start: bool = False) -> bool:
        """Read the file again if it changed; whether that gave a newer list."""
        try:
            stat = os.stat(self.path)
        except FileNotFoundError:
            return False
        stamp = (stat.st_mtime_ns, stat.st_size)
        if stamp == self._stamp:
            return False
        self._stamp = stamp
        try:
            revocation = load_revocation(self.path, self.node.identity, self.run_id)
        except InviteError as e:
            if at_start:
                raise
            logger.error("%s: still publishing the list read before", e)
            return False
        if revocation is None or (self.revocation is not None and revocation.issued <= self.revocation.issued):
            return False
        self.revocation = revocation
        logger.info("revocation list %s: %s revoked", self.path, counted(len(revocation.revoked), "peer"))
        return True

    async def publish(self) -> None:
        if self.revocation is None:
            return
        packed = self.revocation.pack()
        self.admission.follow(packed)  # our own node refuses them at once
        await self.node.store(revocations_key(self.run_id), {REVOCATION_FIELD: packed}, ttl=RECIPE_TTL,
                              subkey=self.node.owned_subkey)
