"""The ring shape of the group all-reduce (NCCL's pipelined ring), for lossless groups of three or more on even
links: member i streams only to member i+1, first the running sums of the parts, then the averaged parts, so every
link carries one TCP flow instead of N - 1 flows that share it unevenly. It moves the same bytes as the butterfly
(2 (N-1)/N of the vector each way) and shares its commit phase (run.py); since only a member's successor sees what
it sent, a member that gives up tells the others whom it blames (Blame), and the retry (attempt 1 on) runs the
butterfly."""

from __future__ import annotations

import asyncio
import logging
from typing import Optional

import torch

from swarm.averaging.common import AllReduceError, Mailbox, all_or_first_failure, chunk_bounds, first_line
from swarm.averaging.matchmaking import Group
from swarm.averaging.messages import Averaged, Contribution, MessageError, PartialSum
from swarm.averaging.partition import partition
from swarm.averaging.run import Run, RunContext
from swarm.averaging.streams import GroupConflict

logger = logging.getLogger(__name__)
RING_SPREAD = 1.1  # largest ratio of the members' implied link speeds at which the ring is used
ABORT_GRACE = 2.0  # s a member whose neighbour's stream broke waits for an abort naming whom to blame


def uses_ring(mode: str, group: Group) -> bool:
    """Whether `group`, of a run whose codec and aggregator a ring can carry (combinations.ring_can_carry),
    averages along a ring under `averaging.ring` = `mode`: every member computes the same answer from the group."""
    n = len(group.members)
    if mode == "never" or group.attempt != 0 or n < 3 or any(group.clients):
        return False
    if mode == "always":
        return True
    # The leader set shares so that member i moves S (1 + (N - 2) p_i) at its speed: these give the speeds.
    loads = [1 + (n - 2) * share for share in group.shares]
    return mode == "auto" and min(group.shares) > 0 and max(loads) <= RING_SPREAD * min(loads)


def ring_schedule(i: int, chunking: list[list[tuple[int, int]]]) -> list[tuple[str, int, int]]:
    """What member i of a ring of len(chunking) sends its successor, in order, as (kind, part, chunk): the partial
    sums of parts i-1, i-2, ... ("sum"), then the averages of parts i, i-1, ... ("avg")."""
    n = len(chunking)
    sums = [("sum", (i - 1 - s) % n, k) for s in range(n - 1) for k in range(len(chunking[(i - 1 - s) % n]))]
    return sums + [("avg", (i - s) % n, k) for s in range(n - 1) for k in range(len(chunking[(i - s) % n]))]


def builds_on(i: int, n: int, item: tuple[str, int, int]) -> Optional[tuple[str, int, int]]:
    """The predecessor's message that member i's message `item` (of ring_schedule) builds on, or None: a partial
    sum extends the predecessor's (except where the part's sum starts, at member part+1), a part's average is made
    from its complete sum, and another part's average is forwarded."""
    kind, part, k = item
    if kind == "sum":
        return None if part == (i - 1) % n else ("sum", part, k)
    return ("sum", part, k) if part == i else ("avg", part, k)


