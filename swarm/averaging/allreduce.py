"""All-or-nothing group all-reduce of a flat fp32 vector, weighted by tokens processed.

Each member reduces one contiguous part: every peer sends part j (encoded by the round's codec) to member j,
member j averages what it received and sends the result back to everyone with the list of contributors. A peer
applies the result only if every part was averaged over the whole group and every member confirmed it holds all
parts (commit phase); otherwise the round fails for it and nothing is applied. Survivors decode the same bytes,
so they end with bit-identical averages.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import msgpack
import torch

from swarm.averaging.matchmaking import Group
from swarm.compression import CodecError, get_codec
from swarm.dht.node import SwarmNode, recv_frame, send_frame

logger = logging.getLogger(__name__)
MAX_HEADER_BYTES = 64 << 10
MAX_PENDING_GROUPS = 8


class AllReduceError(RuntimeError):
    """The round failed for this peer; `reason` is a short metric label (timeout, peer_failed, bad_data, ...)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass
class AllReduceResult:
    average: torch.Tensor  # flat fp32, identical on every member
    total_weight: float
    group_size: int
    bytes_sent: int
    bytes_received: int
    seconds: float


def partition(numel: int, n_parts: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) ranges covering `numel` elements in `n_parts` near-equal parts."""
    base, extra = divmod(numel, n_parts)
    bounds, start = [], 0
    for index in range(n_parts):
        end = start + base + (1 if index < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


@dataclass
class _Mailbox:
    """Messages of one group, which may arrive before this peer has started that group's all-reduce."""

    created: float = field(default_factory=time.monotonic)
    slots: dict[tuple[str, str], asyncio.Future] = field(default_factory=dict)

    def slot(self, phase: str, sender: str) -> asyncio.Future:
        key = (phase, sender)
        if key not in self.slots:
            self.slots[key] = asyncio.get_running_loop().create_future()
        return self.slots[key]


