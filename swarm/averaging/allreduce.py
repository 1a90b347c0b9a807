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

What a peer can make the server spend is bounded: streams served at once (per peer and in all, fewer for streams
that wait for our matchmaking), a deadline on every read, only members of our group get past the header, and a
member's chunks may be no larger than its part's chunks encode to (Expected).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Optional

import msgpack
import torch

from swarm.averaging.aggregate import aggregator
from swarm.averaging.butterfly import Butterfly
from swarm.averaging.common import (CHUNK_ALIGN, COMMIT_GRACE, AllReduceError, AllReduceResult, Mailbox, StreamBound,
                                    chunk_bounds, max_encoded_len)
from swarm.averaging.deadlines import AdaptiveDeadlines
from swarm.averaging.faults import FaultPlan
from swarm.averaging.matchmaking import Group
from swarm.averaging.messages import Blame, Contribution, Header, MessageError
from swarm.averaging.partition import partition
from swarm.averaging.ring import Ring, ring_schedule, uses_ring
from swarm.averaging.run import RunContext
from swarm.averaging.streams import MAX_HEADER_BYTES, GroupConflict, OversizedChunk, StreamClient, read_chunk
from swarm.averaging.verify import nonce_commitment
from swarm.averaging.verifying import report_bound
from swarm import combinations
from swarm.compression import get_codec
from swarm.dht.node import StreamGate, SwarmNode, recv_frame, send_frame

logger = logging.getLogger(__name__)
MAX_PENDING_GROUPS = 8
MAX_NONCES = 64  # the nonces behind our latest matchmaking entries' commitments
MAX_DECISIONS = 64  # (round, attempt) keys whose group we remember, for answering streams about them
# Inbound streams served at once (tighter than SwarmNode's caps for any protocol). A member opens about five to us
# per attempt (part, avg, commit, abort, ping); more are closed unread at once, so one peer (or a few) cannot hold
# the server's memory or sockets.
MAX_STREAMS_PER_PEER = 16
MAX_STREAMS = 256
# ...of which streams about a round and attempt we have not decided yet (their sender found the group before us):
# they wait for our matchmaking, unread, so they are capped lower.
MAX_EARLY_PER_PEER = 4
MAX_EARLY_STREAMS = 64
HEADER_SECONDS = 10.0  # a stream's header must arrive whole within this
_REFUSED = object()  # (what _decided returns for an early stream over the caps)
__all__ = ["COMMIT_GRACE", "AllReduceError", "AllReduceResult", "GroupAllReduce"]  # (the first three: common.py)


@dataclass(frozen=True)
class Expected:
    """A group we average in, and the chunk streams its members send us: (phase, sender) -> StreamBound."""

    group: Group
    streams: dict[tuple[str, str], StreamBound]


