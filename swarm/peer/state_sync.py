"""Serve this peer's global state (params + outer momentum) to late joiners, and download it from live peers.

A download asks every holder for the state's header (round, tokens seen, state digest, size, sha256 of the
serialised bytes), keeps the holders whose digest is the one the swarm announces, and fetches the bytes in
ranges from all of them at once, so a joiner's downlink is not capped by one holder's uplink. A range that fails
goes back to the queue and is fetched from another holder: a holder that leaves mid-download costs only its
range in flight. Nothing is loaded before the bytes match the sha256 and the tensors match the digest, so a bad
or hostile holder can waste time but never corrupt the model.

A peer behind the swarm first asks a holder for the outer steps it logged (DiLoCo.replay_log) from the peer's
state to the swarm's, and replays them: each costs what its average cost on the wire, a fraction of the state.
A holder that takes a round while a joiner downloads keeps serving the snapshot the joiner started on, so a
download longer than a round finishes; the joiner, then behind, replays the rounds it missed.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Optional

import msgpack
import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from swarm.dht.node import SwarmNode, recv_frame, send_frame
from swarm.peer.diloco import DiLoCo, OuterStep
from swarm.peer.model import state_digest

logger = logging.getLogger(__name__)
RANGE_BYTES = 8 << 20  # bytes per request
FRAME_BYTES = 1 << 20  # bytes per frame within a range
REQUESTS_PER_HOLDER = 2  # in flight, so a holder's link does not idle between two ranges
STALL_SECONDS = 60.0  # a holder that sends nothing for this long is dropped (slow links are fine, silent ones not)
SNAPSHOT_SECONDS = 300.0  # a served snapshot is kept this long after its last request, for resuming joiners
KEPT_SNAPSHOTS = 2  # older snapshots still being downloaded (each asked for in the last STALL_SECONDS)
MAX_REPLAY_STEPS = 64
REPLAY_HOLDERS = 3  # asked in turn for the outer steps since our state, before downloading it
REPLAY_STALL = 10.0  # s to wait for a holder's listing of them


class StateSyncError(RuntimeError):
    """No holder could provide the state asked for. `moved_on`: holders answered, serving another state (the swarm
    moved on while we looked: ask again for the newest at once rather than back off)."""

    def __init__(self, message: str, moved_on: bool = False):
        super().__init__(message)
        self.moved_on = moved_on


def protocol(run_id: str) -> str:
    return f"swarm.{run_id}.state"


@dataclass
class Snapshot:
    header: dict  # round, tokens_seen, digest, size, sha256
    payload: bytes
    last_used: float


class StateServer:
    """Serves consistent snapshots of one peer's DiLoCo state, by byte range."""

    def __init__(self, diloco: DiLoCo):
        self.diloco = diloco
        self._snapshot: Optional[Snapshot] = None
        self._kept: dict[str, Snapshot] = {}  # by sha256: snapshots of past rounds that joiners are downloading
        self._lock = asyncio.Lock()
        self.bytes_served = 0

    async def current(self) -> Snapshot:
        """The snapshot of the state as it is now (serialised once per round, off the event loop)."""
        async with self._lock:
            key = (self.diloco.round, self.diloco.digest())
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
        request = msgpack.unpackb(await recv_frame(reader, 1024))
        if isinstance(request, dict) and "replay_from" in request:
            await self._send_steps(remote, request, writer)
            return
        offset, length = (request.get("offset", 0), request.get("length", 0)) if isinstance(request, dict) else \
            (None, None)
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (offset, length)):
            raise ValueError(f"malformed state request from {remote}: {request!r}")
        wanted = request.get("sha256")
        snapshot = await self.snapshot(wanted if isinstance(wanted, str) else None)
        await send_frame(writer, msgpack.packb(snapshot.header))
        if wanted is not None and wanted != snapshot.header["sha256"]:
            return  # we no longer keep what the joiner downloads: it sees our sha256 and goes elsewhere
        end = min(offset + length, len(snapshot.payload))
        view = memoryview(snapshot.payload)
        for start in range(offset, end, FRAME_BYTES):
            await send_frame(writer, view[start:min(start + FRAME_BYTES, end)])
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
            raise ValueError(f"malformed replay request from {remote}: {request!r}")
        steps = _up_to(self.diloco.steps_since(round_no, digest)[:MAX_REPLAY_STEPS], target)
        await send_frame(writer, msgpack.packb({"steps": [
            {"round": s.round, "digest": s.digest, "after": s.after, "tokens": s.tokens,
             "chunks": [[a, b, len(payload)] for a, b, payload in s.wire] if s.wire is not None else None}
            for s in steps]}))
        for step in steps if request.get("bodies", True) else []:
            for body in [payload for _, _, payload in step.wire] if step.wire is not None else \
                    [memoryview(step.average.numpy()).cast("B")]:
                view = memoryview(body)
                for start in range(0, len(view), FRAME_BYTES):
                    await send_frame(writer, view[start:start + FRAME_BYTES])
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


