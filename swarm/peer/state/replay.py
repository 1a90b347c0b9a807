"""Catch a peer that is behind the swarm up by replaying the outer steps holders logged (DiLoCo.replay_log) from
its state to the swarm's: each costs what its average cost on the wire, a fraction of the state. Every step's
state digest is checked, and the chain must end at the swarm's digest, so a holder cannot lead us elsewhere."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from dataclasses import dataclass
from typing import Optional

import msgpack
import torch

from swarm.dht.frames import recv_frame
from swarm.dht.node import SwarmNode
from swarm.peer.diloco import DiLoCo
from swarm.peer.outer import OuterStep
from swarm.peer.state.wire import (MAX_REPLAY_STEPS, STALL_SECONDS, failure_reason, receive_bytes, request_stream,
                                   spread)

logger = logging.getLogger(__name__)
REPLAY_HOLDERS = 3  # asked in turn for the outer steps since our state, before downloading it
REPLAY_STALL = 10.0  # s to wait for a holder's listing of them


@dataclass
class Replayed:
    steps: int
    bytes_by_holder: Counter

    @property
    def bytes(self) -> int:
        return sum(self.bytes_by_holder.values())


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
            logger.info("state holder %s listed no outer steps: %s", holder[-8:], failure_reason(e))
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
        steps, served, _ = await spread(chosen, list(range(len(chain))), fetch, "replay")
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
    request = {"replay_from": start[0], "digest": start[1], "to": digest, "bodies": bodies}
    async with request_stream(node, holder, run_id, request, stall) as reader:
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
            received = [await receive_bytes(reader, size, stall, "outer step")
                        for size in _sizes(meta["chunks"], numel)]
            fields = (meta["round"], meta["digest"], meta["after"], meta["tokens"])
            if meta["chunks"] is None:
                steps.append(OuterStep(*fields, average=torch.frombuffer(received[0], dtype=torch.float32)))
            else:
                steps.append(OuterStep(*fields, wire=tuple((a, b, bytes(body)) for (a, b, _), body
                                                           in zip(meta["chunks"], received))))
        return listed, steps


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
