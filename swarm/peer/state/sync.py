"""Bring a peer to the swarm's global state (params + outer momentum): replay the outer steps it missed where a
holder still logs them (state_replay), else download the state (state_download). The server side is state_serve;
this module re-exports what the peer uses of it."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

from swarm.dht.node import SwarmNode
from swarm.peer.diloco import DiLoCo
from swarm.peer.state.download import RANGE_BYTES, Downloaded, download_state
from swarm.peer.state.replay import Replayed, replay_steps
from swarm.peer.state.serve import serve_state
from swarm.peer.state.wire import STALL_SECONDS, StateSyncError, sync_deadline
from swarm.words import counted

__all__ = ["Downloaded", "Replayed", "StateSyncError", "Synced", "serve_state", "sync_deadline", "sync_state"]


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
            how = (f"downloaded the state of round {d.header['round']} from "
                   f"{counted(len(d.bytes_by_holder), 'peer')}: {size / 1e6:.1f} MB in {d.seconds:.1f} s, "
                   f"{size / 1e6 / max(d.seconds, 1e-9):.1f} MB/s")
        else:
            r = self.replayed
            how = (f"replayed {counted(r.steps, 'outer step')} from {counted(len(r.bytes_by_holder), 'peer')}: "
                   f"{r.bytes / 1e6:.1f} MB")
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