async def serve_state(node: SwarmNode, run_id: str, diloco: DiLoCo) -> StateServer:
    server = StateServer(diloco)
    await node.add_stream_handler(protocol(run_id), server.handle)
    return server


@dataclass
class Downloaded:
    header: dict
    seconds: float
    bytes_by_holder: Counter


@dataclass
class Replayed:
    steps: int
    bytes_by_holder: Counter

    @property
    def bytes(self) -> int:
        return sum(self.bytes_by_holder.values())


@dataclass
class Synced:
    """How `sync_state` brought a peer to the swarm's state: by replaying outer steps, or by a download."""

    downloaded: Optional[Downloaded]
    replayed: Optional[Replayed]
    seconds: float

    @property
    def bytes(self) -> int:
        """What the replay's steps or the download's state took in bytes (not counting failed tries)."""
        return sum((self.downloaded or self.replayed).bytes_by_holder.values())

    def describe(self, diloco: DiLoCo) -> str:
        if self.downloaded is not None:
            d, size = self.downloaded, self.downloaded.header["size"]
            how = (f"downloaded the state of round {d.header['round']} from {len(d.bytes_by_holder)} peer(s): "
                   f"{size / 1e6:.1f} MB in {d.seconds:.1f} s, {size / 1e6 / max(d.seconds, 1e-9):.1f} MB/s")
        else:
            r = self.replayed
            how = f"replayed {r.steps} outer step(s) from {len(r.bytes_by_holder)} peer(s): {r.bytes / 1e6:.1f} MB"
        return f"synced state of round {diloco.round}, digest {diloco.digest()} ({how}) in {self.seconds:.1f} s"


async def sync_state(node: SwarmNode, holders: list[str], run_id: str, diloco: DiLoCo, digest: str,
                     stall: float = STALL_SECONDS, range_bytes: int = RANGE_BYTES) -> Synced:
    """Bring `diloco` to the swarm's state, the state `digest` that `holders` announced: by replaying the outer
    steps we missed where a holder still logs them from our state to `digest`, else by downloading the state.
    A download the swarm overtook (holders keep serving the snapshot it started on) ends in that older state: the
    caller, still behind, asks again, and then replays. Raises StateSyncError, leaving `diloco` as it was, if
    neither works."""
    started = time.monotonic()
    replayed = await replay_steps(node, holders, run_id, diloco, digest, stall)
    if replayed is not None:
        return Synced(None, replayed, time.monotonic() - started)
    downloaded = await download_state(node, holders, run_id, diloco, digest, stall, range_bytes)
    return Synced(downloaded, None, time.monotonic() - started)


async def replay_steps(node: SwarmNode, holders: list[str], run_id: str, diloco: DiLoCo, digest: str,
                       stall: float = STALL_SECONDS) -> Optional[Replayed]:
    """Replay the outer steps the holders logged from our state to the state `digest` (DiLoCo.replay checks every
    step's state digest, and the chain must end at `digest`: a holder cannot lead us anywhere else). Up to
    REPLAY_HOLDERS holders are asked at once for their listing of the chain; its steps then come from all holders
    that list the same chain, in parallel, one step a request, so a replay is not capped by one holder's uplink.
    None if no holder could take us there."""
    asked, n = holders[:REPLAY_HOLDERS], diloco.numel
    start = (diloco.round, diloco.digest())

    async def chain_of(holder: str) -> list[dict]:
        try:  # a short wait: a dead holder must not hold up the download long (the steps get the full stall)
            return (await _ask_steps(node, holder, run_id, n, start, digest, min(stall, REPLAY_STALL),
                                     bodies=False))[0]
        except Exception as e:  # noqa: BLE001 - unreachable, broken or lying holder: the others may have it
            logger.info("state holder %s listed no outer steps: %s", holder[-8:], _reason(e))
            return []

    chains = await asyncio.gather(*(chain_of(h) for h in asked))
    chain = next((c for c in chains if c), None)
    if chain is None:
        return None
    sources = [h for h, c in zip(asked, chains) if c == chain]

    async def fetch(holder: str, k: int) -> tuple[OuterStep, int]:
        meta = chain[k]
        metas, steps = await _ask_steps(node, holder, run_id, n, (meta["round"], meta["digest"]), meta["after"],
                                        stall, bodies=True)
        if metas != [meta]:
            raise ValueError("it sent another step than it listed")
        return steps[0], sum(_sizes(meta["chunks"], n))

    async def replay_from(chosen: list[str]) -> tuple[Optional[Replayed], bool]:
        """The replay with the steps from `chosen`, and whether they all came (so a failure was a bad step)."""
        steps, served, _ = await _spread(chosen, list(range(len(chain))), fetch, "replay")
        if len(steps) < len(chain):
            logger.info("replay failed: every holder dropped, %d of %d outer steps missing",
                        len(chain) - len(steps), len(chain))
            return None, False
        try:
            await asyncio.get_running_loop().run_in_executor(None, diloco.replay,
                                                             [steps[k] for k in range(len(chain))])
        except ValueError as e:
            logger.info("replaying outer steps from %s failed: %s", ", ".join(h[-8:] for h in served), e)
            return None, True
        return Replayed(len(chain), served), True

    replayed, complete = await replay_from(sources)
    if replayed is None and complete and len(sources) > 1:
        # Some holder sent a step other than the one that got there; we cannot tell which, so try each alone:
        # the steps cost a fraction of the state, and the download is what they save.
        for holder in sources:
            replayed, _ = await replay_from([holder])
            if replayed is not None:
                break
    return replayed


