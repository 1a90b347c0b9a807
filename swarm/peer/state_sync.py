"""Serve this peer's global state to late joiners and download it from a live peer, verified against the
params digest the serving peer announces.
"""

from __future__ import annotations

import asyncio
import logging

import msgpack
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from swarm.dht.node import SwarmNode, recv_frame, send_frame
from swarm.peer.diloco import DiLoCo

logger = logging.getLogger(__name__)


class StateSyncError(RuntimeError):
    pass


def protocol(run_id: str) -> str:
    return f"swarm.{run_id}.state"


async def serve_state(node: SwarmNode, run_id: str, diloco: DiLoCo) -> None:
    async def handler(remote: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await recv_frame(reader, 1024)  # the request carries nothing yet; read it so the stream is well-formed
        loop = asyncio.get_running_loop()
        # Serialising takes a consistent snapshot under the DiLoCo lock; do it off the event loop.
        header, payload = await loop.run_in_executor(None, _snapshot, diloco)
        await send_frame(writer, msgpack.packb(header))
        await send_frame(writer, payload)
        logger.info("served state of round %d (%.1f MB) to %s", header["round"], len(payload) / 1e6, remote[-8:])

    await node.add_stream_handler(protocol(run_id), handler)


def _snapshot(diloco: DiLoCo) -> tuple[dict, bytes]:
    with diloco.lock:  # round, digest and tensors from the same moment
        header = {"round": diloco.round, "tokens_seen": diloco.tokens_seen, "digest": diloco.digest()}
        tensors = diloco.state_tensors()
    return header, save_tensors(tensors)


async def download_state(node: SwarmNode, peer_id: str, run_id: str, diloco: DiLoCo, timeout: float) -> dict:
    """Fetch global params + outer momentum from `peer_id` and load them; returns the header
    (round, tokens_seen, digest). Raises StateSyncError if the peer is unreachable or the state does not verify."""
    max_bytes = 2 * 4 * diloco.numel + (64 << 20)  # params + momentum, plus safetensors' own header

    async def _fetch() -> tuple[dict, bytes]:
        reader, writer = await node.open_stream(peer_id, protocol(run_id))
        try:
            await send_frame(writer, msgpack.packb({"want": "state"}))
            header = msgpack.unpackb(await recv_frame(reader, 64 << 10))
            return header, await recv_frame(reader, max_bytes)
        finally:
            writer.close()

    try:
        header, payload = await asyncio.wait_for(_fetch(), timeout)
        tensors = load_tensors(payload)
        diloco.load_state_tensors(tensors, header["round"], header["tokens_seen"])
    except asyncio.TimeoutError:
        raise StateSyncError(f"state download from {peer_id[-8:]} timed out after {timeout:.0f} s") from None
    except Exception as e:  # noqa: BLE001 - unreachable peer, bad frames, bad tensors: all mean "try another"
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise StateSyncError(f"state download from {peer_id[-8:]} failed: {reason}") from None
    if diloco.digest() != header.get("digest"):
        raise StateSyncError(f"state from {peer_id[-8:]} does not match its announced digest")
    return header