class Ring(Run):
    """Member i streams to member i+1, in order, the partial sums of parts i-1, i-2, ... (each adding its own
    contribution to what member i-1 sent), then the averaged parts i, i-1, ... (its own, then forwarding what it
    received). Part j's sum starts at member j+1 and ends at member j, which averages it. Everything travels
    lossless (a ring is only used with the lossless codec), so `exact_from` changes nothing."""

    def __init__(self, context: RunContext, group: Group, mailbox: Mailbox, vector: torch.Tensor, weight: float,
                 exact_from: Optional[int] = None):
        super().__init__(context, group, mailbox, vector, weight, context.faults.bad_data(group.round, ring=True))
        n = self.n = len(self.members)
        self.succ, self.pred = self.members[(self.index + 1) % n], self.members[(self.index - 1) % n]
        self.chunking = [chunk_bounds(a, b) for a, b in partition(self.vector.numel(), n)]
        self.schedule = ring_schedule(self.index, self.chunking)
        self.from_pred = {item: m for m, item in enumerate(ring_schedule((self.index - 1) % n, self.chunking))}
        self.aborts = [mailbox.slot("abort", peer) for peer in self.others]
        self.lost = mailbox.slot("lost", self.pred)  # the predecessor's stream broke
        self.broken = self.gone[self.succ]  # our stream to the successor failed

    async def move(self) -> None:
        await all_or_first_failure([self.send_ring(), self.receive_last()])

    async def send_ring(self) -> None:
        header = self.header("ring", len(self.schedule), Contribution(float(self.weight)))
        try:
            await self.streams.send(self.succ, header, self.ring_stream(), self.stats,
                                    die_after_first=("send", self.group.round))
        except (AllReduceError, GroupConflict):
            raise
        except Exception as e:  # noqa: BLE001 - any transport error: the successor is gone for this round
            logger.info("could not send the ring to %s: %s", self.succ[-8:], first_line(e))
            self.mark_gone(self.succ)
            raise await self.broke({self.succ}) from None

    async def ring_stream(self):
        """What we send our successor, as (meta, payload), in ring_schedule's order."""
        for kind, part, k in self.schedule:
            a, b = self.chunking[part][k]
            total, total_weight, contributors = self.vector[a:b] * self.weight, float(self.weight), [self.me]
            if builds_on(self.index, self.n, (kind, part, k)) == ("sum", part, k):
                summed, summed_weight, named = self.partial_sum(*await self.incoming(("sum", part, k)), b - a)
                total, total_weight, contributors = total + summed, total_weight + summed_weight, \
                    contributors + named
                self.faults.maybe_die("reduce", self.group.round)  # dies with partial sums in hand
            if kind == "sum":
                yield PartialSum(tuple(contributors), total_weight).to_wire(), self.outgoing(total, self.exact)
                self.faults.maybe_die("ring", self.group.round)  # dies with some of its ring stream delivered
            elif part == self.index:  # the sum of our part is complete: average it and send it around
                if total_weight <= 0:
                    raise AllReduceError("bad_data", "the group's total weight is zero: nobody trained this "
                                         "round", set())
                average = total / total_weight
                self.result[a:b] = average
                meta = Averaged(tuple(sorted(contributors)), (), total_weight).to_wire()
                self.accounts.setdefault(self.me, []).append(meta)
                yield meta, self.outgoing(average, self.exact)
            else:  # another member's average: keep it and pass it on
                meta, payload = await self.incoming(("avg", part, k))
                self.averaged(meta, payload, part, a, b)
                yield meta, payload

    async def receive_last(self) -> None:
        """The successor's average ends its trip with us: keep it."""
        part = (self.index + 1) % self.n
        for k, (a, b) in enumerate(self.chunking[part]):
            self.averaged(*await self.incoming(("avg", part, k)), part, a, b)

    async def incoming(self, item: tuple[str, int, int]) -> tuple[dict, bytes]:
        """The predecessor's message `item`; a member giving up, or the deadline, ends the attempt."""
        slot = self.mailbox.slot("ring", self.pred, self.from_pred[item])
        if not await self.arrived(slot, [self.broken, self.lost, *self.aborts]):
            raise await self.broke({self.pred} if not self.broken.done() else {self.succ})
        meta, payload = slot.result()
        self.stats["received"] += len(payload)
        return meta, payload

    def partial_sum(self, meta: dict, payload: bytes, numel: int) -> tuple[torch.Tensor, float, list[str]]:
        """What the predecessor sent as a part's partial sum, checked: values, weight and contributors."""
        try:
            partial = PartialSum.from_wire(meta)
            if not set(partial.contributors) <= set(self.members) - {self.me} or self.pred not in partial.contributors:
                raise MessageError("contributors must be other members, the predecessor among them")
            if partial.weight > self.context.max_weight * len(partial.contributors):
                raise MessageError(f"weight {partial.weight:g} over {len(partial.contributors)} contributions' cap")
        except MessageError:
            self.context.on_bad_peer(self.pred, "bad_header")
            raise AllReduceError("bad_data", f"peer {self.pred[-8:]} sent a malformed partial sum", set(),
                                 {self.pred}) from None
        try:
            return self.decode(self.pred, payload, numel, self.exact), partial.weight, list(partial.contributors)
        except AllReduceError as e:
            raise AllReduceError("bad_data", str(e), set(), {self.pred}) from None

    def averaged(self, meta: dict, payload: bytes, part: int, a: int, b: int) -> None:
        try:
            self.result[a:b] = self.decode(self.pred, payload, b - a, self.exact)
        except AllReduceError as e:
            raise AllReduceError("bad_data", str(e), set(), {self.pred}) from None
        self.accounts.setdefault(self.members[part], []).append(meta)

    def check_accounts(self) -> float:
        """The same all-or-nothing rule as the butterfly's: every chunk averaged over every member, one weight."""
        weights = set()
        for j, member in enumerate(self.members):
            metas = [_averaged(meta) for meta in self.accounts.get(member, [])]
            if len(metas) != len(self.chunking[j]) or \
                    any(meta is None or list(meta.contributors) != list(self.members) for meta in metas):
                raise AllReduceError("partial", f"round {self.group.round}: part {j} was not averaged over the "
                                     "whole group; nothing applied", set())
            weights |= {meta.total_weight for meta in metas}
        return self.agreed_weight(weights, "the ring's parts")

    async def broke(self, default: set[str]) -> AllReduceError:
        """Why the ring broke, once a neighbour's stream did (or went quiet), or a member gave up: the members
        that gave up tell us whom they blame (their Blame); if none did, `default` (that neighbour) is the suspect.
        Such a member closes its ring stream before its abort (a new stream) reaches us, so a blaming abort is
        waited for a moment; a member that died sends none."""
        # An abort that blames nobody (a member that gave up because its own neighbour's stream closed) must not end
        # the wait for one that names whom the garbage came from: that one came second in a full suite's run, and
        # the third member blamed nobody.
        deadline = asyncio.get_running_loop().time() + ABORT_GRACE
        while not any(abort.done() and (abort.result().suspects or abort.result().rejected) for abort in self.aborts):
            waiting = [abort for abort in self.aborts if not abort.done()]
            remaining = deadline - asyncio.get_running_loop().time()
            if not waiting or remaining <= 0 or not (self.lost.done() or self.broken.done() or
                                                     any(abort.done() for abort in self.aborts)):
                break
            await asyncio.wait(waiting, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
        blames = [abort.result() for abort in self.aborts if abort.done()]
        members = set(self.members) - {self.me}
        suspects = {p for blame in blames for p in blame.suspects} & members if blames else set(default) - {self.me}
        rejected = {p for blame in blames for p in blame.rejected} & members
        blamed = ", ".join(p[-8:] for p in sorted(suspects | rejected)) or "a member gave up"
        return AllReduceError("bad_data" if rejected else "partial", f"round {self.group.round}: the ring broke "
                              f"({blamed}); nothing applied", suspects, rejected)


def _averaged(meta: dict) -> Optional[Averaged]:
    """An averaged chunk's accounts, or None if malformed (which fails the check like a missing member)."""
    try:
        return Averaged.from_wire(meta)
    except MessageError:
        return None