async def _ask_steps(node: SwarmNode, holder: str, run_id: str, numel: int, start: tuple[int, str], digest: str,
                     stall: float, bodies: bool) -> tuple[list[dict], list[OuterStep]]:
    """`holder`'s listing of its logged outer steps from the state `start` (round, state digest) to the state
    `digest`, validated, and (`bodies`) the steps themselves."""
    reader, writer = await asyncio.wait_for(node.open_stream(holder, protocol(run_id)), stall)
    try:
        await send_frame(writer, msgpack.packb({"replay_from": start[0], "digest": start[1], "to": digest,
                                                "bodies": bodies}))
        header = msgpack.unpackb(await asyncio.wait_for(recv_frame(reader, 1 << 20), stall))
        listed = header.get("steps") if isinstance(header, dict) else None
        if not isinstance(listed, list) or len(listed) > MAX_REPLAY_STEPS or not all(
                isinstance(m, dict) and all(isinstance(m.get(k), int) and m[k] >= 0 for k in ("round", "tokens"))
                and all(isinstance(m.get(k), str) for k in ("digest", "after")) and _sizes(m.get("chunks"), numel)
                for m in listed):
            raise ValueError("malformed replay header")
        if not listed:
            return [], []
        if listed[-1]["after"] != digest or any(m["after"] == digest for m in listed[:-1]):
            raise ValueError(f"its steps do not end at the swarm's state {digest}")
        total = sum(sum(_sizes(m["chunks"], numel)) for m in listed)
        if total > 8 * numel + (1 << 20):  # an honest log holds at most a state's bytes
            raise ValueError(f"it offers {total / 1e6:.1f} MB of outer steps, more than a state")
        steps = []
        for meta in listed if bodies else []:
            received = [await _receive(reader, size, stall, "outer step") for size in _sizes(meta["chunks"], numel)]
            fields = (meta["round"], meta["digest"], meta["after"], meta["tokens"])
            if meta["chunks"] is None:
                steps.append(OuterStep(*fields, average=torch.frombuffer(received[0], dtype=torch.float32)))
            else:
                steps.append(OuterStep(*fields, wire=tuple((a, b, bytes(body)) for (a, b, _), body
                                                           in zip(meta["chunks"], received))))
        return listed, steps
    finally:
        writer.close()


def _sizes(chunks, numel: int) -> list[int]:
    """The byte sizes of a logged step's bodies: its chunks' (each at most fp32 plus a header), or one fp32
    vector; empty if `chunks` is malformed."""
    if chunks is None:
        return [4 * numel]
    if not isinstance(chunks, list) or not chunks or not all(
            isinstance(c, list) and len(c) == 3 and all(isinstance(x, int) and x >= 0 for x in c) and
            c[0] < c[1] <= numel and 0 < c[2] <= 4 * (c[1] - c[0]) + (64 << 10) for c in chunks):
        return []
    return [c[2] for c in chunks]


