"""The ring shape of the group all-reduce (NCCL's pipelined ring), for lossless groups of three or more on even
links: member i streams only to member i+1, first the running sums of the parts, then the averaged parts, so every
link carries one TCP flow instead of N - 1 flows that share it unevenly. It moves the same bytes as the butterfly
(2 (N-1)/N of the vector each way) and keeps its accounts and commit phase (see allreduce.py); since only a
member's successor sees what it sent, a member that gives up tells the others whom it blames, and the retry
(attempt 1 on) runs the butterfly."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Optional

import torch

from swarm.averaging.common import (COMMIT_GRACE, AllReduceError, AllReduceResult, Mailbox, all_or_first_failure,
                                    chunk_bounds, no_chunks)
from swarm.averaging.matchmaking import Group
from swarm.averaging.partition import partition
from swarm.averaging.streams import GroupConflict
from swarm.compression import get_codec

if TYPE_CHECKING:
    from swarm.averaging.allreduce import GroupAllReduce

logger = logging.getLogger(__name__)
RING_SPREAD = 1.1  # largest ratio of the members' implied link speeds at which the ring is used
ABORT_GRACE = 2.0  # s a member whose neighbour's stream broke waits for an abort naming whom to blame


def uses_ring(mode: str, codec_name: str, group: Group) -> bool:
    """Whether `group` averages along a ring, under `averaging.ring` = `mode` and the run's codec: every member
    computes the same answer from the group."""
    n = len(group.members)
    if mode == "never" or codec_name != "none" or group.attempt != 0 or n < 3 or any(group.clients):
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


async def run_ring(engine: GroupAllReduce, group: Group, vector: torch.Tensor, weight: float) -> AllReduceResult:
    """The ring: member i streams to member i+1, in order, the partial sums of parts i-1, i-2, ... (each
    adding its own contribution to what member i-1 sent), then the averaged parts i, i-1, ... (its own, then
    forwarding what it received). Part j's sum starts at member j+1 and ends at member j, which averages it."""
    started = time.monotonic()
    me, members = engine.node.peer_id, group.members
    n, index = len(members), members.index(me)
    succ, pred = members[(index + 1) % n], members[(index - 1) % n]
    others = [m for m in members if m != me]
    vector = vector.detach().to(torch.float32).contiguous().view(-1)
    chunking = [chunk_bounds(a, b) for a, b in partition(vector.numel(), n)]
    exact = get_codec("none")
    mailbox = engine._mailbox(group.group_id)
    phase_timeout = engine.deadlines.phase_timeout(group.phase_timeout)
    stats = {"sent": 0, "received": 0}
    bad = engine.faults.bad_data(group.round, ring=True)
    result = torch.empty_like(vector)
    accounts: dict[str, list[dict]] = {}  # member -> its meta for each chunk of its part

    mine = ring_schedule(index, chunking)
    from_pred = {item: m for m, item in enumerate(ring_schedule((index - 1) % n, chunking))}
    aborts = [mailbox.slot("abort", peer) for peer in others]
    lost = mailbox.slot("lost", pred)  # the predecessor's stream broke
    broken = asyncio.Event()  # our stream to the successor failed

    async def broke(default: set[str]) -> AllReduceError:
        """Why the ring broke, once a neighbour's stream did (or went quiet): `default` is to blame unless a member
        that gave up says whom it blames. Such a member closes its ring stream before its abort (a new stream)
        reaches us, so that is waited for a moment; a member that died sends none."""
        if (lost.done() or broken.is_set()) and not any(abort.done() for abort in aborts):
            await asyncio.wait(aborts, timeout=ABORT_GRACE, return_when=asyncio.FIRST_COMPLETED)
        return ring_failure(me, group, mailbox, others, default)

    async def incoming(item: tuple[str, int, int]) -> tuple[dict, bytes]:
        """The predecessor's message `item`; a member giving up, or the deadline, ends the attempt."""
        slot = mailbox.slot("ring", pred, from_pred[item])
        if not slot.done() and not any(abort.done() for abort in aborts) and not broken.is_set() and \
                not lost.done():
            waiter = asyncio.ensure_future(broken.wait())
            try:
                await asyncio.wait([slot, waiter, lost, *aborts], timeout=phase_timeout,
                                   return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiter.cancel()
        if not slot.done():
            raise await broke({pred} if not broken.is_set() else {succ})
        meta, payload = slot.result()
        stats["received"] += len(payload)
        return meta, payload

    def partial_sum(meta: dict, payload: bytes, numel: int) -> tuple[torch.Tensor, float, list[str]]:
        """What the predecessor sent as a part's partial sum, checked: values, weight and contributors."""
        named, total_weight = meta.get("contributors"), meta.get("weight")
        if not isinstance(named, list) or not all(isinstance(m, str) for m in named) or len(set(named)) != \
                len(named) or not set(named) <= set(members) - {me} or pred not in named or \
                isinstance(total_weight, bool) or not isinstance(total_weight, (int, float)) or \
                not 0 <= total_weight < 1e18:
            engine.on_bad_peer(pred, "bad_header")
            raise AllReduceError("bad_data", f"peer {pred[-8:]} sent a malformed partial sum", set(), {pred})
        try:
            return engine._decode(pred, payload, numel, exact), float(total_weight), named
        except AllReduceError as e:
            raise AllReduceError("bad_data", str(e), set(), {pred}) from None

    def averaged(meta: dict, payload: bytes, part: int, a: int, b: int) -> None:
        try:
            result[a:b] = engine._decode(pred, payload, b - a, exact)
        except AllReduceError as e:
            raise AllReduceError("bad_data", str(e), set(), {pred}) from None
        accounts.setdefault(members[part], []).append(meta)

    async def messages():
        for kind, part, k in mine:
            a, b = chunking[part][k]
            total, total_weight, contributors = vector[a:b] * weight, float(weight), [me]
            if builds_on(index, n, (kind, part, k)) == ("sum", part, k):
                summed, summed_weight, named = partial_sum(*await incoming(("sum", part, k)), b - a)
                total, total_weight, contributors = total + summed, total_weight + summed_weight, \
                    contributors + named
                engine.faults.maybe_die("reduce", group.round)  # dies with partial sums in hand
            if kind == "sum":
                yield {"contributors": contributors, "weight": total_weight}, engine._outgoing(total, bad, exact)
                engine.faults.maybe_die("ring", group.round)  # dies with some of its ring stream delivered
            elif part == index:  # the sum of our part is complete: average it and send it around
                if total_weight <= 0:
                    raise AllReduceError("bad_data", "the group's total weight is zero: nobody trained this "
                                         "round", set())
                average = total / total_weight
                result[a:b] = average
                meta = {"contributors": sorted(contributors), "rejected": [], "total_weight": total_weight}
                accounts.setdefault(me, []).append(meta)
                yield meta, engine._outgoing(average, bad, exact) if bad else exact.encode(average)
            else:  # another member's average: keep it and pass it on
                meta, payload = await incoming(("avg", part, k))
                averaged(meta, payload, part, a, b)
                yield meta, payload

    async def send() -> None:
        try:
            await engine.streams.send(succ, {"group_id": group.group_id, "round": group.round,
                                           "attempt": group.attempt, "phase": "ring", "weight": float(weight),
                                           "chunks": len(mine)}, messages(), stats,
                                    die_after_first=("send", group.round))
        except (AllReduceError, GroupConflict):
            raise
        except Exception as e:  # noqa: BLE001 - any transport error: the successor is gone for this round
            logger.info("could not send the ring to %s: %s", succ[-8:],
                        str(e).splitlines()[0] if str(e) else type(e).__name__)
            broken.set()
            raise await broke({succ}) from None

    async def receive_last() -> None:  # the successor's average ends its trip with us: keep it
        part = (index + 1) % n
        for k, (a, b) in enumerate(chunking[part]):
            averaged(*await incoming(("avg", part, k)), part, a, b)

    await all_or_first_failure([send(), receive_last()])

    # The same all-or-nothing accounts as the butterfly: every chunk averaged over every member, one weight.
    weights = set()
    for j, member in enumerate(members):
        metas = accounts.get(member, [])
        if len(metas) != len(chunking[j]) or any(meta.get("contributors") != list(members) for meta in metas):
            raise AllReduceError("partial", f"round {group.round}: part {j} was not averaged over the whole "
                                 "group; nothing applied", set())
        weights |= {meta.get("total_weight") for meta in metas}
    if len(weights) != 1 or not isinstance(next(iter(weights)), float):
        raise AllReduceError("partial", f"round {group.round}: the ring's parts disagree on the total weight "
                             f"{sorted(map(str, weights))}; nothing applied", set())

    engine.faults.maybe_die("commit", group.round)
    unconfirmed = set()

    async def commit(peer: str) -> None:
        try:
            await engine.streams.send(peer, {"group_id": group.group_id, "round": group.round,
                                           "attempt": group.attempt, "phase": "commit", "chunks": 0},
                                    no_chunks(), stats)
        except GroupConflict:
            raise
        except Exception:  # noqa: BLE001 - its own commit (or its absence) decides below
            unconfirmed.add(peer)
    await asyncio.gather(*(commit(peer) for peer in others))
    commits = await engine._collect(mailbox, "commit", others,
                                  min(phase_timeout, COMMIT_GRACE) if unconfirmed else phase_timeout)
    missing = set(others) - set(commits)
    if missing:
        raise AllReduceError("commit", f"round {group.round}: {len(missing)} member(s) did not confirm; "
                             "nothing applied", missing)
    return AllReduceResult(result, vector.clone(), next(iter(weights)), n, stats["sent"], stats["received"],
                           time.monotonic() - started)


def ring_failure(node_id: str, group: Group, mailbox: Mailbox, others: list[str],
                 default: set[str]) -> AllReduceError:
    """Why a ring attempt ended: the members that gave up told us whom they blame; if nobody did, `default`
    (the neighbour whose stream failed or went quiet) is the suspect."""
    suspects, rejected, gave_up = set(), set(), False
    for peer in others:
        slot = mailbox.slot("abort", peer)
        if slot.done():
            gave_up = True
            header = slot.result() if isinstance(slot.result(), dict) else {}
            for name, into in (("suspects", suspects), ("rejected", rejected)):
                named = header.get(name)
                if isinstance(named, list):
                    into |= {m for m in named if isinstance(m, str) and m in group.members}
    if not gave_up:
        suspects = set(default)
    suspects -= {node_id}
    rejected -= {node_id}
    blamed = ", ".join(p[-8:] for p in sorted(suspects | rejected)) or "a member gave up"
    return AllReduceError("bad_data" if rejected else "partial",
                          f"round {group.round}: the ring broke ({blamed}); nothing applied", suspects, rejected)
