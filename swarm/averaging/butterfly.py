"""The butterfly shape of the group all-reduce. Each member reduces one contiguous part (its share is set from its
bandwidth). Parts travel in chunks, and the phases are pipelined: every peer streams the chunks of part j (encoded
by the round's codec) to member j, which averages chunk k as soon as every contribution to it has arrived and
streams the averaged chunk back to everyone with its accounts (Averaged), while later chunks are still coming in.

Members in client mode (behind NAT: they accept no inbound streams) reduce nothing and open every stream
themselves: they push their parts like everyone, pull the averaged chunks from each reducer ("pull"), and in the
commit phase ask the others for their decision (see Run.commit)."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from typing import Optional

import torch

from swarm.averaging.aggregate import centered_clip_radius
from swarm.averaging.common import AllReduceError, Mailbox, all_or_first_failure, chunk_bounds, first_line
from swarm.averaging.faults import LYING_VALUES, SCALE
from swarm.averaging.matchmaking import Group
from swarm.averaging.messages import Averaged, Contribution, MessageError
from swarm.averaging.partition import partition
from swarm.averaging.run import Run, RunContext
from swarm.averaging.streams import GroupConflict
from swarm.averaging.verify import norm64
from swarm.averaging.verifying import Verifying
from swarm.compression import Codec

logger = logging.getLogger(__name__)
# A member sends a reducer chunk k of its part only once the average of chunk k - SCATTER_AHEAD came back. Without
# it, the part streams (nothing to wait for) fill the links' queues and take most of each upload from the average
# streams (which wait for every sender's chunk), and a round ends on the averages' tail: 4.04 s against 3.52 s on
# 4 x 100 Mbit/s fp32 with Reno (see README).
SCATTER_AHEAD = 8


class Butterfly(Verifying, Run):
    """Every member sends part j to member j and gets its average back. Elements from `exact_from` on travel
    uncompressed (global params and momentum of a mixing group: a lossy codec would move the params themselves)."""

    def __init__(self, context: RunContext, group: Group, mailbox: Mailbox, vector: torch.Tensor, weight: float,
                 exact_from: Optional[int] = None):
        super().__init__(context, group, mailbox, vector, weight, context.faults.bad_data(group.round))
        numel = self.vector.numel()
        self.bounds = partition(numel, group.shares, context.codec.alignment())
        self.split = numel if exact_from is None else min(max(int(exact_from), 0), numel)
        self.chunking = [chunk_bounds(a, b, self.split) for a, b in self.bounds]
        self.wire = {}
        self.reducers = [self.members[j] for j in range(len(self.members)) if j != self.index and self.reduces(j)]
        self.bad_reducers: set[str] = set()  # their averages did not decode: every member rejects them alike
        self.queues = {peer: asyncio.Queue() for peer in self.others}  # our part's averaged chunks, to each member
        self.verifying = (context.verifiable and len(self.members) >= 3 and bool(group.weights)
                          and bool(group.commitments))
        self.checking = self.verifying and not self.i_am_client  # (a client member applies as the others do)
        self.part_digests = [hashlib.sha256() for _ in self.chunking]  # of each part's averaged bytes, in order
        if self.checking:
            self.prepare_checks()

    def reduces(self, j: int) -> bool:
        return self.bounds[j][1] > self.bounds[j][0]

    def codec_at(self, start: int) -> Codec:
        return self.context.codec if start < self.split else self.exact

    def average_codec_at(self, start: int) -> Codec:
        """What the averages of elements from `start` travel back with (the sparse codec's: `support`)."""
        return self.context.codec.average_codec(len(self.members)) if start < self.split else self.exact

    async def came(self, slot: asyncio.Future, peer: str) -> bool:
        """Whether `peer`'s message in `slot` came before the deadline, its stream failing or its abort."""
        return await self.arrived(slot, [self.gone[peer], self.mailbox.slot("abort", peer)])

    async def move(self) -> None:
        members, mine = self.members, len(self.chunking[self.index])
        dies = ("send", self.group.round)
        tasks = [self.send(members[j], self.header("part", len(self.chunking[j]), Contribution(float(self.weight))),
                           self.parts_for(j), dies)
                 for j in range(len(members)) if j != self.index and self.reduces(j)]
        if self.reduces(self.index):
            for peer, queue in self.queues.items():
                if self.clients[members.index(peer)]:  # it pulls them: hand its queue to the stream it opens
                    slot = self.mailbox.slot("outbox", peer)
                    if not slot.done():
                        slot.set_result((queue, mine, self.stats))
                else:  # (a peer reducing everything sends only these)
                    tasks.append(self.send(peer, self.header("avg", mine), self.drain(queue), dies))
        if self.i_am_client:
            tasks += [self.pull(reducer) for reducer in self.reducers]
        tasks += [self.reduce_my_part()] + [self.receive_from(reducer) for reducer in self.reducers]
        await all_or_first_failure(tasks)

    async def parts_for(self, j: int):
        """Our chunks of part j, as (meta, payload), for its reducer."""
        reducer, throttled = self.members[j], True
        for k, (a, b) in enumerate(self.chunking[j]):
            if throttled and k >= SCATTER_AHEAD:
                # Not more than SCATTER_AHEAD chunks ahead of the averages we got back for this part.
                if not await self.came(self.mailbox.slot("avg", reducer, k - SCATTER_AHEAD), reducer):
                    throttled = False  # it is gone or late: its stream (or receive_from) tells the rest
            codec = self.codec_at(a)
            payload = self.outgoing(self.vector[a:b], codec)
            if self.delivered is not None and (codec.name != "none" and self.bad in (None, "lying-reducer")
                                               or self.bad in LYING_VALUES):
                # (a lying member's verification terms are of what it sent, as a careful liar's would be)
                self.delivered[a:b] = codec.decode(payload)
            yield {}, payload
            await asyncio.sleep(0)  # let other streams interleave

    async def drain(self, queue: asyncio.Queue):
        for _ in range(len(self.chunking[self.index])):
            yield await queue.get()

    async def reduce_my_part(self) -> None:
        start, end = self.bounds[self.index]
        if end <= start:
            return
        alive = list(self.others)
        rejected: list[str] = []
        for k, (a, b) in enumerate(self.chunking[self.index]):
            own_weight = self.group.weights[self.index] if self.group.weights else float(self.weight)
            if self.codec_at(a).own_part_encoded and self.delivered is not None:  # (as the others' come: sparse)
                self.delivered[a:b] = self.codec_at(a).round_trip(self.vector[a:b])
            parts, weights, contributors = [self.mine_at(self.index, a, b)], [own_weight], [self.me]
            for sender in list(alive):
                if not await self.came(self.mailbox.slot("part", sender, k), sender):
                    alive.remove(sender)  # not waited for again: later chunks go on without it
                    continue
                _, payload = self.mailbox.slot("part", sender, k).result()
                contribution = self.mailbox.slot("part", sender).result()  # see GroupAllReduce._on_stream
                self.stats["received"] += len(payload)
                self.faults.maybe_die("reduce", self.group.round)  # dies while reducing, parts in hand
                part, sender_weight = self.validated(sender, contribution, payload, b - a, self.codec_at(a))
                if self.bad == "reject-all":
                    part = None  # (a false accusation of every member: its word against theirs)
                if part is None:
                    alive.remove(sender)
                    rejected.append(sender)
                    continue
                parts.append(part)
                weights.append(sender_weight)
                contributors.append(sender)
            if sum(weights) <= 0:
                raise AllReduceError("bad_data", "the group's total weight is zero: nobody trained this round", set())
            radius = cap = None
            if self.verifying:  # (then the aggregate is CenteredClip, whose radius and norm cap the members check)
                norms = [norm64(part) for part in parts]  # (as members work out their own: verify.offset_stats)
                average, total_weight, radius, cap = centered_clip_radius(parts, weights, norms)
            else:
                average, total_weight = self.context.aggregate(parts, weights)
            if not torch.isfinite(average).all():  # (finite parts and weights give a finite aggregate: a bug)
                raise AllReduceError("bad_data", "the aggregate of this part is not finite", set())
            if self.bad == "lying-reducer":
                average = average * SCALE
            encoded = self.average_codec_at(a).encode(average)
            self.result[a:b] = self.average_codec_at(a).decode(encoded, max_numel=b - a)  # what the others will hold
            self.wire[a] = (a, b, bytes(encoded))
            if self.verifying:
                self.hashed(self.index, a)
            meta = Averaged(tuple(sorted(contributors)), tuple(sorted(rejected)), total_weight, radius,
                            cap).to_wire()
            self.accounts.setdefault(self.me, []).append(meta)
            lying = self.bad not in (None, *LYING_VALUES)
            outgoing = self.outgoing(average, self.average_codec_at(a)) if lying else encoded
            for queue in self.queues.values():
                queue.put_nowait((meta, outgoing))
            if self.checking:  # (once the average is on its way: the members wait for it, not for these)
                self.reduced_chunk(k, contributors, parts, norms, radius, cap)

    async def receive_from(self, reducer: str) -> None:
        for k, (a, b) in enumerate(self.chunking[self.members.index(reducer)]):
            if not await self.came(self.mailbox.slot("avg", reducer, k), reducer):
                self.unresponsive.add(reducer)
                return
            meta, payload = self.mailbox.slot("avg", reducer, k).result()
            self.stats["received"] += len(payload)
            self.faults.maybe_die("reduce", self.group.round)  # (when our own share is empty)
            try:
                self.result[a:b] = self.decode(reducer, payload, b - a, self.average_codec_at(a))
                self.wire[a] = (a, b, bytes(payload))
                if self.verifying:
                    self.hashed(self.members.index(reducer), a)
            except AllReduceError:
                self.bad_reducers.add(reducer)  # every member decodes the same bytes, so all of them reject it
                return
            self.accounts.setdefault(reducer, []).append(meta)
            if self.checking:
                self.averaged_chunk(self.members.index(reducer), k, meta)

    async def pull(self, reducer: str) -> None:
        """As a client member: fetch `reducer`'s averaged chunks through a stream we open."""
        try:
            await self.streams.pull(reducer, self.header("pull"), lambda i: self.mailbox.slot("avg", reducer, i),
                                    len(self.chunking[self.members.index(reducer)]))
        except GroupConflict:
            raise
        except Exception as e:  # noqa: BLE001 - that reducer is gone for this round
            logger.info("could not pull avg from %s: %s", reducer[-8:], first_line(e))
            self.mark_gone(reducer)

    def check_accounts(self) -> float:
        """If any chunk was averaged without some member, no part is applied anywhere. Every member sees the same
        reducers' accounts, so all agree that the round failed and who did not deliver (not waited for in the
        retry). Whom a reducer says it rejected is its word against theirs: it parts the two (its own exclusions,
        in its next entry, say so), and the others ban nobody on it. What we saw ourselves is ours: members we
        rejected as a reducer, and reducers whose averages did not decode (every member decodes the same bytes)."""
        members = set(self.members)
        rejected, disputed, weights = set(self.bad_reducers), set(), set()
        for sender, metas in self.accounts.items():
            for meta in metas:
                try:
                    averaged = Averaged.from_wire(meta)
                    if not set(averaged.contributors) <= members:
                        raise MessageError("contributors names peers outside the group")
                except MessageError:
                    self.context.on_bad_peer(sender, "bad_header")
                    self.unresponsive.add(sender)
                    continue
                named = set(averaged.rejected) & members
                if sender == self.me:
                    rejected |= named
                else:
                    disputed |= named
                self.unresponsive |= members - set(averaged.contributors) - set(averaged.rejected)
                weights.add(averaged.total_weight)
        if rejected or disputed or self.unresponsive:
            if self.unresponsive - {self.me}:
                self.context.deadlines.record_timeout(self.phase_timeout)
            raise AllReduceError(
                "bad_data" if rejected or disputed else "partial",
                f"round {self.group.round}: parts were averaged without "
                f"{', '.join(p[-8:] for p in sorted(rejected | disputed | self.unresponsive))}; nothing applied",
                self.unresponsive - {self.me}, rejected - {self.me})
        return self.agreed_weight(weights, "reducers")