async def _receive(reader: asyncio.StreamReader, size: int, stall: float, what: str) -> bytearray:
    """`size` bytes sent as frames; ValueError if the frames add up to anything else."""
    data = bytearray()
    while len(data) < size:
        frame = await asyncio.wait_for(recv_frame(reader, FRAME_BYTES), stall)
        if not frame or len(data) + len(frame) > size:
            raise ValueError(f"{what} of the wrong length")
        data += frame
    return data


async def _request(node: SwarmNode, holder: str, run_id: str, offset: int, length: int,
                   sha256: Optional[str], stall: float) -> tuple[dict, bytes]:
    """One request: the holder's current header, and bytes [offset, offset + length) of its state if its
    sha256 is `sha256` (or none was given)."""
    reader, writer = await asyncio.wait_for(node.open_stream(holder, protocol(run_id)), stall)
    try:
        await send_frame(writer, msgpack.packb({"offset": offset, "length": length, "sha256": sha256}))
        header = msgpack.unpackb(await asyncio.wait_for(recv_frame(reader, 64 << 10), stall))
        if not isinstance(header, dict) or not all(isinstance(header.get(k), int) and header[k] >= 0
                                                   for k in ("size", "round", "tokens_seen")) or \
                not isinstance(header.get("sha256"), str) or not isinstance(header.get("digest"), str):
            raise ValueError("malformed state header")
        if length == 0 or (sha256 is not None and header["sha256"] != sha256):
            return header, b""
        return header, bytes(await _receive(reader, max(min(offset + length, header["size"]) - offset, 0), stall,
                                            "state range"))
    finally:
        writer.close()


async def download_state(node: SwarmNode, holders: list[str], run_id: str, diloco: DiLoCo, digest: str,
                         stall: float = STALL_SECONDS, range_bytes: int = RANGE_BYTES) -> Downloaded:
    """Fetch the state whose state digest is `digest` from `holders` (in parallel, by range), verify it and
    load it into `diloco`. Raises StateSyncError, leaving `diloco` untouched, if no holder can provide it."""
    started = time.monotonic()
    max_bytes = 2 * 4 * diloco.numel + (64 << 20)  # params + momentum, plus safetensors' own header

    async def header_of(holder: str) -> Optional[dict]:
        try:
            header, _ = await _request(node, holder, run_id, 0, 0, None, stall)
            return header
        except Exception as e:  # noqa: BLE001 - unreachable or broken holder: use the others
            logger.info("state holder %s did not answer: %s", holder[-8:], _reason(e))
            return None

    headers = dict(zip(holders, await asyncio.gather(*(header_of(h) for h in holders))))
    fitting = {h: x for h, x in headers.items() if x is not None and x["digest"] == digest
               and 0 < x["size"] <= max_bytes}
    if not fitting:
        served = sorted({x["digest"] for x in headers.values() if x is not None and x["digest"] != digest})
        raise StateSyncError(f"none of {len(holders)} peers serves state with digest {digest}"
                             + (f" (they serve {', '.join(served)})" if served else ""), moved_on=bool(served))
    # Holders of the same state serialise the same bytes: follow the header (sha256, round, and tokens seen, which
    # no digest covers) most of them announce, and if its bytes do not match the digest, the next, so one honest
    # holder is enough whatever the others serve.
    tensors, tried, failed = None, [], None
    claims = Counter((x["sha256"], x["round"], x["tokens_seen"]) for x in fitting.values())
    for claim, _ in claims.most_common():
        sources = [h for h, x in fitting.items() if (x["sha256"], x["round"], x["tokens_seen"]) == claim]
        header = fitting[sources[0]]
        try:
            tensors, served = await _fetch_verified(node, sources, run_id, header, digest, diloco, stall, range_bytes)
        except StateSyncError as e:  # all of them dropped or moved on: the next claim's holders may still serve
            failed = e
            continue
        if tensors is not None:
            break
        tried += served
    if tensors is None and not tried:
        raise failed
    if tensors is None:
        raise StateSyncError(f"state from {', '.join(h[-8:] for h in tried)} does not match its sha256 or the "
                             f"state digest {digest}", moved_on=failed is not None and failed.moved_on)
    diloco.load_state_tensors(tensors, header["round"], header["tokens_seen"])
    return Downloaded(header, time.monotonic() - started, served)


