"""What a stranger can make a stage server or a data server hold (issue 37, class 8): a stage server takes at most
MAX_WAITING_PER_PEER microbatches of one peer and MAX_WAITING in all, refusing the next at once ("busy"), and never
trains on a microbatch whose handler timed out; a data server reads a range a piece at a time, drops a requester
that reads nothing at its stall, and answers "busy" past its requests per peer and in all, which sends a fetcher
to another holder. In one process, on in-memory streams."""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from typing import Optional

import msgpack
import numpy as np
import pytest
import torch

from swarm.compression import get_codec
from swarm.data.dataset import FileEntry, FileStore
from swarm.data.share import DataFetcher, DataServer
from swarm.dht.frames import FRAME_HEADER, recv_frame
from swarm.peer.pipeline.server import BUSY, MAX_WAITING, MAX_WAITING_PER_PEER, Handoff, StageServer
from swarm.peer.pipeline.worker import StageWorker

pytestmark = pytest.mark.timeout(60)
HIDDEN, VOCAB = 4, 10


def _frame(data: bytes) -> bytes:
    return FRAME_HEADER.pack(len(data)) + data


class _Writer:
    """The server's end of an in-memory stream: what it writes goes to `reply` (the requester's reader). A
    requester that reads nothing (`reading` False) never lets `drain` return, as a full socket would not."""

    def __init__(self, reading: bool = True):
        self.reply, self.reading, self.buffered = asyncio.StreamReader(), reading, 0

    def write(self, data: bytes) -> None:
        self.buffered += len(data)
        if self.reading:
            self.reply.feed_data(bytes(data))

    async def drain(self) -> None:
        if not self.reading:
            await asyncio.Event().wait()

    def close(self) -> None:
        self.reply.feed_eof()


class _Stream:
    """One request from `remote` into `handle`, its handler a task (closing the stream when it ends, as SwarmNode's
    guard does)."""

    def __init__(self, handle, remote: str, request: bytes, reading: bool = True):
        self.reader, self.writer = asyncio.StreamReader(), _Writer(reading)
        self.reader.feed_data(request)
        self.task = asyncio.ensure_future(self._serve(handle, remote))

    async def _serve(self, handle, remote: str) -> None:
        try:
            await handle(remote, self.reader, self.writer)
        finally:
            self.writer.close()

    async def answer(self, timeout: float = 2.0) -> dict:
        return msgpack.unpackb(await asyncio.wait_for(recv_frame(self.writer.reply, 1 << 20), timeout))


