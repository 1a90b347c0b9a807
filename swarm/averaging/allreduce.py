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
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

import msgpack
import torch

from swarm.averaging.faults import FaultPlan
from swarm.averaging.matchmaking import Group
from swarm.averaging.partition import partition
from swarm.compression import CodecError, get_codec
from swarm.dht.node import SwarmNode, recv_frame, send_frame

logger = logging.getLogger(__name__)
MAX_HEADER_BYTES = 64 << 10
MAX_PENDING_GROUPS = 8


class AllReduceError(RuntimeError):
    """The attempt failed and nothing was applied. `reason` is a short metric label. `suspects` did not deliver
    (not waited for in the retry, but welcome if they show up); `rejected` sent bad data (left out of this round)."""

    def __init__(self, reason: str, message: str, suspects: set[str], rejected: set[str] = frozenset()):
        super().__init__(message)
        self.reason, self.suspects, self.rejected = reason, set(suspects), set(rejected)


class AdaptiveDeadlines:
    """Per-phase timeouts that follow the measured durations of recent all-reduces: a multiple of the slowest
    recent round, clamped to [floor, ceiling] from the recipe. Slow swarms do not time out every round; fast
    swarms do not wait long for a dead peer."""

    def __init__(self, floor: float, ceiling: float, factor: float = 3.0, window: int = 8):
        self.floor, self.ceiling, self.factor = floor, ceiling, factor
        self.recent: deque[float] = deque(maxlen=window)

    def record(self, seconds: float) -> None:
        self.recent.append(seconds)

    def phase_timeout(self) -> float:
        if not self.recent:
            return self.ceiling  # nothing measured yet: be patient
        return min(max(self.factor * max(self.recent), self.floor), self.ceiling)


class GroupConflict(RuntimeError):
    """A member is averaging the same round and attempt in a different group."""