class GroupAllReduce:
    """Serves the all-reduce protocol of one run on a node and runs all-reduces for its peer."""

    def __init__(self, node: SwarmNode, run_id: str, codec_name: str, max_numel: int,
                 on_bad_peer: Optional[Callable[[str, str], None]] = None):
        self.node, self.codec = node, get_codec(codec_name)
        self.protocol = f"swarm.{run_id}.allreduce"
        self.max_numel = max_numel
        self.on_bad_peer = on_bad_peer or (lambda peer, reason: None)
        self._mailboxes: dict[str, _Mailbox] = {}

    async def start(self) -> None:
        await self.node.add_stream_handler(self.protocol, self._on_stream)

    def _mailbox(self, group_id: str) -> _Mailbox:
        if group_id not in self._mailboxes:
            while len(self._mailboxes) >= MAX_PENDING_GROUPS:  # bounded memory against stray or hostile senders
                oldest = min(self._mailboxes, key=lambda g: self._mailboxes[g].created)
                del self._mailboxes[oldest]
            self._mailboxes[group_id] = _Mailbox()
        return self._mailboxes[group_id]

    async def _on_stream(self, remote: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        header = msgpack.unpackb(await recv_frame(reader, MAX_HEADER_BYTES))
        if not isinstance(header, dict) or header.get("phase") not in ("part", "avg", "commit"):
            raise ValueError(f"malformed all-reduce header from {remote}")
        payload = await recv_frame(reader, max_bytes=16 + 8 * self.max_numel + MAX_HEADER_BYTES)
        slot = self._mailbox(str(header.get("group_id")))
        future = slot.slot(header["phase"], remote)  # keyed by the authenticated sender, not a claimed one
        if not future.done():
            future.set_result((header, payload))
        await send_frame(writer, b"ok")

    async def _send(self, peer: str, header: dict, payload: bytes) -> int:
        reader, writer = await self.node.open_stream(peer, self.protocol)
        try:
            await send_frame(writer, msgpack.packb(header))
            await send_frame(writer, payload)
            await recv_frame(reader, 16)
        finally:
            writer.close()
        return len(payload)

    async def run(self, group: Group, vector: torch.Tensor, weight: float, timeout: float) -> AllReduceResult:
        """Average `vector` (flat fp32) over `group`, weighted by `weight`; raises AllReduceError on failure."""
        try:
            return await asyncio.wait_for(self._run(group, vector, weight), timeout)
        except asyncio.TimeoutError:
            raise AllReduceError("timeout", f"all-reduce of round {group.round} timed out after {timeout:.0f} s") \
                from None
        finally:
            self._mailboxes.pop(group.group_id, None)

    async def _run(self, group: Group, vector: torch.Tensor, weight: float) -> AllReduceResult:
        started = time.monotonic()
        me, members = self.node.peer_id, group.members
        index, n = members.index(me), len(members)
        vector = vector.detach().to(torch.float32).contiguous().view(-1)
        bounds = partition(vector.numel(), n)
        mailbox = self._mailbox(group.group_id)
        base = {"group_id": group.group_id, "round": group.round}
        sent = received = 0

        # Phase 1: scatter part j to its reducer j.
        sends = [self._send(members[j], {**base, "phase": "part", "weight": float(weight)},
                            self.codec.encode(vector[bounds[j][0]:bounds[j][1]]))
                 for j in range(n) if j != index]
        start, end = bounds[index]
        total = vector[start:end] * weight
        total_weight = float(weight)
        contributions, nbytes = await self._gather(mailbox, "part", [m for m in members if m != me], sends)
        sent += nbytes
        for sender, (header, payload) in contributions.items():
            received += len(payload)
            part = self._decode(sender, payload, end - start)
            sender_weight = header.get("weight")
            if not isinstance(sender_weight, (int, float)) or not 0 <= sender_weight < 1e18:
                self.on_bad_peer(sender, "bad_weight")
                raise AllReduceError("bad_data", f"peer {sender[-8:]} sent an invalid weight {sender_weight!r}")
            total += part * sender_weight
            total_weight += sender_weight
        if total_weight <= 0:
            raise AllReduceError("bad_data", "the group's total weight is zero: nobody trained this round")
        my_average = total / total_weight
        encoded_average = self.codec.encode(my_average)
        my_average = self.codec.decode(encoded_average, max_numel=end - start)  # what everyone else will hold

        # Phase 2: send the averaged part back to every member, naming who is in it.
        avg_header = {**base, "phase": "avg", "contributors": list(members), "total_weight": total_weight}
        sends = [self._send(m, avg_header, encoded_average) for m in members if m != me]
        averages, nbytes = await self._gather(mailbox, "avg", [m for m in members if m != me], sends)
        sent += nbytes
        result = torch.empty_like(vector)
        result[start:end] = my_average
        for sender, (header, payload) in averages.items():
            received += len(payload)
            j = members.index(sender)
            if header.get("contributors") != list(members) or header.get("total_weight") != total_weight:
                # The all-or-nothing rule: a part averaged over another set of peers must not be applied.
                raise AllReduceError("partial", f"part {j} from {sender[-8:]} was averaged over a different set "
                                                "of peers or weights; discarding the whole round")
            result[bounds[j][0]:bounds[j][1]] = self._decode(sender, payload, bounds[j][1] - bounds[j][0])

        # Phase 3: commit only once every member holds every part.
        sends = [self._send(m, {**base, "phase": "commit"}, b"") for m in members if m != me]
        await self._gather(mailbox, "commit", [m for m in members if m != me], sends)
        return AllReduceResult(result, total_weight, n, sent, received, time.monotonic() - started)

    async def _gather(self, mailbox: _Mailbox, phase: str, senders: list[str], sends: list) -> tuple[dict, int]:
        """Run our sends and wait for one message of `phase` from each sender; any failure fails the round.
        Returns {sender: (header, payload)} and the payload bytes we sent."""
        send_tasks = [asyncio.ensure_future(s) for s in sends]
        try:
            results = await asyncio.gather(*send_tasks)
        except Exception as e:  # noqa: BLE001 - any transport error means that peer is gone for this round
            for task in send_tasks:
                task.cancel()
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise AllReduceError("peer_failed", f"sending {phase} to a group member failed: {reason}") from None
        return {sender: await mailbox.slot(phase, sender) for sender in senders}, sum(results)

    def _decode(self, sender: str, payload: bytes, numel: int) -> torch.Tensor:
        try:
            part = self.codec.decode(payload, max_numel=numel)
        except CodecError as e:
            self.on_bad_peer(sender, "undecodable")
            raise AllReduceError("bad_data", f"peer {sender[-8:]} sent undecodable data: {e}") from None
        if part.numel() != numel or not torch.isfinite(part).all():
            self.on_bad_peer(sender, "bad_values")
            raise AllReduceError("bad_data", f"peer {sender[-8:]} sent {part.numel()} values (expected {numel}) "
                                             "or non-finite values")
        return part