async def _until(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        await asyncio.sleep(0.01)


# -- the stage server ---------------------------------------------------------------------------------------------


class _Middle(torch.nn.Module):
    """A middle stage of one linear layer (StageWorker needs `first`, `last` and a module)."""

    first, last, embed = False, False, None  # (embed: no bottleneck before it, swarm.model.stages.Stage)

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor, ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.linear(x)


def _worker() -> StageWorker:
    stage = _Middle()
    return StageWorker(stage, torch.optim.SGD(stage.parameters(), lr=0.1), lambda: 0.1, grad_clip=1.0)


def _microbatch() -> bytes:
    """A well-formed request: header, activations (1, 2, HIDDEN), targets."""
    return _frame(msgpack.packb({"shape": [1, 2, HIDDEN], "codec": "none", "scale": 1.0})) + \
        _frame(get_codec("none").encode(torch.ones(2 * HIDDEN))) + _frame(np.zeros(2, np.int32).tobytes())


def _serve_handoff(handoff: Handoff, stop: threading.Event, computed: list) -> None:
    """A training thread's stand-in (part.py's _serve_one): take the next microbatch, count it computed, answer."""
    while not stop.is_set():
        try:
            x, targets, scale, _, done = handoff.queue.get(timeout=0.05)
        except Exception:  # noqa: BLE001 - queue.Empty: look again
            continue
        computed.append(x)
        handoff.answer(done, (torch.zeros_like(x), 1.0))


def test_a_full_stage_server_refuses_the_next_microbatch_at_once_and_serves_the_ones_it_took():
    async def main():
        loop = asyncio.get_running_loop()
        handoff = Handoff(loop)
        server = StageServer(_worker(), HIDDEN, 64, VOCAB, loop, execute=handoff.hand_over)
        greedy = [_Stream(server.handle, "stranger", _microbatch()) for _ in range(MAX_WAITING_PER_PEER)]
        await _until(lambda: handoff.queue.qsize() == MAX_WAITING_PER_PEER)
        started = time.monotonic()
        extra = _Stream(server.handle, "stranger", _microbatch())
        answer = await extra.answer()
        assert answer["error"].startswith(BUSY) and time.monotonic() - started < 1.0
        assert handoff.queue.qsize() == MAX_WAITING_PER_PEER, "the refused microbatch was not queued"
        # Others still get in, up to the server's bound; past it everyone is refused.
        others = [_Stream(server.handle, f"peer{k}", _microbatch()) for k in range(MAX_WAITING - MAX_WAITING_PER_PEER)]
        await _until(lambda: handoff.queue.qsize() == MAX_WAITING)
        late = await _Stream(server.handle, "late", _microbatch()).answer()
        assert late["error"].startswith(BUSY) and server.refused[BUSY] == 2
        # The training thread comes: every microbatch taken is answered, and room is made again.
        stop, computed = threading.Event(), []
        thread = threading.Thread(target=_serve_handoff, args=(handoff, stop, computed))
        thread.start()
        try:
            answers = [await stream.answer() for stream in greedy + others]
            assert all(a == {"loss": 1.0} for a in answers) and len(computed) == MAX_WAITING
            await _until(lambda: not server.waiting)
            assert (await _Stream(server.handle, "stranger", _microbatch()).answer()) == {"loss": 1.0}
        finally:
            stop.set()
            thread.join()

    asyncio.run(main())


def test_a_microbatch_whose_handler_timed_out_is_never_trained_on():
    """Queued for a training thread that is busy past the handler's timeout: the thread never computes it."""
    async def main():
        loop = asyncio.get_running_loop()
        handoff = Handoff(loop)
        server = StageServer(_worker(), HIDDEN, 64, VOCAB, loop, timeout=0.3, execute=handoff.hand_over)
        late = [_Stream(server.handle, f"peer{k}", _microbatch()) for k in range(2)]
        await asyncio.wait([s.task for s in late], timeout=5)
        assert all(s.task.done() for s in late), "both handlers timed out"
        stop, computed = threading.Event(), []
        thread = threading.Thread(target=_serve_handoff, args=(handoff, stop, computed))
        thread.start()
        try:
            on_time = _Stream(server.handle, "peer0", _microbatch())
            assert await on_time.answer() == {"loss": 1.0}
            assert len(computed) == 1, "only the microbatch whose sender still waits was computed"
            assert server.dropped == 2
        finally:
            stop.set()
            thread.join()

    asyncio.run(main())


def test_a_microbatch_dropped_during_its_next_hop_changes_no_param():
    """Run by the server's own thread (no `execute` given), on a middle stage whose next hop answers after the
    handler's timeout: no backward, no step, no microbatch counted."""
    async def main():
        loop = asyncio.get_running_loop()
        hops, released = [], threading.Event()

        class _SlowNext:  # the next stage answers after our handler gave up
            def hop(self, _loop):
                def hop(out, targets, scale=1.0):
                    hops.append(out)
                    released.wait(5)
                    return torch.ones_like(out), 1.0
                return hop

        worker = _worker()
        before = [p.detach().clone() for p in worker.stage.parameters()]
        server = StageServer(worker, HIDDEN, 64, VOCAB, loop, downstream=_SlowNext(), timeout=0.3)
        stream = _Stream(server.handle, "peer0", _microbatch())
        await asyncio.wait_for(stream.task, 5)
        released.set()
        await _until(lambda: hops and not worker.lock.locked())  # (the hop answered: the worker is done with it)
        assert worker.microbatches == 0 and all(p.grad is None for p in worker.stage.parameters())
        assert all(torch.equal(a, b) for a, b in zip(before, worker.stage.parameters())), "a dropped step applied"
        assert len(hops) == 1 and server.dropped == 1

    asyncio.run(main())


# -- the data server ----------------------------------------------------------------------------------------------


class _CountingStore(FileStore):
    """A FileStore that counts the bytes read from it, and the most read at once."""

    def __init__(self, directory):
        super().__init__(directory)
        self.read_bytes, self.largest_read = 0, 0

    def read(self, entry, offset=0, length=None):
        piece = super().read(entry, offset, length)
        self.read_bytes += len(piece)
        self.largest_read = max(self.largest_read, len(piece))
        return piece


class _Manifest:
    """What DataServer reads of a manifest: its files, id and bytes."""

    def __init__(self, files: list[FileEntry]):
        self.files, self.id = files, hashlib.sha256(b"manifest").hexdigest()

    def to_bytes(self) -> bytes:
        return b"manifest"


def _holding(tmp_path, size: int = 3 << 20) -> tuple[DataServer, _CountingStore, FileEntry]:
    store = _CountingStore(tmp_path / "files")
    entry = store.add(np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes())
    return DataServer(_Manifest([entry]), store), store, entry


def _request(entry: FileEntry, offset: int = 0) -> bytes:
    return _frame(msgpack.packb({"sha256": entry.sha256, "offset": offset}))


def test_a_data_requester_that_reads_nothing_holds_a_piece_and_is_dropped_at_the_stall(tmp_path):
    server, store, entry = _holding(tmp_path)
    server.stall = 0.5

    async def main():
        started = time.monotonic()
        silent = _Stream(server.handle, "stranger", _request(entry), reading=False)
        await _until(lambda: silent.writer.buffered > 0)
        await asyncio.sleep(0.1)
        assert store.read_bytes <= 1 << 20 and store.largest_read <= 1 << 20, "read a piece, not the 3 MiB range"
        assert silent.writer.buffered <= 1 << 20
        await asyncio.wait_for(silent.task, 3)
        assert time.monotonic() - started < 3, "dropped within the stall (and not the range's minutes)"
        assert server.dropped == 1 and store.read_bytes <= 1 << 20

    asyncio.run(main())


def test_a_data_server_answers_busy_past_its_requests_per_peer_and_in_all(tmp_path):
    server, store, entry = _holding(tmp_path)
    server.max_per_peer, server.max_requests = 2, 3

    async def main():
        stuck = [_Stream(server.handle, "stranger", _request(entry), reading=False) for _ in range(2)]
        await _until(lambda: all(s.writer.buffered for s in stuck))  # (each stuck in its first piece)
        started = time.monotonic()
        refused = await _Stream(server.handle, "stranger", _request(entry)).answer()
        assert refused["size"] is None and "busy" in refused and time.monotonic() - started < 1.0
        # Another peer is served whole meanwhile; past the total, it is refused too.
        honest = _Stream(server.handle, "honest", _request(entry))
        assert (await honest.answer())["size"] == entry.size
        await asyncio.wait_for(honest.task, 5)
        other = _Stream(server.handle, "other", _request(entry), reading=False)
        await _until(lambda: other.writer.buffered > 0)
        assert "busy" in await _Stream(server.handle, "honest", _request(entry)).answer()
        assert server.refused["busy"] == 2
        for stream in [*stuck, other]:
            stream.task.cancel()
        await asyncio.gather(*(s.task for s in [*stuck, other]), return_exceptions=True)
        assert not server.answering

    asyncio.run(main())


class _Node:
    """What DataFetcher needs of a SwarmNode: in-memory streams into the holders' handlers."""

    peer_id = "fetcher"

    def __init__(self, servers: dict[str, DataServer]):
        self.servers = servers

    async def open_stream(self, holder: str, protocol: str):
        inbound, writer = asyncio.StreamReader(), _Writer()

        class _Requests:
            def write(self, data: bytes) -> None:
                inbound.feed_data(bytes(data))

            async def drain(self) -> None:
                pass

            def close(self) -> None:
                inbound.feed_eof()

        async def serve():
            try:
                await self.servers[holder].handle(self.peer_id, inbound, writer)
            finally:
                writer.close()

        asyncio.ensure_future(serve())
        return writer.reply, _Requests()


def test_a_busy_holder_sends_the_fetcher_to_another_and_is_not_refused_for_it(tmp_path):
    busy, store, entry = _holding(tmp_path / "a")
    busy.max_requests = 0  # (every request finds it full)
    free, _, _ = _holding(tmp_path / "b")
    mine = FileStore(tmp_path / "mine")
    fetcher = DataFetcher(_Node({"busy": busy, "free": free}), "run", "dataset", mine)

    async def holders() -> list[str]:
        return ["busy", "free"]

    fetcher.holders = holders

    async def main():
        assert not await fetcher._try("busy", entry) and not mine.has(entry)
        assert busy.refused["busy"] == 1 and "busy" not in fetcher.refused
        await asyncio.wait_for(fetcher.fetch(entry), 10)
        assert mine.has(entry) and fetcher.bytes_from == {"free": entry.size} and not fetcher.refused

    asyncio.run(main())