async def _fetch_verified(node: SwarmNode, sources: list[str], run_id: str, header: dict, digest: str,
                          diloco: DiLoCo, stall: float, range_bytes: int) -> tuple[Optional[dict], Counter]:
    """The tensors of the state `header` describes, from all `sources` at once, verified against its sha256 and
    the swarm's `digest`, with the bytes from each source; (None, ...) if they do not verify, from all together
    nor from any alone (some source sent bytes other than it announced, and we cannot tell which)."""
    size, sha256, round_no = header["size"], header["sha256"], header["round"]
    payload, served = await _fetch(node, sources, run_id, size, sha256, stall, range_bytes)
    tensors = _verified(payload, sha256, round_no, digest, diloco)
    if tensors is None and len(served) > 1:
        for holder in served:
            try:
                payload, alone = await _fetch(node, [holder], run_id, size, sha256, stall, range_bytes)
            except StateSyncError:
                continue
            tensors = _verified(payload, sha256, round_no, digest, diloco)
            if tensors is not None:
                return tensors, alone
    return tensors, served


class _MovedOn(ValueError):
    """A holder no longer serves what we fetch from it: its swarm took a round."""


async def _spread(sources: list[str], keys: list, fetch, what: str) -> tuple[dict, Counter, int]:
    """`await fetch(holder, key)` -> (value, bytes) for every key, from all `sources` at once (REQUESTS_PER_HOLDER
    in flight each); a key whose fetch fails goes back for another source, and that source is dropped. Returns
    the values by key (some missing if every source dropped), the bytes from each source, and how many sources
    dropped because they moved on (_MovedOn)."""
    values: dict = {}
    todo: asyncio.Queue = asyncio.Queue()
    for key in keys:
        todo.put_nowait(key)
    served: Counter = Counter()
    alive, moved_on = set(sources), set()

    async def fetch_from(holder: str) -> None:
        while holder in alive:
            try:
                key = todo.get_nowait()
            except asyncio.QueueEmpty:
                return
            try:
                value, size = await fetch(holder, key)
            except Exception as e:  # noqa: BLE001 - the key goes back for another holder
                todo.put_nowait(key)
                if isinstance(e, _MovedOn):
                    moved_on.add(holder)
                if holder in alive:
                    alive.discard(holder)
                    logger.info("state holder %s dropped mid-%s (%s); %d left", holder[-8:], what, _reason(e),
                                len(alive))
                return
            values[key] = value
            served[holder] += size

    while todo.qsize() and alive:  # one key to each source before a second to any: few keys spread too
        await asyncio.gather(*(fetch_from(h) for _ in range(REQUESTS_PER_HOLDER) for h in sorted(alive)))
    return values, served, len(moved_on)


async def _fetch(node: SwarmNode, sources: list[str], run_id: str, size: int, sha256: str, stall: float,
                 range_bytes: int) -> tuple[bytes, Counter]:
    """The `size` bytes of the state with `sha256`, by range from all `sources` at once; a range that fails is
    fetched again from another source. Returns (payload, bytes fetched from each source)."""
    async def fetch(holder: str, offset: int) -> tuple[bytes, int]:
        theirs, data = await _request(node, holder, run_id, offset, range_bytes, sha256, stall)
        if theirs["sha256"] != sha256:
            raise _MovedOn("its state changed")
        if len(data) != min(range_bytes, size - offset):
            raise ValueError("state range of the wrong length")
        return data, len(data)

    offsets = list(range(0, size, range_bytes))
    pieces, served, moved_on = await _spread(sources, offsets, fetch, "download")
    if len(pieces) < len(offsets):
        raise StateSyncError(f"state download failed: every holder dropped, {len(offsets) - len(pieces)} of "
                             f"{len(offsets)} ranges missing"
                             + (f" ({moved_on} moved on to newer params)" if moved_on else ""),
                             moved_on=bool(moved_on))
    return b"".join(pieces[offset] for offset in sorted(pieces)), served


def _verified(payload: bytes, sha256: str, round_no: int, digest: str, diloco: DiLoCo) -> Optional[dict]:
    """The state's tensors if `payload` has the announced sha256, and they and `round_no` the swarm's digest."""
    if hashlib.sha256(payload).hexdigest() != sha256:
        return None
    try:
        tensors = load_tensors(payload)
        params = [tensors[f"params.{name}"] for name in diloco.names]
        momenta = [tensors.get(f"momentum.{name}") for name in diloco.names]
        if any(p.shape != mine.shape or (m is not None and (m.shape != p.shape or m.dtype != torch.float32))
               for p, m, mine in zip(params, momenta, diloco.global_params)) or \
                state_digest(params, momenta, round_no) != digest:
            return None
    except Exception:  # noqa: BLE001 - malformed tensors are as bad as wrong bytes
        return None
    return tensors


def _reason(error: BaseException) -> str:
    if isinstance(error, asyncio.TimeoutError):
        return "stalled"
    return str(error).splitlines()[0] if str(error) else type(error).__name__