class GroupAllReduce:
    """Serves the all-reduce protocol of one run on a node, and runs its peer's all-reduces (a Run per attempt)."""

    def __init__(self, node: SwarmNode, run_id: str, codec_name: str, max_numel: int, deadlines: AdaptiveDeadlines,
                 on_bad_peer: Optional[Callable[[str, str], None]] = None, faults: Optional[FaultPlan] = None,
                 ring: str = "never", max_weight: float = float("inf"), aggregator_name: str = "mean",
                 verify_reducers: bool = True):
        self.node, self.codec = node, get_codec(codec_name)
        self.aggregator_name = aggregator_name  # how reducers combine contributions (aggregate.py)
        self.verify_reducers = verify_reducers  # whether members check them, where they can (verify.py)
        self.max_weight = max_weight  # a contribution declaring more tokens than this is refused as bad_weight
        self.ring = ring
        self.deadlines = deadlines
        self.faults = faults or FaultPlan()
        self.protocol = f"swarm.{run_id}.allreduce"
        self.max_numel = max_numel
        self.streams = StreamClient(node, self.protocol, self._pull_bound, self.faults)
        self.header_timeout = HEADER_SECONDS
        self._streams = StreamGate(MAX_STREAMS_PER_PEER, MAX_STREAMS)
        self._early = StreamGate(MAX_EARLY_PER_PEER, MAX_EARLY_STREAMS)
        self.refused: Counter[str] = Counter()  # inbound streams refused or dropped, by reason
        self._groups: dict[str, Expected] = {}  # the groups we average in or recently did, by id
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
        self._nonces: dict[str, bytes] = {}  # commitment -> the nonce behind it (verify.py), latest last
        self._attempt_nonces: dict[tuple[int, int], bytes] = {}  # (round, attempt) -> our nonce for its entries

    @property
    def verifiable(self) -> bool:
        """Whether this run's reducers are checked (verify.py): CenteredClip, with a codec whose rounding members can
        bound from what they decode."""
        return combinations.reducers_verified(self.codec.name, self.aggregator_name, self.verify_reducers)

    def commitment(self, round_no: int, attempt: int) -> str:
        """Our nonce's commitment for a matchmaking entry of (round, attempt): the nonce is revealed, in the commit
        phase, only by a group whose members' entries name it ("" where this run's reducers are not checked). The
        same for every entry we write for one attempt (a peer that found nobody writes it again), so readers of
        either copy agree on the group."""
        if not self.verifiable:
            return ""
        key = (round_no, attempt)
        if key not in self._attempt_nonces:
            self._attempt_nonces[key] = os.urandom(16)
            while len(self._attempt_nonces) > MAX_NONCES:
                del self._attempt_nonces[next(iter(self._attempt_nonces))]
        nonce = self._attempt_nonces[key]
        self._nonces[nonce_commitment(nonce)] = nonce
        while len(self._nonces) > MAX_NONCES:
            del self._nonces[next(iter(self._nonces))]
        return nonce_commitment(nonce)

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
        """One stream = a header, then `chunks` chunks (a meta frame and a payload frame each). A stream over the
        caps (StreamGate; members of a group we average in are held to the per-peer one only) is closed at once,
        unread; one that outlives every deadline a real one can have is
        dropped (each read has its own deadline too), and the reason counted in `refused`."""
        # Members of a group we average in get past the total cap: strangers filling it cannot stall our round.
        running = (self._groups[g].group.members for g in self._running.values() if g in self._groups)
        if not self._streams.admit(remote, over_total=any(remote in members for members in running)):
            self.refused["busy"] += 1
            return
        try:
            await asyncio.wait_for(self._serve(remote, reader, writer), self.stream_deadline())
        except asyncio.TimeoutError:
            self.refused["slow"] += 1
            logger.debug("dropped a slow all-reduce stream from %s", remote[-8:])
        finally:
            self._streams.release(remote)

    def stream_deadline(self) -> float:
        """The longest a stream can be legitimately served: its header, waiting for our matchmaking, and an
        attempt (the caller of run() gives an attempt the ceiling and 10 s)."""
        return self.header_timeout + 2 * self.deadlines.ceiling + 10

    async def _serve(self, remote: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Every chunk goes to its mailbox slot as it arrives, so the all-reduce can use it while the rest is still
        in flight. A client member's "pull" and "decision" streams go the other way: we write what it asked for.
        Non-members, and members sending what their part cannot hold, are refused before any chunk is read."""
        raw = msgpack.unpackb(await asyncio.wait_for(recv_frame(reader, MAX_HEADER_BYTES), self.header_timeout))
        try:
            header = Header.from_wire(raw, self.max_numel // CHUNK_ALIGN + 2)
        except MessageError as e:
            raise ValueError(f"malformed all-reduce header from {remote}: {e}") from None
        group_id, phase = header.group_id, header.phase
        decided = await self._decided(remote, (header.round, header.attempt))
        if decided is _REFUSED:
            return
        expected = self._groups.get(group_id)
        if decided != group_id or (expected is not None and remote not in expected.group.members):
            # We average this round and attempt in another group, or in none (or the sender is not a member of
            # ours): tell the sender at once, so it does not wait out its deadline for a group that leader races
            # made inconsistent.
            if decided == group_id:
                self.refused["non_member"] += 1
            await send_frame(writer, b"conflict")
            return
        bound = expected.streams.get((phase, remote)) if expected is not None else None
        if header.chunks and (bound is None or header.chunks > bound.chunks):
            self.refused["unexpected"] += 1  # chunks nobody of our group sends us in this phase, or too many
            logger.warning("%s opened a %s stream of %d chunks that its part does not have: refused", remote[-8:],
                           phase, header.chunks)
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
            # (a commit's body, a nonce's reveal, is read by a run that verifies its reducers: see verifying.py)
            header_slot.set_result(_contribution(raw) if phase == "part" else raw if phase == "commit" else header)
        if not header.chunks or await self._read_chunks(remote, reader, box, phase, header.chunks, bound,
                                                        expected.group):
            await send_frame(writer, b"done")

    async def _decided(self, remote: str, key: tuple[int, int]):
        """The group we average `key` (round, attempt) in, or None. A stream about a key we have not decided yet
        waits for our matchmaking (bounded by the ceiling), if the caps on such early streams let it (a member
        that found the group before us starts sending at once); else _REFUSED (closed unanswered: the sender
        retries a moment later)."""
        if key in self._running:
            return self._running[key]
        future = self._decisions.get(key)
        if future is not None and future.done():
            return future.result()
        if not self._early.admit(remote):
            self.refused["early"] += 1
            return _REFUSED
        try:
            return await asyncio.wait_for(asyncio.shield(self._decision(key)), self.deadlines.ceiling)
        except asyncio.TimeoutError:
            return None
        finally:
            self._early.release(remote)

    async def _read_chunks(self, remote: str, reader: asyncio.StreamReader, box: Mailbox, phase: str, chunks: int,
                           bound: StreamBound, group: Group) -> bool:
        """A member's chunks into their slots; whether all of them came. Each frame must come within twice the
        group's phase deadline (a sender may wait up to one for an average before its next chunk, then the chunk
        takes its time on the link). A payload over what its chunk encodes to is not read: its slot gets an empty
        payload, which its reader rejects as undecodable (the sender is left out of the round), and the stream
        ends."""
        timeout = 2 * self.deadlines.phase_timeout(group.phase_timeout)
        for index in range(chunks):
            slot = box.slot(phase, remote, index)
            try:
                chunk = await read_chunk(reader, bound.payload, timeout)
            except OversizedChunk as e:
                self.refused["oversized"] += 1
                logger.warning("%s sent an oversized %s chunk: %s", remote[-8:], phase, e)
                if not slot.done():
                    slot.set_result(({}, b""))
                return False
            except Exception:
                lost = box.slot("lost", remote)  # its stream broke: a ring member waiting for it fails now
                if not lost.done():
                    lost.set_result(True)
                raise
            if not slot.done():
                slot.set_result(chunk)
        return True

    async def run(self, group: Group, vector: torch.Tensor, weight: float,
                  exact_from: Optional[int] = None) -> AllReduceResult:
        """Average `vector` (flat fp32) over `group`, weighted by `weight`; raises AllReduceError on failure,
        naming the members suspected of causing it, so the caller can retry at once without them. Elements from
        `exact_from` on travel uncompressed (global params and momentum of a mixing group: a lossy codec would
        move the params themselves); every member must pass the same layout."""
        if self.verifiable and len(group.members) >= combinations.MIN_VERIFIED_GROUP and \
                not (group.weights and group.commitments):
            # Matchmaking forms no such group (every entry must declare both): a missing field never switches the
            # reducer check off.
            await self.decide(group.round, group.attempt, None)
            raise AllReduceError("unverified", f"round {group.round}: a group of {len(group.members)} without every "
                                 "member's weight and nonce commitment, in a run that checks its reducers; nothing "
                                 "applied", set())
        if getattr(self.node, "direct", None) is not None:  # (their sources keep handshake slots: direct.py)
            self.node.direct.expect(m for m in group.members if m != self.node.peer_id)
        self._groups[group.group_id] = Expected(group, self.expected_streams(group, vector.numel(), exact_from))
        self._running[(group.round, group.attempt)] = group.group_id
        await self.decide(group.round, group.attempt, group.group_id)
        outcome = self._outcome(group.group_id)
        try:
            shape = Ring if self.uses_ring(group) else Butterfly
            context = RunContext(self.node.peer_id, self.codec, self.deadlines, self.faults, self.streams,
                                 self.on_bad_peer, self.max_weight, aggregator(self.aggregator_name),
                                 self.verifiable, self._nonces.get)
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
            remembered = set(self._running.values()) | set(self._finished.values())
            self._groups = {gid: expected for gid, expected in self._groups.items() if gid in remembered}
        self.deadlines.record(result.seconds)
        return result

    def _pull_bound(self, reducer: str, header: Header) -> int:
        """The largest frame of `reducer`'s averaged chunks that we pull as a client member of `header`'s group:
        what its part's largest chunk encodes to, as for the streams others open to us (expected_streams)."""
        expected = self._groups.get(header.group_id)
        bound = expected.streams.get(("pull", reducer)) if expected is not None else None
        if bound is None:
            raise ValueError(f"{reducer[-8:]} reduces no part of ours to pull in group {header.group_id[:8]}")
        return bound.payload

    def uses_ring(self, group: Group) -> bool:
        """Whether this group averages along a ring (ring.py): every member computes the same answer."""
        return combinations.ring_can_carry(self.codec.name, self.aggregator_name) and uses_ring(self.ring, group)

    def expected_streams(self, group: Group, numel: int, exact_from: Optional[int] = None) \
            -> dict[tuple[str, str], StreamBound]:
        """The chunk streams `group`'s members send us when we average a vector of `numel` elements in it, as the
        runs cut and encode it (butterfly.py, ring.py): (phase, sender) -> how many chunks, how large each. A
        client member's ("pull", reducer) bounds the averaged chunks it pulls from that reducer."""
        me, members, exact = self.node.peer_id, group.members, get_codec("none")
        n, i = len(members), members.index(me)
        if self.uses_ring(group):  # only our predecessor streams to us, everything lossless
            chunking = [chunk_bounds(a, b) for a, b in partition(numel, n)]
            largest = max(b - a for part in chunking for a, b in part)
            return {("ring", members[i - 1]): StreamBound(len(ring_schedule((i - 1) % n, chunking)),
                                                          max_encoded_len(exact, largest))}
        split = numel if exact_from is None else min(max(int(exact_from), 0), numel)
        chunking = [chunk_bounds(a, b, split) for a, b in partition(numel, group.shares, self.codec.alignment())]

        def bound(part: list[tuple[int, int]], averages: bool = False) -> StreamBound:
            codec = self.codec.average_codec(n) if averages else self.codec  # (averages: what reducers send back)
            return StreamBound(len(part), max(max_encoded_len(codec if a < split else exact, b - a) for a, b in part))

        client = bool(group.clients) and group.clients[i]
        verified = self.verifiable and len(members) >= 3 and bool(group.weights) and bool(group.commitments)
        report = StreamBound(1, report_bound(n, max(len(part) for part in chunking)))
        streams = {}
        for j, sender in enumerate(members):
            if sender != me and chunking[i]:  # its contribution to the part we reduce
                streams[("part", sender)] = bound(chunking[i])
            if sender != me and chunking[j]:  # the average of the part it reduces (which a client pulls)
                streams[("pull" if client else "avg", sender)] = bound(chunking[j], averages=True)
            if sender != me and verified and not client and not (group.clients or (False,) * n)[j]:  # its report
                streams[("verify", sender)] = report
        return streams


def _remembered(futures: dict, key, forgotten) -> asyncio.Future:
    """The future under `key`, made if new; the table is bounded (against senders naming endless keys), and a
    future dropped from it while pending resolves to `forgotten`."""
    if key not in futures:
        while len(futures) >= MAX_DECISIONS:
            # Answered ones go first: a sender naming new keys should not cut a wait that is still useful short.
            oldest = next((k for k, future in futures.items() if future.done()), next(iter(futures)))
            dropped = futures.pop(oldest)
            if not dropped.done():
                dropped.set_result(forgotten)
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