@dataclass
class AllReduceResult:
    average: torch.Tensor  # flat fp32, identical on every member
    delivered: torch.Tensor  # our vector as the reducers decoded it: what error feedback compares against
    total_weight: float
    group_size: int
    bytes_sent: int
    bytes_received: int
    seconds: float


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

    def __init__(self, node: SwarmNode, run_id: str, codec_name: str, max_numel: int, deadlines: AdaptiveDeadlines,
                 on_bad_peer: Optional[Callable[[str, str], None]] = None, faults: Optional[FaultPlan] = None):
        self.node, self.codec = node, get_codec(codec_name)
        self.deadlines = deadlines
        self.faults = faults or FaultPlan()
        self.protocol = f"swarm.{run_id}.allreduce"
        self.max_numel = max_numel
        self.on_bad_peer = on_bad_peer or (lambda peer, reason: None)
        self._mailboxes: dict[str, _Mailbox] = {}
        self._running: dict[tuple[int, int], str] = {}  # (round, attempt) -> group id we are averaging in

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
        group_id = str(header.get("group_id"))
        running = self._running.get((header.get("round"), header.get("attempt")))
        if running is not None and running != group_id:
            # We average this round and attempt in another group: tell the sender at once, so it does not wait
            # out its timeout for a group that leader races made inconsistent.
            await send_frame(writer, b"conflict")
            return
        slot = self._mailbox(group_id)
        future = slot.slot(header["phase"], remote)  # keyed by the authenticated sender, not a claimed one
        if not future.done():
            future.set_result((header, payload))
        await send_frame(writer, b"ok")

    async def _send(self, peer: str, header: dict, payload: bytes) -> int:
        reader, writer = await self.node.open_stream(peer, self.protocol)
        try:
            await send_frame(writer, msgpack.packb(header))
            await send_frame(writer, payload)
            if await recv_frame(reader, 16) == b"conflict":
                raise GroupConflict(f"{peer[-8:]} is averaging this round in another group")
        finally:
            writer.close()
        return len(payload)

    async def run(self, group: Group, vector: torch.Tensor, weight: float) -> AllReduceResult:
        """Average `vector` (flat fp32) over `group`, weighted by `weight`; raises AllReduceError on failure,
        naming the members suspected of causing it, so the caller can retry at once without them."""
        self._running[(group.round, group.attempt)] = group.group_id
        try:
            result = await self._run(group, vector, weight)
        except GroupConflict as e:
            raise AllReduceError("conflict", f"round {group.round}: {e}; nothing applied", set()) from None
        finally:
            self._mailboxes.pop(group.group_id, None)
            self._running.pop((group.round, group.attempt), None)
        self.deadlines.record(result.seconds)
        return result

    async def _run(self, group: Group, vector: torch.Tensor, weight: float) -> AllReduceResult:
        started = time.monotonic()
        me, members = self.node.peer_id, group.members
        others = [m for m in members if m != me]
        index = members.index(me)
        vector = vector.detach().to(torch.float32).contiguous().view(-1)
        bounds = partition(vector.numel(), group.shares)
        mailbox = self._mailbox(group.group_id)
        base = {"group_id": group.group_id, "round": group.round, "attempt": group.attempt}
        phase_timeout = self.deadlines.phase_timeout()
        stats = {"sent": 0, "received": 0}

        # Phase 1: scatter part j to its reducer j (members with an empty share reduce nothing).
        bad = self.faults.bad_data(group.round)
        payloads = {members[j]: self._outgoing(vector[bounds[j][0]:bounds[j][1]], bad)
                    for j in range(len(members)) if j != index and bounds[j][1] > bounds[j][0]}
        unresponsive = await self._send_all(
            {peer: ({**base, "phase": "part", "weight": float(weight)}, payload)
             for peer, payload in payloads.items()}, stats, die_after_first=("send", group.round))
        start, end = bounds[index]
        result = torch.empty_like(vector)
        headers: dict[str, dict] = {}  # each reducer's account of its part, ours included
        if end > start:
            contributors, rejected, total_weight = [me], [], float(weight)
            total = vector[start:end] * weight
            parts = await self._collect(mailbox, "part", others, phase_timeout)
            self.faults.maybe_die("reduce", group.round)
            for sender, (header, payload) in parts.items():
                stats["received"] += len(payload)
                part, sender_weight = self._validated(sender, header, payload, end - start)
                if part is None:
                    rejected.append(sender)
                    continue
                total += part * sender_weight
                total_weight += sender_weight
                contributors.append(sender)
            if total_weight <= 0:
                raise AllReduceError("bad_data", "the group's total weight is zero: nobody trained this round",
                                     set())
            encoded_average = self.codec.encode(total / total_weight)
            result[start:end] = self.codec.decode(encoded_average, max_numel=end - start)  # as the others get it
            # Phase 2: send the averaged part back to every member, naming who is in it and who was rejected.
            headers[me] = {**base, "phase": "avg", "contributors": sorted(contributors), "rejected": sorted(rejected),
                           "total_weight": total_weight}
            outgoing = self._outgoing(total / total_weight, bad) if bad else encoded_average
            unresponsive |= await self._send_all({peer: (headers[me], outgoing) for peer in others}, stats)

        reducers = [members[j] for j in range(len(members)) if j != index and bounds[j][1] > bounds[j][0]]
        averages = await self._collect(mailbox, "avg", reducers, phase_timeout)
        unresponsive |= set(reducers) - set(averages)
        bad_reducers = set()
        for sender, (header, payload) in averages.items():
            stats["received"] += len(payload)
            j = members.index(sender)
            try:
                result[bounds[j][0]:bounds[j][1]] = self._decode(sender, payload, bounds[j][1] - bounds[j][0])
                headers[sender] = header
            except AllReduceError:
                bad_reducers.add(sender)  # every member decodes the same bytes, so all of them reject it
        # The all-or-nothing rule: if any part was averaged without some member, no part is applied anywhere.
        # Every member sees the same reducers' accounts, so all agree on whom to leave out of the retry:
        # peers whose data a reducer rejected (banned for this round) and peers that did not deliver.
        rejected, weights = set(bad_reducers), set()
        for sender, header in headers.items():
            named, refused = header.get("contributors"), header.get("rejected", [])
            if not isinstance(named, list) or not isinstance(refused, list) or not set(named) <= set(members):
                self.on_bad_peer(sender, "bad_header")
                unresponsive.add(sender)
                continue
            rejected |= set(refused) & set(members)
            unresponsive |= set(members) - set(named) - set(refused)
            weights.add(header.get("total_weight"))
        if rejected or unresponsive:
            raise AllReduceError(
                "bad_data" if rejected else "partial",
                f"round {group.round}: parts were averaged without "
                f"{', '.join(p[-8:] for p in sorted(rejected | unresponsive))}; nothing applied",
                unresponsive - {me}, rejected - {me})
        if len(weights) != 1 or not isinstance(next(iter(weights)), float):
            raise AllReduceError("partial", f"round {group.round}: reducers disagree on the total weight "
                                 f"{sorted(map(str, weights))}; nothing applied", set())
        group_weight = next(iter(weights))

        # Phase 3: commit only once every member holds every part.
        self.faults.maybe_die("commit", group.round)
        # We apply iff every other member's commit reached us. Whether our own commits were acknowledged does not
        # matter for our decision: a lost acknowledgement does not mean a lost commit (each peer decides on what it
        # received; the rare peer left behind by a commit lost in flight re-syncs through the params digest).
        await self._send_all({peer: ({**base, "phase": "commit"}, b"") for peer in others}, stats)
        commits = await self._collect(mailbox, "commit", others, phase_timeout)
        unconfirmed = set(others) - set(commits)
        if unconfirmed:
            raise AllReduceError("commit", f"round {group.round}: {len(unconfirmed)} member(s) did not confirm; "
                                 "nothing applied", unconfirmed)
        delivered = vector.clone()
        if self.codec.name != "none":
            for j, member in enumerate(members):
                if member in payloads:
                    delivered[bounds[j][0]:bounds[j][1]] = self.codec.decode(payloads[member])
        return AllReduceResult(result, delivered, group_weight, len(members), stats["sent"], stats["received"],
                               time.monotonic() - started)

    def _outgoing(self, part: torch.Tensor, bad: Optional[str]) -> bytes:
        """The encoded part, or (under fault injection) a named kind of bad data."""
        if bad == "garbage":
            return b"\x00garbage" * 8
        if bad == "nan":  # a well-formed fp32 payload whose values are NaN
            payload = bytearray(get_codec("none").encode(torch.zeros_like(part)))
            payload[len(payload) - 4 * part.numel():] = torch.full_like(part, float("nan")).numpy().tobytes()
            return bytes(payload)
        if bad == "short":
            return self.codec.encode(part[: max(part.numel() // 2, 1)])
        return self.codec.encode(part)

    async def _send_all(self, messages: dict[str, tuple[dict, bytes]], stats: dict,
                        die_after_first: Optional[tuple[str, int]] = None) -> set[str]:
        """Send every message concurrently; returns the peers we could not reach (a dead peer must not stop
        us from delivering to the live ones, who need our data to finish quickly)."""
        async def one(peer: str, header: dict, payload: bytes) -> Optional[str]:
            try:
                stats["sent"] += await self._send(peer, header, payload)
                if die_after_first is not None:
                    self.faults.maybe_die(*die_after_first)  # dies with some parts delivered, others not
                return None
            except GroupConflict:
                raise
            except Exception as e:  # noqa: BLE001 - any transport error means that peer is gone for this round
                logger.info("could not send %s to %s: %s", header.get("phase"), peer[-8:],
                            str(e).splitlines()[0] if str(e) else type(e).__name__)
                return peer

        results = await asyncio.gather(*(one(peer, *message) for peer, message in messages.items()))
        return {peer for peer in results if peer is not None}

    async def _collect(self, mailbox: _Mailbox, phase: str, senders: list[str], timeout: float) -> dict:
        """Messages of `phase` from `senders` that arrive within `timeout` s: {sender: (header, payload)}."""
        slots = {sender: mailbox.slot(phase, sender) for sender in senders}
        if slots:
            await asyncio.wait(list(slots.values()), timeout=timeout)
        return {sender: slot.result() for sender, slot in slots.items() if slot.done()}

    def _validated(self, sender: str, header: dict, payload: bytes,
                   numel: int) -> tuple[Optional[torch.Tensor], float]:
        """A contribution's decoded part and weight, or (None, 0) if it is bad: the sender is then left out of
        this part, which every member sees in the contributor list, so the round is redone without it."""
        sender_weight = header.get("weight")
        if isinstance(sender_weight, bool) or not isinstance(sender_weight, (int, float)) or \
                not 0 <= sender_weight < 1e18:
            self.on_bad_peer(sender, "bad_weight")
            return None, 0.0
        try:
            return self._decode(sender, payload, numel), float(sender_weight)
        except AllReduceError:
            return None, 0.0

    def _decode(self, sender: str, payload: bytes, numel: int) -> torch.Tensor:
        try:
            part = self.codec.decode(payload, max_numel=numel)
        except CodecError as e:
            self.on_bad_peer(sender, "undecodable")
            raise AllReduceError("bad_data", f"peer {sender[-8:]} sent undecodable data: {e}", {sender}) from None
        if part.numel() != numel or not torch.isfinite(part).all():
            self.on_bad_peer(sender, "bad_values")
            raise AllReduceError("bad_data", f"peer {sender[-8:]} sent {part.numel()} values (expected {numel}) "
                                             "or non-finite values", {sender})
        return part
