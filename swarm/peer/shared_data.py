"""A peer's side of the run's shared dataset (swarm.data.dataset, swarm.data.share): the manifest and the files it
needs to start (tokenizer, model config, validation windows) fetched before it builds the model, a shard file when
its stream first reads it, the rest in the background in the order its stream reads them; and, once it holds
files, serving them and announcing how many it holds."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from swarm.config import ModelRecipe, Recipe
from swarm.settings import PeerSettings
from swarm.data.dataset import (DATASETS_DIR, Dataset, DatasetError, FileStore, open_dataset, prepare_local,
                                shard_order)
from swarm.data.prepare import RunData
from swarm.data.share import NO_HOLDER_SECONDS, DataFetcher, DataServer, announce_holding, serve_data
from swarm.dht.node import SwarmNode
from swarm.checks import resource_checks
from swarm.events import EventLog
from swarm.monitoring.metrics import PeerMetrics
from swarm.runtime import LoopThread
from swarm.words import counted

logger = logging.getLogger(__name__)
WAIT_SECONDS = NO_HOLDER_SECONDS + 60  # the fetcher gives up on a file by itself before this


def load_data(node: SwarmNode, loop: LoopThread, recipe: Recipe, dataset_id: str | None, settings: PeerSettings,
              metrics: PeerMetrics, events: EventLog) -> tuple[RunData | Dataset, ModelRecipe, "SharedData | None"]:
    """The run's data and model recipe: the shared dataset `dataset_id` (see SharedData) if the run names one, else
    the recipe's local files (read inside --data-dir) prepared here."""
    started, shared = time.monotonic(), None
    if dataset_id is not None:
        shared = SharedData(node, loop, recipe, dataset_id, settings, metrics, events)
        data, model = shared.open()
    else:
        data, model = prepare_local(recipe, settings.cache_dir, settings.data_dir)
        if data.skipped_files:
            logger.info("data: %d unreadable files skipped", data.skipped_files)
    logger.info("data: %d train docs (%d tokens), %d validation docs, %.1f s", data.n_train_docs, len(data.train),
                data.n_val_docs, time.monotonic() - started)
    events.emit("data_prepared", train_docs=data.n_train_docs, train_tokens=len(data.train), val_docs=data.n_val_docs,
                seconds=round(time.monotonic() - started, 3), dataset=dataset_id)
    return data, model, shared


class SharedData:
    """The run's dataset `dataset_id` on this peer (see the module docstring)."""

    def __init__(self, node: SwarmNode, loop: LoopThread, recipe: Recipe, dataset_id: str, settings: PeerSettings,
                 metrics: PeerMetrics, events: EventLog):
        self.node, self.loop, self.recipe, self.id = node, loop, recipe, dataset_id
        self.settings, self.metrics, self.events = settings, metrics, events
        self.store = FileStore(Path(settings.cache_dir) / DATASETS_DIR)
        self.fetcher = DataFetcher(node, recipe.run_id, dataset_id, self.store, on_bytes=metrics.data_fetched.inc,
                                   on_refused=self._refused)
        self.dataset: Dataset | None = None
        self._held = (-1, 0)  # (fetcher.stored when counted, files held)

    def open(self) -> tuple[Dataset, ModelRecipe]:
        """The dataset, its start files here (fetched now), and the model recipe naming its model config. Raises
        DatasetError with one line if it cannot be had or does not fit the recipe."""
        r = self.recipe
        manifest = self.loop.run(self.fetcher.manifest(), timeout=WAIT_SECONDS, interruptible=True)
        if (manifest.seq_len, manifest.num_shards) != (r.data.seq_len, r.data.num_shards):
            raise DatasetError(f"the run's dataset {self.id[:12]} is cut for seq_len {manifest.seq_len} and "
                               f"{manifest.num_shards} shards, its recipe says {r.data.seq_len} and "
                               f"{r.data.num_shards}: ask the run host to restart the bootstrap")
        if (manifest.model_config is None) != (r.model.config_file is None):
            raise DatasetError(f"the run's dataset {self.id[:12]} does not carry the model config its recipe names: "
                               f"ask the run host to restart the bootstrap")
        start = [manifest.tokenizer, *([manifest.model_config] if manifest.model_config else []), manifest.validation]
        self.loop.run(self.fetcher.fetch_all(start), timeout=WAIT_SECONDS, interruptible=True)
        self.dataset = data = open_dataset(manifest, self.store, r.data.batch_size, self.fetch_shard)
        self.metrics.data_files_total.set(len(manifest.files))
        self.metrics.data_files_held.set_function(lambda: float(self.held()))
        logger.info("data: the run's dataset %s (%s, %.1f MB), %s here", self.id[:12],
                    counted(len(manifest.files), "file"), manifest.total_bytes / 1e6,
                    counted(data.train.held(), "shard file"))
        if data.model_config is None:
            return data, r.model
        # join's checks could not read the model config before it came with the dataset: now they can.
        for check in resource_checks(r, self.settings, shared=True, config_file=str(data.model_config)):
            self.events.emit("check", name=check.name, ok=check.ok, message=check.message)
            if not check.ok:
                logger.warning("%s: %s", check.name, check.message)
        return data, r.model.model_copy(update={"config_file": str(data.model_config)})

    def held(self) -> int:
        """Files of the dataset here: counted again only after the fetcher stored one (it is read every heartbeat)."""
        if self._held[0] != self.fetcher.stored:
            self._held = (self.fetcher.stored, sum(self.store.has(entry) for entry in self.dataset.manifest.files))
        return self._held[1]

    def fetch_shard(self, shard: int) -> None:
        """Called by the training thread for a shard file it must read and does not hold: fetched at once."""
        entry = self.dataset.manifest.shards[shard]
        logger.info("data: waiting for shard file %d (%s)", shard, entry.sha256[:12])
        self.loop.run(self.fetcher.fetch(entry), timeout=WAIT_SECONDS, interruptible=True)

    def fetch_rest(self, start: int) -> None:
        """Fetch the shard files we do not hold in the background, in the order a stream from `start` reads them."""
        manifest, started = self.dataset.manifest, time.monotonic()
        wanted = [manifest.shards[k] for k in shard_order(start, manifest.num_shards)]

        async def fetch() -> None:
            try:
                await self.fetcher.fetch_all(wanted)
            except DatasetError as e:
                logger.warning("data: %s", e)
                return
            seconds, fetched = time.monotonic() - started, self.fetcher.bytes_from
            logger.info("data: every file of the run's dataset is here (%.1f MB fetched in %.1f s, from %s)",
                        sum(fetched.values()) / 1e6, seconds, counted(len(fetched), "peer"))
            self.events.emit("data_complete", seconds=round(seconds, 3), bytes_from=dict(fetched),
                             refused=sorted(self.fetcher.refused))

        self.loop.submit(fetch())

    def serve(self, corrupt: bool = False) -> None:
        """Serve the files we hold and announce them (`corrupt`: the test fault, every byte flipped)."""
        server = DataServer(self.dataset.manifest, self.store, corrupt)
        self.loop.run(serve_data(self.node, self.recipe.run_id, server), timeout=30)
        self.metrics.data_served.set_function(lambda: float(server.bytes_served))
        self.loop.submit(announce_holding(self.node, self.recipe.run_id, self.id, self.held))

    def record_fields(self) -> dict:
        """What we announce of the dataset: files held, bytes fetched."""
        return {"data_files": self.held(), "data_fetched": sum(self.fetcher.bytes_from.values())}

    def _refused(self, holder: str, sha256: str) -> None:
        self.metrics.data_refused.inc()
        self.events.emit("data_refused", holder=holder, file=sha256)
