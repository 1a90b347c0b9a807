"""Serve this peer's global state (params + outer momentum) to late joiners by byte range, and the outer steps it
logged to peers that can replay them. A holder that takes a round while a joiner downloads keeps serving the
snapshot the joiner started on, so a download longer than a round finishes. A requester that sends its request or
reads our answer too slowly is dropped at a deadline, so it holds none of the handler's slots for long."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from dataclasses import dataclass
from typing import Optional

import msgpack
from safetensors.torch import save as save_tensors

from swarm.averaging.faults import FaultPlan
from swarm.dht.frames import answer_seconds, recv_frame, send_frame
from swarm.dht.node import SwarmNode
from swarm.peer.diloco import DiLoCo
from swarm.peer.outer import OuterStep
from swarm.peer.state.wire import MAX_REPLAY_STEPS, STALL_SECONDS, protocol, send_bytes
from swarm.words import shown

logger = logging.getLogger(__name__)
SNAPSHOT_SECONDS = 300.0  # a served snapshot is kept this long after its last request, for resuming joiners
KEPT_SNAPSHOTS = 2  # older snapshots still being downloaded (each asked for in the last STALL_SECONDS)
REQUEST_SECONDS = 10.0  # a request (one small frame) must arrive whole within this


@dataclass
class Snapshot:
    header: dict  # round, tokens_seen, digest, size, sha256
    payload: bytes
    last_used: float


class StateServer:
    """Serves consistent snapshots of one peer's DiLoCo state, by byte range."""

    def __init__(self, diloco: DiLoCo, faults: Optional[FaultPlan] = None):
        self.diloco = diloco
        self.faults = faults or FaultPlan()  # "serve@R": SIGKILL while answering a state request
        self._snapshot: Optional[Snapshot] = None
        self._kept: dict[str, Snapshot] = {}  # by sha256: snapshots of past rounds that joiners are downloading
        self._lock = asyncio.Lock()
        self.bytes_served = 0
        self.request_timeout = REQUEST_SECONDS
        self.dropped = 0  # requesters dropped at a deadline: silent, dribbling, or not reading our answer

    async def current(self) -> Snapshot:
        """The snapshot of the state as it is now (serialised once per round, off the event loop)."""
        async with self._lock:
            key = self.diloco.identity()  # (never waits for a hash: the snapshot of a moment ago is as good)
            cached = self._snapshot
            if cached is None or (cached.header["round"], cached.header["digest"]) != key or \
                    time.monotonic() - cached.last_used > SNAPSHOT_SECONDS:
                header, payload = await asyncio.get_running_loop().run_in_executor(None, _serialise, self.diloco)
                if cached is not None:
                    self._kept[cached.header["sha256"]] = cached  # joiners may still be downloading it
                    self._prune()
                cached = self._snapshot = Snapshot(header, payload, time.monotonic())
            cached.last_used = time.monotonic()
            return cached

    def _prune(self) -> None:
        """Keep past snapshots only while joiners download them: the most recently used KEPT_SNAPSHOTS, each
        until a stall's time after its last range went out."""
        now = time.monotonic()
        fresh = sorted((s for s in self._kept.values() if now - s.last_used < STALL_SECONDS),
                       key=lambda s: s.last_used)[-KEPT_SNAPSHOTS:]
        self._kept = {s.header["sha256"]: s for s in fresh}

    async def snapshot(self, sha256: Optional[str]) -> Snapshot:
        """The snapshot with `sha256` while we keep it (a joiner goes on with a download our round overtook),
        else the current one."""
        async with self._lock:
            self._prune()
            for snapshot in [self._snapshot, *self._kept.values()]:
                if sha256 is not None and snapshot is not None and snapshot.header["sha256"] == sha256:
                    snapshot.last_used = time.monotonic()
                    return snapshot
        return await self.current()

    async def handle(self, remote: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One request, answered. The request must arrive within `request_timeout` s and the answer be read as fast
        as a joiner must read it (answer_seconds): a peer that sends nothing, dribbles, or stops reading is
        dropped then."""
        try:
            request = msgpack.unpackb(await asyncio.wait_for(recv_frame(reader, 1024), self.request_timeout))
            await self._answer(remote, request, writer)
        except asyncio.TimeoutError:
            self.dropped += 1
            logger.info("dropped a state stream from %s: too slow to send its request or read our answer",
                        remote[-8:])

    async def _answer(self, remote: str, request: object, writer: asyncio.StreamWriter) -> None:
        self.faults.maybe_die("serve", self.diloco.round)
        if isinstance(request, dict) and "replay_from" in request:
            await self._send_steps(remote, request, writer)
            return
        offset, length = (request.get("offset", 0), request.get("length", 0)) if isinstance(request, dict) else \
            (None, None)
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (offset, length)):
            raise ValueError(f"malformed state request from {remote}: {shown(request)}")
        wanted = request.get("sha256")
        snapshot = await self.snapshot(wanted if isinstance(wanted, str) else None)
        end = min(offset + length, len(snapshot.payload))
        async with asyncio.timeout(answer_seconds(max(end - offset, 0))):
            await send_frame(writer, msgpack.packb(snapshot.header))
            if wanted is not None and wanted != snapshot.header["sha256"]:
                return  # we no longer keep what the joiner downloads: it sees our sha256 and goes elsewhere
            await send_bytes(writer, memoryview(snapshot.payload)[offset:end])
        self.bytes_served += max(end - offset, 0)
        snapshot.last_used = time.monotonic()  # a range can take long on a slow link: count its end as use
        if end == len(snapshot.payload) and end > offset:
            logger.info("served the last range of the state of round %d (%.1f MB) to %s", snapshot.header["round"],
                        len(snapshot.payload) / 1e6, remote[-8:])

    async def _send_steps(self, remote: str, request: dict, writer: asyncio.StreamWriter) -> None:
        """Our logged outer steps from the asker's state to the one that ends at the params it asks for (none if
        our log does not hold both): a header listing them (with each chunk's size), then their bytes unless it
        asked for the listing only."""
        round_no, digest, target = request.get("replay_from"), request.get("digest"), request.get("to")
        if not isinstance(round_no, int) or isinstance(round_no, bool) or not isinstance(digest, str) or \
                not isinstance(target, str):
            raise ValueError(f"malformed replay request from {remote}: {shown(request)}")
        await asyncio.get_running_loop().run_in_executor(None, self.diloco.hashed)  # (the latest step is logged)
        steps = _up_to(self.diloco.steps_since(round_no, digest)[:MAX_REPLAY_STEPS], target)
        bodies = [[memoryview(payload) for _, _, payload in step.wire] if step.wire is not None else
                  [memoryview(step.average.numpy()).cast("B")] for step in steps] if request.get("bodies", True) else []
        async with asyncio.timeout(answer_seconds(sum(len(view) for views in bodies for view in views))):
            await send_frame(writer, msgpack.packb({"steps": [
                {"round": s.round, "digest": s.digest, "after": s.after, "tokens": s.tokens,
                 "chunks": [[a, b, len(payload)] for a, b, payload in s.wire] if s.wire is not None else None}
                for s in steps]}))
            for view in (view for views in bodies for view in views):
                await send_bytes(writer, view)
                self.bytes_served += len(view)


def _up_to(steps: list[OuterStep], target: str) -> list[OuterStep]:
    """`steps` up to the first that ends at the params `target`; none if no step does."""
    for i, step in enumerate(steps):
        if step.after == target:
            return steps[:i + 1]
    return []


def _serialise(diloco: DiLoCo) -> tuple[dict, bytes]:
    with diloco.lock:  # round, digest and tensors from the same moment
        header = {"round": diloco.round, "tokens_seen": diloco.tokens_seen, "digest": diloco.digest()}
        tensors = diloco.state_tensors()
    payload = save_tensors(tensors)
    return {**header, "size": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}, payload


async def serve_state(node: SwarmNode, run_id: str, diloco: DiLoCo,
                      faults: Optional[FaultPlan] = None) -> StateServer:
    """Serve `diloco`'s state and logged outer steps on the run's state protocol, from now on."""
    server = StateServer(diloco, faults)
    await node.add_stream_handler(protocol(run_id), server.handle)
    return server
