"""The swarm delivers the run's dataset (swarm.data.dataset): peers holding its files serve them by byte range on
the run's data protocol and say so under the run's data key; a peer missing files fetches each from one holder
at a time, several files (from several holders) at once, and keeps a file only once its bytes match its sha256. A
holder whose bytes do not match is not asked again; one that is slow, silent or lacks the file costs a retry
elsewhere. The dataset id comes from the run owner's signed recipe record, so no holder can choose what is
trained on: the worst it can do is waste time. A holder reads and sends a range a piece at a time (PIECE_BYTES),
each piece read by the requester within a stall, and answers at most MAX_REQUESTS_PER_PEER requests of one peer
and MAX_REQUESTS in all at once ("busy" past that: the requester asks another holder)."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from typing import Callable, Optional

import msgpack
import numpy as np

from swarm.data.dataset import MAX_MANIFEST_BYTES, DatasetError, FileEntry, FileStore, Manifest
from swarm.dht.frames import STALL_SECONDS, answer_seconds, failure_reason, receive_bytes, recv_frame, send_frame
from swarm.dht.node import SwarmNode
from swarm.dht.records import data_key
from swarm.dht.validation import subkey_owner
from swarm.words import shown

logger = logging.getLogger(__name__)

RANGE_BYTES = 8 << 20  # bytes a request asks for
PIECE_BYTES = 256 << 10  # bytes of a range read from the store, and sent as one frame, at a time
REQUEST_SECONDS = 10.0  # a request must arrive whole within this
ANNOUNCE_TTL = 120.0
ANNOUNCE_SECONDS = 30.0
FILES_AT_ONCE = 4  # files a peer fetches at once (each from another holder when there are several)
# Requests a holder answers at once, of one peer (an honest one asks for FILES_AT_ONCE ranges at most, one stream per
# range, so this leaves it slack) and in all: each holds at most a piece and what the transport buffers.
MAX_REQUESTS_PER_PEER = 2 * FILES_AT_ONCE
MAX_REQUESTS = 64
NO_HOLDER_SECONDS = 300.0  # how long a file may find no holder able to serve it before fetching gives up
HOLDERS_SECONDS = 2.0  # the holders read from the DHT serve every file fetched meanwhile


def data_protocol(run_id: str) -> str:
    return f"swarm.{run_id}.data"


class DataServer:
    """Serves the files of one dataset that this peer holds, by byte range, a piece (PIECE_BYTES) read and sent at
    a time: a requester that reads nothing holds one piece for at most `stall` s, then is dropped. Past
    `max_per_peer` requests of one peer, or `max_requests` in all, being answered, a request is answered
    {"size": None, "busy": reason} (a requester of any version then asks another holder). The `corrupt` fault
    (tests) flips every byte it sends, as a hostile holder would."""

    def __init__(self, manifest: Manifest, store: FileStore, corrupt: bool = False,
                 max_per_peer: int = MAX_REQUESTS_PER_PEER, max_requests: int = MAX_REQUESTS):
        self.store, self.corrupt = store, corrupt
        self.files = {entry.sha256: entry for entry in manifest.files}
        self.manifest_entry = FileEntry(manifest.id, len(manifest.to_bytes()))
        self.files[manifest.id] = self.manifest_entry
        self.bytes_served = 0
        self.request_timeout = REQUEST_SECONDS
        self.stall = STALL_SECONDS  # the longest a piece may wait for the requester to read it
        self.max_per_peer, self.max_requests = max_per_peer, max_requests
        self.answering: Counter = Counter()  # requests being answered now, by peer (peers with none left out)
        self.refused: Counter = Counter()  # requests refused, by reason ("busy")
        self.dropped = 0  # requesters dropped for not reading our answer in time

    async def handle(self, remote: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = msgpack.unpackb(await asyncio.wait_for(recv_frame(reader, 1024), self.request_timeout))
        except asyncio.TimeoutError:
            logger.info("dropped a data stream from %s: its request did not arrive in time", remote[-8:])
            return
        sha256 = request.get("sha256") if isinstance(request, dict) else None
        offset = request.get("offset") if isinstance(request, dict) else None
        entry = self.files.get(sha256) if isinstance(sha256, str) else None
        if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
            raise ValueError(f"malformed data request from {remote}: {shown(request)}")
        if entry is None or not self.store.has(entry):
            await send_frame(writer, msgpack.packb({"size": None}))
            return
        busy = self._busy(remote)
        if busy is not None:
            self.refused["busy"] += 1
            await asyncio.wait_for(send_frame(writer, msgpack.packb({"size": None, "busy": busy})), self.stall)
            return
        self.answering[remote] += 1
        try:
            await self._send_range(entry, min(offset, entry.size), min(offset + RANGE_BYTES, entry.size), writer)
        except asyncio.TimeoutError:
            self.dropped += 1
            logger.info("dropped a data stream from %s: it did not read our answer in time", remote[-8:])
        finally:
            self.answering[remote] -= 1
            if not self.answering[remote]:
                del self.answering[remote]

    def _busy(self, remote: str) -> Optional[str]:
        """Why a request of `remote` is not answered now (None: it is)."""
        if self.answering[remote] >= self.max_per_peer:
            return f"{self.answering[remote]} requests of yours are being answered; ask another holder"
        if sum(self.answering.values()) >= self.max_requests:
            return f"{self.max_requests} requests are being answered; ask another holder"
        return None

    async def _send_range(self, entry: FileEntry, start: int, end: int, writer: asyncio.StreamWriter) -> None:
        """Bytes [start, end) of `entry` after the header, as frames of at most PIECE_BYTES, each read from the
        store once the one before is on its way; each frame within `stall` s, all of them within the time a
        requester allows a holder (answer_seconds)."""
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(answer_seconds(end - start)):
            await asyncio.wait_for(send_frame(writer, msgpack.packb({"size": entry.size})), self.stall)
            for at in range(start, end, PIECE_BYTES):
                piece = await loop.run_in_executor(None, self.store.read, entry, at, min(PIECE_BYTES, end - at))
                if len(piece) != min(PIECE_BYTES, end - at):
                    # (the file shrank under us: the requester sees the stream end and asks another holder)
                    logger.warning("data file %s is shorter than its entry", entry.sha256[:12])
                    return
                if self.corrupt:
                    piece = (np.frombuffer(piece, np.uint8) ^ 0xFF).tobytes()
                await asyncio.wait_for(send_frame(writer, piece), self.stall)
                self.bytes_served += len(piece)


async def serve_data(node: SwarmNode, run_id: str, server: DataServer) -> None:
    await node.add_stream_handler(data_protocol(run_id), server.handle)


async def announce_holding(node: SwarmNode, run_id: str, dataset: str, held: Callable[[], int]) -> None:
    """Say, every ANNOUNCE_SECONDS until cancelled, that we hold `held()` files of `dataset`."""
    while True:
        try:
            await node.store(data_key(run_id), {"dataset": dataset, "files": held()}, ttl=ANNOUNCE_TTL,
                             subkey=node.owned_subkey)
        except Exception as e:  # noqa: BLE001 - the DHT hiccups; the next announcement goes out anyway
            logger.debug("could not announce our data files: %r", e)
        await asyncio.sleep(ANNOUNCE_SECONDS)


async def find_holders(node: SwarmNode, run_id: str, dataset: str) -> list[str]:
    """Peers (not us) that say they hold files of `dataset`, most files first."""
    raw = await node.get(data_key(run_id))
    found = []
    for subkey, value in raw.items():
        holder = subkey_owner(subkey)
        if holder is None or holder == node.peer_id or not isinstance(value, dict) or \
                value.get("dataset") != dataset:
            continue
        files = value.get("files")
        found.append((files if isinstance(files, int) and not isinstance(files, bool) else 0, holder))
    return [holder for _, holder in sorted(found, reverse=True)]


class DataFetcher:
    """Fetches files of one dataset into a FileStore from the peers that hold them. `fetch(entry)` (a coroutine)
    returns once the file is here; concurrent calls for one file share one download. `refused` lists holders
    that sent bytes other than a file's: they are not asked again."""

    def __init__(self, node: SwarmNode, run_id: str, dataset: str, store: FileStore, stall: float = STALL_SECONDS,
                 no_holder_seconds: float = NO_HOLDER_SECONDS, on_bytes: Optional[Callable[[int], None]] = None,
                 on_refused: Optional[Callable[[str, str], None]] = None):
        self.node, self.run_id, self.dataset, self.store = node, run_id, dataset, store
        self.stall, self.no_holder_seconds = stall, no_holder_seconds
        self.on_bytes, self.on_refused = on_bytes, on_refused
        self.refused: set[str] = set()
        self.bytes_from: Counter = Counter()
        self._busy: Counter = Counter()  # files being fetched from each holder now
        self._inflight: dict[str, asyncio.Task] = {}
        self._holders: tuple[float, list[str]] = (-HOLDERS_SECONDS, [])  # (when read, holders)
        self.stored = 0  # files this fetcher stored

    async def manifest(self) -> Manifest:
        """The dataset's manifest, from our store or its holders."""
        entry = FileEntry(self.dataset, -1)
        if not self.store.path(self.dataset).is_file():
            await self.fetch(entry)
        return Manifest.from_bytes(self.store.path(self.dataset).read_bytes())

    async def fetch(self, entry: FileEntry) -> None:
        """Make sure `entry` is in the store (size -1: unknown, for the manifest)."""
        if entry.size >= 0 and self.store.has(entry):
            return
        task = self._inflight.get(entry.sha256)
        if task is None:
            task = self._inflight[entry.sha256] = asyncio.ensure_future(self._download(entry))
            task.add_done_callback(lambda _: self._inflight.pop(entry.sha256, None))
        await asyncio.shield(task)

    async def fetch_all(self, entries: list[FileEntry]) -> None:
        """Every one of `entries` (in that order of priority), FILES_AT_ONCE at a time."""
        todo = [entry for entry in entries if not self.store.has(entry)]
        queue: asyncio.Queue = asyncio.Queue()
        for entry in todo:
            queue.put_nowait(entry)

        async def worker() -> None:
            while not queue.empty():
                await self.fetch(queue.get_nowait())

        await asyncio.gather(*(worker() for _ in range(min(FILES_AT_ONCE, len(todo)))))

    async def holders(self) -> list[str]:
        """The dataset's holders, read from the DHT at most every HOLDERS_SECONDS (files fetched at once share a
        read)."""
        read_at, holders = self._holders
        if time.monotonic() - read_at >= HOLDERS_SECONDS:
            holders = await find_holders(self.node, self.run_id, self.dataset)
            self._holders = (time.monotonic(), holders)
        return holders

    async def _download(self, entry: FileEntry) -> None:
        deadline = time.monotonic() + self.no_holder_seconds
        tried: set[str] = set()
        while True:
            holders = [h for h in await self.holders() if h not in self.refused and h not in tried]
            if not holders:
                if time.monotonic() >= deadline:
                    raise DatasetError(f"no peer served file {entry.sha256[:12]} of the run's dataset "
                                       f"{self.dataset[:12]} within {self.no_holder_seconds:.0f} s (tried "
                                       f"{len(tried)}, {len(self.refused)} sent wrong bytes): is the run's "
                                       f"bootstrap up?")
                tried.clear()  # everyone failed once: try them again after a pause
                await asyncio.sleep(2.0)
                continue
            random.shuffle(holders)  # the least busy holder (files spread over holders), ties at random
            holder = min(holders, key=lambda h: self._busy[h])
            tried.add(holder)
            if await self._try(holder, entry):
                return

    async def _try(self, holder: str, entry: FileEntry) -> bool:
        """Fetch `entry` from `holder`; whether it is stored now. A holder whose bytes are not the file's is
        refused for good; one that fails or does not hold it is only left out of this file's tries."""
        self._busy[holder] += 1
        incoming = self.store.incoming(entry.sha256)
        try:
            held = await self._from(holder, entry, incoming)
        except Exception as e:  # noqa: BLE001 - any failure: another holder
            incoming.discard()
            logger.info("data holder %s failed us on file %s: %s", holder[-8:], entry.sha256[:12], failure_reason(e))
            return False
        finally:
            self._busy[holder] -= 1
        if not held:  # it does not hold this file
            incoming.discard()
            return False
        if await asyncio.get_running_loop().run_in_executor(None, incoming.commit) is not None:
            self.stored += 1
            return True
        self.refused.add(holder)
        logger.warning("data holder %s sent bytes that are not file %s (sha256 mismatch): not asking it again",
                       holder[-8:], entry.sha256[:12])
        if self.on_refused is not None:
            self.on_refused(holder, entry.sha256)
        return False

    async def _from(self, holder: str, entry: FileEntry, incoming) -> bool:
        """The whole file from `holder`, range by range, into `incoming`; False if it does not hold it."""
        size = entry.size
        limit = MAX_MANIFEST_BYTES if size < 0 else size
        while size < 0 or incoming.size < size:
            reader, writer = await asyncio.wait_for(
                self.node.open_stream(holder, data_protocol(self.run_id)), self.stall)
            try:
                await send_frame(writer, msgpack.packb({"sha256": entry.sha256, "offset": incoming.size}))
                header = msgpack.unpackb(await asyncio.wait_for(recv_frame(reader, 1024), self.stall))
                theirs = header.get("size") if isinstance(header, dict) else None
                if theirs is None:  # it does not hold the file, or is busy (then it says why): another holder
                    if isinstance(header, dict) and header.get("busy") is not None:
                        logger.debug("data holder %s is busy: %.200s", holder[-8:], header["busy"])
                    return False
                if not isinstance(theirs, int) or isinstance(theirs, bool) or not 0 < theirs <= limit or \
                        (size >= 0 and theirs != size):
                    raise ValueError(f"announced a size of {shown(theirs)} bytes")
                size = theirs
                part = await receive_bytes(reader, min(RANGE_BYTES, size - incoming.size), self.stall,
                                           "data range")
            finally:
                writer.close()
            incoming.write(part)
            self.bytes_from[holder] += len(part)
            if self.on_bytes is not None:
                self.on_bytes(len(part))
        return True
