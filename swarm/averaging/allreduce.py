"""All-or-nothing group all-reduce of a flat fp32 vector, weighted by tokens processed: the long-lived server of
one run's protocol on a node (its stream handler, the groups' mailboxes, which group it joined for each round and
attempt, and whether it applied each), which starts one Run per attempt: a Butterfly (butterfly.py) or, with `ring`
"auto" for a lossless group of three or more members with even links ("always": whatever the links), a Ring
(ring.py).

A peer applies the result only if every chunk of every part was averaged over the whole group and every member
confirmed it holds all of them (commit phase, run.py); otherwise nothing is applied. Survivors decode the same
bytes, so they end with bit-identical averages. Client members (they accept no inbound streams) send their
commits, and instead of receiving the others' commits ask each non-client member for its decision ("decision"),
applying only if every one of them applies, which those do only once every member, clients included, committed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Optional

import msgpack
import torch

from swarm.averaging.aggregate import aggregator
from swarm.averaging.butterfly import Butterfly
from swarm.averaging.common import CHUNK_ALIGN, COMMIT_GRACE, AllReduceError, AllReduceResult, Mailbox
from swarm.averaging.deadlines import AdaptiveDeadlines
from swarm.averaging.faults import FaultPlan
from swarm.averaging.matchmaking import Group
from swarm.averaging.messages import Blame, Contribution, Header, MessageError
from swarm.averaging.ring import Ring, uses_ring
from swarm.averaging.run import RunContext
from swarm.averaging.streams import MAX_HEADER_BYTES, GroupConflict, StreamClient, read_chunk
from swarm.compression import get_codec
from swarm.dht.node import SwarmNode, recv_frame, send_frame

logger = logging.getLogger(__name__)
MAX_PENDING_GROUPS = 8
MAX_DECISIONS = 64  # (round, attempt) keys whose group we remember, for answering streams about them
__all__ = ["COMMIT_GRACE", "AllReduceError", "AllReduceResult", "GroupAllReduce"]  # (the first three: common.py)


class GroupAllReduce:
    """Serves the all-reduce protocol of one run on a node, and runs its peer's all-reduces (a Run per attempt)."""

    def __init__(self, node: SwarmNode, run_id: str, codec_name: str, max_numel: int, deadlines: AdaptiveDeadlines,
                 on_bad_peer: Optional[Callable[[str, str], None]] = None, faults: Optional[FaultPlan] = None,
                 ring: str = "never", max_weight: float = float("inf"), aggregator_name: str = "mean"):
        self.node, self.codec = node, get_codec(codec_name)
        self.aggregator_name = aggregator_name  # how reducers combine contributions (aggregate.py)
        self.max_weight = max_weight  # a contribution declaring more tokens than this is refused as bad_weight
        self.ring = ring
        self.deadlines = deadlines
        self.faults = faults or FaultPlan()
        self.protocol = f"swarm.{run_id}.allreduce"
        self.max_numel = max_numel
        self.max_payload = 16 + 8 * max_numel + MAX_HEADER_BYTES  # the largest chunk any codec makes, with slack
        self.streams = StreamClient(node, self.protocol, self.max_payload, self.faults)
        self.on_bad_peer = on_bad_peer or (lambda peer, reason: None)
        self._mailboxes: dict[str, Mailbox] = {}
        self._running: dict[tuple[int, int], str] = {}  # (round, attempt) -> group id we are averaging in
        self._finished: dict[tuple[int, int], str] = {}  # ...and the ones we averaged in recently
        # (round, attempt) -> the group id we joined for it, or None (no group). A stream about a key we have
        # not decided yet waits for the decision, so a sender whose group we do not join learns it at once
        # ("conflict") instead of waiting out its deadline for parts we will never send.
        self._decisions: dict[tuple[int, int], asyncio.Future] = {}
        self._outcomes: dict[str, asyncio.Future] = {}  # group id -> whether we applied it (for client members)
        self._unasked: dict[str, set[str]] = {}  # group id -> client members that have not asked our decision yet

    async def start(self) -> None:
        await self.node.add_stream_handler(self.protocol, self._on_stream)

    def _decision(self, key: tuple[int, int]) -> asyncio.Future:
        return _remembered(self._decisions, key, None)

    def _outcome(self, group_id: str) -> asyncio.Future:
        return _remembered(self._outcomes, group_id, False)

    async def decide(self, round_no: int, attempt: int, group_id: Optional[str]) -> None:
        """Record which group we take part in for (round, attempt), None for none (matchmaking found no group,
        or we left that attempt): streams waiting on it get their answer now. A later call replaces an earlier
        decision: a peer that found nobody retries under the same attempt number, and may then join a group."""
        future = self._decision((round_no, attempt))
        if not future.done():
            future.set_result(group_id)
        elif future.result() != group_id:
            decided = asyncio.get_running_loop().create_future()
            decided.set_result(group_id)
            self._decisions[(round_no, attempt)] = decided

    def _mailbox(self, group_id: str) -> Mailbox:
        if group_id not in self._mailboxes:
            running = set(self._running.values())
            # Bounded memory against stray or hostile senders, but never at the expense of a group we are in.
            evictable = [g for g in self._mailboxes if g not in running]
            while len(self._mailboxes) >= MAX_PENDING_GROUPS and evictable:
                oldest = min(evictable, key=lambda g: self._mailboxes[g].created)
                evictable.remove(oldest)
                del self._mailboxes[oldest]
            self._mailboxes[group_id] = Mailbox()
        return self._mailboxes[group_id]

    async def settle(self, timeout: float) -> None:
        """Before this peer stops: wait (at most `timeout` s) until the client members of the last group we
        applied have asked for our decision, so a peer stopping right after its last round does not leave them
        behind with an average it applied and they could not."""
        deadline = time.monotonic() + timeout
        while any(self._unasked.values()) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    async def _on_stream(self, remote: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One stream = a header, then `chunks` chunks (a meta frame and a payload frame each). Every chunk goes
        to its mailbox slot as it arrives, so the all-reduce can use it while the rest is still in flight. A client
        member's "pull" and "decision" streams go the other way: we write what it asked for."""
        raw = msgpack.unpackb(await recv_frame(reader, MAX_HEADER_BYTES))
        try:
            header = Header.from_wire(raw, self.max_numel // CHUNK_ALIGN + 2)
        except MessageError as e:
            raise ValueError(f"malformed all-reduce header from {remote}: {e}") from None
        group_id, phase = header.group_id, header.phase
        try:
            # Wait until our own matchmaking for this round and attempt is over (bounded by the ceiling).
            decided = await asyncio.wait_for(asyncio.shield(self._decision((header.round, header.attempt))),
                                             self.deadlines.ceiling)
        except asyncio.TimeoutError:
            decided = None
        if decided != group_id:
            # We average this round and attempt in another group, or in none: tell the sender at once, so it
            # does not wait out its deadline for a group that leader races made inconsistent.
            await send_frame(writer, b"conflict")
            return
        await send_frame(writer, b"ok")
        if phase == "ping":  # a sender whose stream lost its confirmation checks that we are still here
            return
        if phase == "decision":  # a client member asks whether we apply this group's average
            try:
                applied = await asyncio.wait_for(asyncio.shield(self._outcome(group_id)), self.deadlines.ceiling)
            except asyncio.TimeoutError:
                applied = False
            await send_frame(writer, b"apply" if applied else b"abort")
            self._unasked.get(group_id, set()).discard(remote)
            return
        if group_id in self._finished.values():
            if header.chunks == 0:  # a reopened commit we used a copy of: confirm it, or its sender logs a failure
                await send_frame(writer, b"done")
            return  # a straggler of a group we already finished: nothing left to use it for
        box = self._mailbox(group_id)
        if phase == "abort":  # that member gave this attempt up: stop waiting for anything from it
            slot = box.slot("abort", remote)
            if not slot.done():
                slot.set_result(_blame(raw))  # whom it blames, if anyone: see Ring.broke
            return
        if phase == "pull":  # a client member fetches the averaged chunks of our part as we make them
            queue, count, stats = await asyncio.wait_for(asyncio.shield(box.slot("outbox", remote)),
                                                         self.deadlines.ceiling)
            for _ in range(count):
                meta, payload = await asyncio.wait_for(queue.get(), self.deadlines.ceiling)
                await send_frame(writer, msgpack.packb(meta))
                await send_frame(writer, payload)
                stats["sent"] += len(payload)
            return
        header_slot = box.slot(phase, remote)  # keyed by the authenticated sender, not a claimed one
        if not header_slot.done():
            # A part's reducer judges its weight (Run.validated): a bad one costs the sender its contribution.
            header_slot.set_result(_contribution(raw) if phase == "part" else header)
        for index in range(header.chunks):
            try:
                chunk = await read_chunk(reader, self.max_payload)
            except Exception:
                lost = box.slot("lost", remote)  # its stream broke: a ring member waiting for it fails now
                if not lost.done():
                    lost.set_result(True)
                raise
            slot = box.slot(phase, remote, index)
            if not slot.done():
                slot.set_result(chunk)
        await send_frame(writer, b"done")

    async def run(self, group: Group, vector: torch.Tensor, weight: float,
                  exact_from: Optional[int] = None) -> AllReduceResult:
        """Average `vector` (flat fp32) over `group`, weighted by `weight`; raises AllReduceError on failure,
        naming the members suspected of causing it, so the caller can retry at once without them. Elements from
        `exact_from` on travel uncompressed (global params and momentum of a mixing group: a lossy codec would
        move the params themselves); every member must pass the same layout."""
        self._running[(group.round, group.attempt)] = group.group_id
        await self.decide(group.round, group.attempt, group.group_id)
        outcome = self._outcome(group.group_id)
        try:
            shape = Ring if self.uses_ring(group) else Butterfly
            context = RunContext(self.node.peer_id, self.codec, self.deadlines, self.faults, self.streams,
                                 self.on_bad_peer, self.max_weight, aggregator(self.aggregator_name))
            result = await shape(context, group, self._mailbox(group.group_id), vector, weight, exact_from).execute()
            if not group.is_client(self.node.peer_id):  # only the last group matters (see settle)
                self._unasked = {group.group_id: {peer for peer in group.members if group.is_client(peer)}}
            if not outcome.done():
                outcome.set_result(True)  # client members asking for our decision may apply too
        except GroupConflict as e:
            self.streams.tell_abort(group)
            raise AllReduceError("conflict", f"round {group.round}: {e}; nothing applied", set()) from None
        except AllReduceError as e:
            self.streams.tell_abort(group, e.suspects, e.rejected)
            raise
        finally:
            if not outcome.done():
                outcome.set_result(False)
            self._mailboxes.pop(group.group_id, None)
            self._running.pop((group.round, group.attempt), None)
            # A straggler of a leader race may still write to us about this round: answer "conflict" at once.
            self._finished[(group.round, group.attempt)] = group.group_id
            while len(self._finished) > 4 * MAX_PENDING_GROUPS:
                del self._finished[next(iter(self._finished))]
        self.deadlines.record(result.seconds)
        return result

    def uses_ring(self, group: Group) -> bool:
        """Whether this group averages along a ring (ring.py): every member computes the same answer."""
        return self.aggregator_name == "mean" and uses_ring(self.ring, self.codec.name, group)


def _remembered(futures: dict, key, forgotten) -> asyncio.Future:
    """The future under `key`, made if new; the table is bounded (against senders naming endless keys), and a
    future dropped from it while pending resolves to `forgotten`."""
    if key not in futures:
        while len(futures) >= MAX_DECISIONS:
            oldest = futures.pop(next(iter(futures)))
            if not oldest.done():
                oldest.set_result(forgotten)
        futures[key] = asyncio.get_running_loop().create_future()
    return futures[key]


def _contribution(raw: dict) -> Contribution | MessageError:
    """A part header's body as its reducer will judge it: the weight, or why it is bad."""
    try:
        return Contribution.from_wire(raw)
    except MessageError as e:
        return e


def _blame(raw: dict) -> Blame:
    """An abort header's body; a malformed one blames nobody (the abort itself still counts)."""
    try:
        return Blame.from_wire(raw)
    except MessageError:
        return Blame()
