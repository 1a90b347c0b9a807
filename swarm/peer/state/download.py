"""Download the swarm's state from its holders. A download asks every holder for the state's header (round, tokens
seen, state digest, size, sha256 of the serialised bytes), keeps the holders whose digest is the one the swarm
announces, and fetches the bytes in ranges from all of them at once, so a joiner's downlink is not capped by one
holder's uplink. A range that fails goes back to the queue and is fetched from another holder: a holder that
leaves mid-download costs only its range in flight. Nothing is loaded before the bytes match the sha256 and the
tensors match the digest, so a bad or hostile holder can waste time but never corrupt the model."""

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

from swarm.dht.frames import recv_frame
from swarm.dht.node import SwarmNode
from swarm.peer.diloco import DiLoCo
from swarm.peer.digest import state_digest
from swarm.peer.state.wire import (STALL_SECONDS, MovedOn, StateSyncError, failure_reason, receive_bytes,
                                   request_stream, spread)
from swarm.words import counted

logger = logging.getLogger(__name__)
RANGE_BYTES = 8 << 20  # bytes per request


@dataclass
class Downloaded:
    header: dict
    seconds: float
    bytes_by_holder: Counter


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
            logger.info("state holder %s did not answer: %s", holder[-8:], failure_reason(e))
            return None

    headers = dict(zip(holders, await asyncio.gather(*(header_of(h) for h in holders))))
    fitting = {h: x for h, x in headers.items() if x is not None and x["digest"] == digest
               and 0 < x["size"] <= max_bytes}
    if not fitting:
        served = sorted({x["digest"] for x in headers.values() if x is not None and x["digest"] != digest})
        asked = f"none of {counted(len(holders), 'peer')}" if len(holders) != 1 else "the one peer asked"
        raise StateSyncError(f"{asked} serves state with digest {digest}"
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
    # (off the event loop, as the checks before: at a billion parameters a copy of seconds, which heartbeats and a
    # stage backup's service, swarm/peer/pipeline/keeper.py, must not wait for)
    await asyncio.to_thread(diloco.load_state_tensors, tensors, header["round"], header["tokens_seen"])
    return Downloaded(header, time.monotonic() - started, served)


async def _request(node: SwarmNode, holder: str, run_id: str, offset: int, length: int,
                   sha256: Optional[str], stall: float) -> tuple[dict, bytes]:
    """One request: the holder's current header, and bytes [offset, offset + length) of its state if its
    sha256 is `sha256` (or none was given)."""
    request = {"offset": offset, "length": length, "sha256": sha256}
    async with request_stream(node, holder, run_id, request, stall) as reader:
        header = msgpack.unpackb(await asyncio.wait_for(recv_frame(reader, 64 << 10), stall))
        if not isinstance(header, dict) or not all(isinstance(header.get(k), int) and not isinstance(header[k], bool)
                                                   and header[k] >= 0 for k in ("size", "round", "tokens_seen")) or \
                not isinstance(header.get("sha256"), str) or not isinstance(header.get("digest"), str):
            raise ValueError("malformed state header")
        if length == 0 or (sha256 is not None and header["sha256"] != sha256):
            return header, b""
        return header, bytes(await receive_bytes(reader, max(min(offset + length, header["size"]) - offset, 0),
                                                 stall, "state range"))


async def _fetch_verified(node: SwarmNode, sources: list[str], run_id: str, header: dict, digest: str,
                          diloco: DiLoCo, stall: float, range_bytes: int) -> tuple[Optional[dict], Counter]:
    """The tensors of the state `header` describes, from all `sources` at once, verified against its sha256 and
    the swarm's `digest`, with the bytes from each source; (None, ...) if they do not verify, from all together
    nor from any alone (some source sent bytes other than it announced, and we cannot tell which)."""
    size, sha256, round_no = header["size"], header["sha256"], header["round"]
    payload, served = await _fetch(node, sources, run_id, size, sha256, stall, range_bytes)
    tensors = await asyncio.to_thread(_verified, payload, sha256, round_no, digest, diloco)
    if tensors is None and len(served) > 1:
        for holder in served:
            try:
                payload, alone = await _fetch(node, [holder], run_id, size, sha256, stall, range_bytes)
            except StateSyncError:
                continue
            tensors = await asyncio.to_thread(_verified, payload, sha256, round_no, digest, diloco)
            if tensors is not None:
                return tensors, alone
    return tensors, served


async def _fetch(node: SwarmNode, sources: list[str], run_id: str, size: int, sha256: str, stall: float,
                 range_bytes: int) -> tuple[bytes, Counter]:
    """The `size` bytes of the state with `sha256`, by range from all `sources` at once; a range that fails is
    fetched again from another source. Returns (payload, bytes fetched from each source)."""
    async def fetch(holder: str, offset: int) -> tuple[bytes, int]:
        theirs, data = await _request(node, holder, run_id, offset, range_bytes, sha256, stall)
        if theirs["sha256"] != sha256:
            raise MovedOn("its state changed")
        if len(data) != min(range_bytes, size - offset):
            raise ValueError("state range of the wrong length")
        return data, len(data)

    offsets = list(range(0, size, range_bytes))
    pieces, served, moved_on = await spread(sources, offsets, fetch, "download")
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
                state_digest(params, momenta, round_no, diloco.fragments) != digest:
            return None
    except Exception:  # noqa: BLE001 - malformed tensors are as bad as wrong bytes
        return None
    return tensors
