"""All-or-nothing group all-reduce of a flat fp32 vector, weighted by tokens processed.

Each member reduces one contiguous part (its share is set from its bandwidth). Parts travel in chunks, and the
phases are pipelined: every peer streams the chunks of part j (encoded by the round's codec) to member j, which
averages chunk k as soon as every contribution to it has arrived and streams the averaged chunk back to everyone
with the list of its contributors, while later chunks are still coming in. A peer applies the result only if
every chunk of every part was averaged over the whole group and every member confirmed it holds all of them
(commit phase); otherwise nothing is applied. Survivors decode the same bytes, so they end with bit-identical
averages.

With `ring` "auto", a lossless group of three or more members with even links averages along a ring instead
(ring.py); "always": whatever the links.

Members in client mode (behind NAT: they accept no inbound streams) reduce nothing and open every stream
themselves: they push their parts like everyone, pull the averaged chunks from each reducer ("pull"), send their
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

from swarm.averaging.common import (CHUNK_ALIGN, COMMIT_GRACE, AllReduceError, AllReduceResult, Mailbox,
                                    all_or_first_failure, chunk_bounds, no_chunks)
from swarm.averaging.deadlines import AdaptiveDeadlines
from swarm.averaging.faults import FaultPlan
from swarm.averaging.matchmaking import Group
from swarm.averaging.partition import partition
from swarm.averaging.ring import run_ring, uses_ring
from swarm.averaging.streams import MAX_HEADER_BYTES, GroupConflict, StreamClient, read_chunk
from swarm.compression import CodecError, get_codec
from swarm.dht.node import SwarmNode, recv_frame, send_frame

logger = logging.getLogger(__name__)
MAX_PENDING_GROUPS = 8
MAX_DECISIONS = 64  # (round, attempt) keys whose group we remember, for answering streams about them
# A member sends a reducer chunk k of its part only once the average of chunk k - SCATTER_AHEAD came back. Without
# it, the part streams (nothing to wait for) fill the links' queues and take most of each upload from the average
# streams (which wait for every sender's chunk), and a round ends on the averages' tail: 4.04 s against 3.52 s on
# 4 x 100 Mbit/s fp32 with Reno (see README).
SCATTER_AHEAD = 8
__all__ = ["COMMIT_GRACE", "AllReduceError", "AllReduceResult", "GroupAllReduce"]  # (the first three: common.py)


class GroupAllReduce:
    """Serves the all-reduce protocol of one run on a node and runs all-reduces for its peer."""

    def __init__(self, node: SwarmNode, run_id: str, codec_name: str, max_numel: int, deadlines: AdaptiveDeadlines,
                 on_bad_peer: Optional[Callable[[str, str], None]] = None, faults: Optional[FaultPlan] = None,
                 ring: str = "never"):
        self.node, self.codec = node, get_codec(codec_name)
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
        if key not in self._decisions:
            while len(self._decisions) >= MAX_DECISIONS:  # bounded against senders naming endless keys
                oldest = self._decisions.pop(next(iter(self._decisions)))
                if not oldest.done():
                    oldest.set_result(None)
            self._decisions[key] = asyncio.get_running_loop().create_future()
        return self._decisions[key]

    def _outcome(self, group_id: str) -> asyncio.Future:
        if group_id not in self._outcomes:
            while len(self._outcomes) >= MAX_DECISIONS:
                oldest = self._outcomes.pop(next(iter(self._outcomes)))
                if not oldest.done():
                    oldest.set_result(False)
            self._outcomes[group_id] = asyncio.get_running_loop().create_future()
        return self._outcomes[group_id]

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
        header = msgpack.unpackb(await recv_frame(reader, MAX_HEADER_BYTES))
        if not isinstance(header, dict) or header.get("phase") not in ("part", "avg", "commit", "pull", "decision",
                                                                       "abort", "ping", "ring"):
            raise ValueError(f"malformed all-reduce header from {remote}")
        chunks = header.get("chunks", 0)
        if not isinstance(chunks, int) or not 0 <= chunks <= self.max_numel // CHUNK_ALIGN + 2:
            raise ValueError(f"all-reduce header from {remote} announces {chunks!r} chunks")
        group_id = str(header.get("group_id"))
        key = (header.get("round"), header.get("attempt"))
        if not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 40 for v in key):
            raise ValueError(f"all-reduce header from {remote} names round/attempt {key!r}")
        try:
            # Wait until our own matchmaking for this round and attempt is over (bounded by the ceiling).
            decided = await asyncio.wait_for(asyncio.shield(self._decision(key)), self.deadlines.ceiling)
        except asyncio.TimeoutError:
            decided = None
        if decided != group_id:
            # We average this round and attempt in another group, or in none: tell the sender at once, so it
            # does not wait out its deadline for a group that leader races made inconsistent.
            await send_frame(writer, b"conflict")
            return
        await send_frame(writer, b"ok")
        phase = header["phase"]
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
            if chunks == 0:  # a reopened commit whose first copy we used: confirm it, or its sender logs a failure
                await send_frame(writer, b"done")
            return  # a straggler of a group we already finished: nothing left to use it for
        box = self._mailbox(group_id)
        if phase == "abort":  # that member gave this attempt up: stop waiting for anything from it
            slot = box.slot("abort", remote)
            if not slot.done():
                slot.set_result(header)  # (truthy) whom it blames, if anyone: see ring.ring_failure
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
            header_slot.set_result(header)
        for index in range(chunks):
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
            result = await self._run(group, vector, weight, exact_from)
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
        return uses_ring(self.ring, self.codec.name, group)

    async def _run(self, group: Group, vector: torch.Tensor, weight: float,
                   exact_from: Optional[int]) -> AllReduceResult:
        if self.uses_ring(group):
            return await run_ring(self, group, vector, weight)
        started = time.monotonic()
        me, members = self.node.peer_id, group.members
        others = [m for m in members if m != me]
        index = members.index(me)
        clients = group.clients or (False,) * len(members)
        i_am_client = clients[index]
        servers = [m for m in others if not clients[members.index(m)]]  # the members we can open streams to
        vector = vector.detach().to(torch.float32).contiguous().view(-1)
        bounds = partition(vector.numel(), group.shares)
        split = vector.numel() if exact_from is None else min(max(int(exact_from), 0), vector.numel())
        chunking = [chunk_bounds(a, b, split) for a, b in bounds]
        exact = get_codec("none")

        def codec_at(a: int):
            return self.codec if a < split else exact
        mailbox = self._mailbox(group.group_id)
        base = {"group_id": group.group_id, "round": group.round, "attempt": group.attempt}
        phase_timeout = self.deadlines.phase_timeout(group.phase_timeout)
        stats = {"sent": 0, "received": 0}
        bad = self.faults.bad_data(group.round)
        result = torch.empty_like(vector)
        wire: dict[int, tuple[int, int, bytes]] = {}  # chunk start -> the bytes its average travelled as
        delivered = vector.clone()  # our vector as the reducers decode it (for error feedback)
        unresponsive: set[str] = set()
        reducers = [members[j] for j in range(len(members)) if j != index and bounds[j][1] > bounds[j][0]]
        accounts: dict[str, list[dict]] = {}  # reducer -> its meta for each chunk of its part (ours included)
        bad_reducers: set[str] = set()
        gone = {peer: asyncio.Event() for peer in others}  # a stream to it failed: do not wait for it any more

        async def arrival(slot: asyncio.Future, peer: str):
            """The slot's message, or TimeoutError once the deadline passes or `peer` is known to be gone."""
            aborted = mailbox.slot("abort", peer)
            if not slot.done() and not gone[peer].is_set() and not aborted.done():
                waiter = asyncio.ensure_future(gone[peer].wait())
                try:
                    await asyncio.wait({slot, waiter, aborted}, timeout=phase_timeout,
                                       return_when=asyncio.FIRST_COMPLETED)
                finally:
                    waiter.cancel()
            if not slot.done():
                raise asyncio.TimeoutError
            return slot.result()

        async def parts_for(j: int):
            reducer, throttled = members[j], True
            for k, (a, b) in enumerate(chunking[j]):
                if throttled and k >= SCATTER_AHEAD:
                    # Not more than SCATTER_AHEAD chunks ahead of the averages we got back for this part.
                    try:
                        await arrival(mailbox.slot("avg", reducer, k - SCATTER_AHEAD), reducer)
                    except asyncio.TimeoutError:
                        throttled = False  # it is gone or late: its stream (or receive_from) tells the rest
                payload = self._outgoing(vector[a:b], bad, codec_at(a))
                if codec_at(a).name != "none" and not bad:
                    delivered[a:b] = codec_at(a).decode(payload)
                yield {}, payload
                await asyncio.sleep(0)  # let other streams interleave

        async def send(peer: str, header: dict, chunks, die_after_first=None) -> None:
            try:
                await self.streams.send(peer, header, chunks, stats, die_after_first)
            except GroupConflict:
                raise
            except Exception as e:  # noqa: BLE001 - any transport error means that peer is gone for this round
                logger.info("could not send %s to %s: %s", header["phase"], peer[-8:],
                            str(e).splitlines()[0] if str(e) else type(e).__name__)
                unresponsive.add(peer)
                gone[peer].set()

        # Averaged chunks of our part go to every other member through one queue each.
        queues = {peer: asyncio.Queue() for peer in others}

        async def drain(queue: asyncio.Queue):
            for _ in range(len(chunking[index])):
                yield await queue.get()

        async def reduce_my_part() -> None:
            start, end = bounds[index]
            if end <= start:
                return
            alive = list(others)
            rejected: list[str] = []
            for k, (a, b) in enumerate(chunking[index]):
                total, total_weight, contributors = vector[a:b] * weight, float(weight), [me]
                for sender in list(alive):
                    try:
                        meta, payload = await arrival(mailbox.slot("part", sender, k), sender)
                        header = mailbox.slot("part", sender).result()
                    except asyncio.TimeoutError:
                        alive.remove(sender)  # not waited for again: later chunks go on without it
                        continue
                    stats["received"] += len(payload)
                    self.faults.maybe_die("reduce", group.round)  # dies while reducing, parts in hand
                    part, sender_weight = self._validated(sender, header, payload, b - a, codec_at(a))
                    if part is None:
                        alive.remove(sender)
                        rejected.append(sender)
                        continue
                    total += part * sender_weight
                    total_weight += sender_weight
                    contributors.append(sender)
                if total_weight <= 0:
                    raise AllReduceError("bad_data", "the group's total weight is zero: nobody trained this round",
                                         set())
                average = total / total_weight
                encoded = codec_at(a).encode(average)
                result[a:b] = codec_at(a).decode(encoded, max_numel=b - a)  # exactly what the others will hold
                wire[a] = (a, b, bytes(encoded))
                meta = {"contributors": sorted(contributors), "rejected": sorted(rejected),
                        "total_weight": total_weight}
                accounts.setdefault(me, []).append(meta)
                outgoing = self._outgoing(average, bad, codec_at(a)) if bad else encoded
                for queue in queues.values():
                    queue.put_nowait((meta, outgoing))

        async def receive_from(reducer: str) -> None:
            j = members.index(reducer)
            for k, (a, b) in enumerate(chunking[j]):
                try:
                    meta, payload = await arrival(mailbox.slot("avg", reducer, k), reducer)
                except asyncio.TimeoutError:
                    unresponsive.add(reducer)
                    return
                stats["received"] += len(payload)
                self.faults.maybe_die("reduce", group.round)  # (when our own share is empty)
                try:
                    result[a:b] = self._decode(reducer, payload, b - a, codec_at(a))
                    wire[a] = (a, b, bytes(payload))
                except AllReduceError:
                    bad_reducers.add(reducer)  # every member decodes the same bytes, so all of them reject it
                    return
                accounts.setdefault(reducer, []).append(meta)

        tasks = [send(members[j], {**base, "phase": "part", "weight": float(weight), "chunks": len(chunking[j])},
                      parts_for(j), die_after_first=("send", group.round))
                 for j in range(len(members)) if j != index and bounds[j][1] > bounds[j][0]]
        for peer, queue in queues.items():
            if bounds[index][1] <= bounds[index][0]:
                break  # we reduce nothing
            if clients[members.index(peer)]:  # it pulls them: hand its queue to the stream it opens
                slot = mailbox.slot("outbox", peer)
                if not slot.done():
                    slot.set_result((queue, len(chunking[index]), stats))
            else:
                tasks.append(send(peer, {**base, "phase": "avg", "chunks": len(chunking[index])}, drain(queue),
                                  die_after_first=("send", group.round)))  # a peer reducing everything sends only these

        async def pull(reducer: str) -> None:
            try:
                await self.streams.pull(reducer, {**base, "phase": "pull", "chunks": 0},
                                        lambda i: mailbox.slot("avg", reducer, i),
                                        len(chunking[members.index(reducer)]))
            except GroupConflict:
                raise
            except Exception as e:  # noqa: BLE001 - that reducer is gone for this round
                logger.info("could not pull avg from %s: %s", reducer[-8:],
                            str(e).splitlines()[0] if str(e) else type(e).__name__)
                unresponsive.add(reducer)
                gone[reducer].set()

        if i_am_client:
            tasks += [pull(reducer) for reducer in reducers]
        tasks += [reduce_my_part()] + [receive_from(reducer) for reducer in reducers]
        await all_or_first_failure(tasks)

        # The all-or-nothing rule: if any chunk was averaged without some member, no part is applied anywhere.
        # Every member sees the same reducers' accounts, so all agree on whom to leave out of the retry:
        # peers whose data a reducer rejected (banned for this round) and peers that did not deliver.
        rejected, weights = set(bad_reducers), set()
        for sender, metas in accounts.items():
            for meta in metas:
                named, refused = meta.get("contributors"), meta.get("rejected", [])
                if not isinstance(named, list) or not isinstance(refused, list) or not set(named) <= set(members):
                    self.on_bad_peer(sender, "bad_header")
                    unresponsive.add(sender)
                    continue
                rejected |= set(refused) & set(members)
                unresponsive |= set(members) - set(named) - set(refused)
                weights.add(meta.get("total_weight"))
        if rejected or unresponsive:
            if unresponsive - {me}:
                self.deadlines.record_timeout(phase_timeout)
            raise AllReduceError(
                "bad_data" if rejected else "partial",
                f"round {group.round}: parts were averaged without "
                f"{', '.join(p[-8:] for p in sorted(rejected | unresponsive))}; nothing applied",
                unresponsive - {me}, rejected - {me})
        if len(weights) != 1 or not isinstance(next(iter(weights)), float):
            raise AllReduceError("partial", f"round {group.round}: reducers disagree on the total weight "
                                 f"{sorted(map(str, weights))}; nothing applied", set())
        group_weight = next(iter(weights))

        # Phase 3: commit only once every member holds every part. We apply iff every other member's commit
        # reached us; whether our own commits were acknowledged does not matter for our decision (a lost
        # acknowledgement is not a lost commit; the rare peer left behind re-syncs through the state digest).
        self.faults.maybe_die("commit", group.round)
        await asyncio.gather(*(send(peer, {**base, "phase": "commit", "chunks": 0}, no_chunks())
                               for peer in servers))
        if i_am_client:
            # We cannot receive commits: ask every non-client member whether it applies (it does only once every
            # member committed), and apply only if all of them do.
            decision = {**base, "phase": "decision", "chunks": 0}
            asked = [asyncio.ensure_future(self.streams.ask_decision(peer, decision)) for peer in servers]
            done, pending = await asyncio.wait(asked, timeout=phase_timeout)
            for task in pending:
                task.cancel()
            applying = {peer for peer, task in zip(servers, asked)
                        if task in done and not task.exception() and task.result()}
            if applying != set(servers):
                raise AllReduceError("commit", f"round {group.round}: {len(set(servers) - applying)} member(s) did "
                                     "not apply; nothing applied", set(servers) - applying)
            return AllReduceResult(result, delivered, group_weight, len(members), stats["sent"],
                                   stats["received"], time.monotonic() - started, [wire[a] for a in sorted(wire)])
        # A member our commit could not reach is most likely dead: its own commit, if it sent one, is here by
        # now or very soon, so do not wait out the whole deadline for it.
        commit_timeout = min(phase_timeout, COMMIT_GRACE) if unresponsive else phase_timeout
        commits = await self._collect(mailbox, "commit", others, commit_timeout)
        unconfirmed = set(others) - set(commits)
        if unconfirmed:
            if not unresponsive:
                self.deadlines.record_timeout(phase_timeout)
            raise AllReduceError("commit", f"round {group.round}: {len(unconfirmed)} member(s) did not confirm; "
                                 "nothing applied", unconfirmed)
        return AllReduceResult(result, delivered, group_weight, len(members), stats["sent"], stats["received"],
                               time.monotonic() - started, [wire[a] for a in sorted(wire)])

    def _outgoing(self, part: torch.Tensor, bad: Optional[str], codec) -> bytes:
        """The encoded part, or (under fault injection) a named kind of bad data."""
        if bad == "garbage":
            return b"\x00garbage" * 8
        if bad == "nan":  # a well-formed fp32 payload whose values are NaN
            payload = bytearray(get_codec("none").encode(torch.zeros_like(part)))
            payload[len(payload) - 4 * part.numel():] = torch.full_like(part, float("nan")).numpy().tobytes()
            return bytes(payload)
        if bad == "short":
            return codec.encode(part[: max(part.numel() // 2, 1)])
        return codec.encode(part)

    async def _collect(self, mailbox: Mailbox, phase: str, senders: list[str], timeout: float) -> dict:
        """Messages of `phase` from `senders` that arrive within `timeout` s: {sender: (header, payload)}."""
        slots = {sender: mailbox.slot(phase, sender) for sender in senders}
        aborts = {sender: mailbox.slot("abort", sender) for sender in senders}
        deadline = time.monotonic() + timeout
        while True:
            # A sender that gave the attempt up before its message came will not send it: stop waiting.
            waiting = [slot for sender, slot in slots.items() if not slot.done() and not aborts[sender].done()]
            remaining = deadline - time.monotonic()
            if not waiting or remaining <= 0:
                break
            await asyncio.wait(waiting + [aborts[s] for s, slot in slots.items() if not slot.done()],
                               timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
        return {sender: slot.result() for sender, slot in slots.items() if slot.done()}

    def _validated(self, sender: str, header: dict, payload: bytes, numel: int,
                   codec) -> tuple[Optional[torch.Tensor], float]:
        """A contribution's decoded part and weight, or (None, 0) if it is bad: the sender is then left out of
        this part, which every member sees in the contributor list, so the round is redone without it."""
        sender_weight = header.get("weight")
        if isinstance(sender_weight, bool) or not isinstance(sender_weight, (int, float)) or \
                not 0 <= sender_weight < 1e18:
            self.on_bad_peer(sender, "bad_weight")
            return None, 0.0
        try:
            return self._decode(sender, payload, numel, codec), float(sender_weight)
        except AllReduceError:
            return None, 0.0

    def _decode(self, sender: str, payload: bytes, numel: int, codec) -> torch.Tensor:
        try:
            part = codec.decode(payload, max_numel=numel)
        except CodecError as e:
            self.on_bad_peer(sender, "undecodable")
            raise AllReduceError("bad_data", f"peer {sender[-8:]} sent undecodable data: {e}", {sender}) from None
        if part.numel() != numel or not torch.isfinite(part).all():
            self.on_bad_peer(sender, "bad_values")
            raise AllReduceError("bad_data", f"peer {sender[-8:]} sent {part.numel()} values (expected {numel}) "
                                             "or non-finite values", {sender})
        return part
