"""One run of the group all-reduce: one object per attempt of one group, made by the server (allreduce.py) and
dropped when the attempt ends. The base class holds what both shapes share: waiting for a member's messages,
sending to it, judging its data, and the commit phase; Butterfly (butterfly.py) and Ring (ring.py) add only their
own data movement and accounts."""

from __future__ import annotations

import abc
import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch

from swarm.averaging.aggregate import Aggregate, mean
from swarm.averaging.common import COMMIT_GRACE, AllReduceError, AllReduceResult, Mailbox, first_line, no_chunks
from swarm.averaging.deadlines import AdaptiveDeadlines
from swarm.averaging.faults import LYING_VALUES, SCALE, FaultPlan
from swarm.averaging.matchmaking import Group
from swarm.averaging.messages import Body, Contribution, Header, MessageError
from swarm.averaging.streams import GroupConflict, StreamClient
from swarm.compression import Codec, CodecError, get_codec

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunContext:
    """What a run uses of the server that started it (the server outlives its runs)."""

    peer_id: str
    codec: Codec  # the run's codec (the butterfly sends elements before exact_from with it)
    deadlines: AdaptiveDeadlines
    faults: FaultPlan
    streams: StreamClient
    on_bad_peer: Callable[[str, str], None]  # (peer, reason): a peer sent a bad contribution
    max_weight: float = float("inf")  # the most tokens one member's contribution may weigh (a weight is declared)
    aggregate: Aggregate = mean  # how a reducer combines a chunk's contributions (aggregate.py)
    # Whether reducers' CenteredClip is checked (verify.py): the run's aggregate and codec allow it. A group is
    # verified when this holds, it has three or more members, and every member declared its weight and nonce.
    verifiable: bool = False
    nonce_for: Callable[[str], Optional[bytes]] = lambda commitment: None  # our nonce behind a commitment


class Run(abc.ABC):
    """One member's side of one attempt of one group. `execute()` moves the data (the subclass's `move`), checks
    the accounts (its `check_accounts`), commits, and returns the result; it raises AllReduceError naming the
    members suspected of causing a failure, and then nothing is applied."""

    def __init__(self, context: RunContext, group: Group, mailbox: Mailbox, vector: torch.Tensor, weight: float,
                 bad: Optional[str]):
        self.started = time.monotonic()
        self.verification_seconds = 0.0  # what `committed` spent checking the reducers (where it does)
        self.context, self.group, self.mailbox, self.weight = context, group, mailbox, weight
        self.faults, self.streams = context.faults, context.streams
        self.me, self.members = context.peer_id, group.members
        self.others = [m for m in self.members if m != self.me]
        self.index = self.members.index(self.me)
        self.clients = group.clients or (False,) * len(self.members)
        self.i_am_client = self.clients[self.index]
        self.servers = [m for m in self.others if not self.clients[self.members.index(m)]]  # we can open streams to
        self.vector = vector.detach().to(torch.float32).contiguous().view(-1)
        self.exact = get_codec("none")
        self.phase_timeout = context.deadlines.phase_timeout(group.phase_timeout)
        self.stats = {"sent": 0, "received": 0}
        self.bad = bad  # the kind of bad data fault injection makes us send, if any
        self.result = torch.empty_like(self.vector)
        # Our vector as the reducers decode it, for error feedback and the checks: kept whole only for a codec with
        # error feedback or a member that sends made-up values (fault injection). Else the checks encode each chunk
        # again where they read it (Verifying.mine_at, Codec.round_trip): fp16's and none's encoding is a function of
        # the values alone, and a round spares a vector's worth of memory (4 bytes a parameter a whole-model sync).
        self.delivered = self.vector.clone() if context.codec.error_feedback or bad is not None else None
        # Chunk start -> (start, end, the bytes its average travelled as); None where averages travel as fp32.
        self.wire: Optional[dict[int, tuple[int, int, bytes]]] = None
        self.accounts: dict[str, list[dict]] = {}  # member -> the wire meta of each averaged chunk of its part
        self.unresponsive: set[str] = set()
        loop = asyncio.get_running_loop()
        self.gone = {peer: loop.create_future() for peer in self.others}  # a stream to it failed: wait no more

    async def execute(self) -> AllReduceResult:
        await self.move()
        total_weight = self.check_accounts()
        await self.commit()
        return AllReduceResult(self.result, self.delivered, total_weight, len(self.members), self.stats["sent"],
                               self.stats["received"], time.monotonic() - self.started,
                               None if self.wire is None else [self.wire[a] for a in sorted(self.wire)],
                               self.verification_seconds)

    @abc.abstractmethod
    async def move(self) -> None:
        """Move the data: fill self.result and self.accounts, or raise AllReduceError."""

    @abc.abstractmethod
    def check_accounts(self) -> float:
        """The all-or-nothing rule: raise AllReduceError unless every chunk was averaged over the whole group;
        returns the group's total weight."""

    def header(self, phase: str, chunks: int = 0, body: Optional[Body] = None) -> Header:
        return Header(phase, self.group.group_id, self.group.round, self.group.attempt, chunks, body)

    async def arrived(self, slot: asyncio.Future, ends: Iterable[asyncio.Future]) -> bool:
        """Whether `slot`'s message came: waits until it does, one of `ends` is done (its sender is gone or gave
        the attempt up), or the phase deadline passes."""
        ends = list(ends)
        if not slot.done() and not any(end.done() for end in ends):
            await asyncio.wait([slot, *ends], timeout=self.phase_timeout, return_when=asyncio.FIRST_COMPLETED)
        return slot.done()

    def mark_gone(self, peer: str) -> None:
        self.unresponsive.add(peer)
        if not self.gone[peer].done():
            self.gone[peer].set_result(True)

    async def send(self, peer: str, header: Header, chunks, die_after_first: Optional[tuple] = None) -> None:
        """Stream `header` and `chunks` to `peer`; a transport error marks it gone for this attempt."""
        try:
            await self.streams.send(peer, header, chunks, self.stats, die_after_first)
        except (AllReduceError, GroupConflict):
            raise
        except Exception as e:  # noqa: BLE001 - any transport error means that peer is gone for this round
            logger.info("could not send %s to %s: %s", header.phase, peer[-8:], first_line(e))
            self.mark_gone(peer)

    def agreed_weight(self, weights: set[float], whose: str) -> float:
        """The total weight every averaged chunk names; they must all name the same one."""
        if len(weights) != 1:
            raise AllReduceError("partial", f"round {self.group.round}: {whose} disagree on the total weight "
                                 f"{sorted(map(str, weights))}; nothing applied", set())
        return next(iter(weights))

    async def commit(self) -> None:
        """Phase 3: commit only once every member holds every part. We apply iff every other member's commit
        reached us; whether our own commits were acknowledged does not matter for our decision (a lost
        acknowledgement is not a lost commit; the rare peer left behind re-syncs through the state digest)."""
        round_no = self.group.round
        self.faults.maybe_die("commit", round_no)
        body = self.reveal()  # (once, even with nobody to send it to: a lone server among clients checks with it)
        await asyncio.gather(*(self.send(peer, self.header("commit", body=body), no_chunks())
                               for peer in self.servers))
        if self.i_am_client:
            # We cannot receive commits: ask every non-client member whether it applies (it does only once every
            # member committed), and apply only if all of them do.
            asked = [asyncio.ensure_future(self.streams.ask_decision(peer, self.header("decision")))
                     for peer in self.servers]
            done, pending = await asyncio.wait(asked, timeout=self.phase_timeout)
            for task in pending:
                task.cancel()
            applying = {peer for peer, task in zip(self.servers, asked)
                        if task in done and not task.exception() and task.result()}
            if applying != set(self.servers):
                raise AllReduceError("commit", f"round {round_no}: {len(set(self.servers) - applying)} member(s) "
                                     "did not apply; nothing applied", set(self.servers) - applying)
            return
        # A member our commit could not reach is most likely dead: its own commit, if it sent one, is here by
        # now or very soon, so do not wait out the whole deadline for it.
        commit_timeout = min(self.phase_timeout, COMMIT_GRACE) if self.unresponsive else self.phase_timeout
        commits = await self.collect("commit", self.others, commit_timeout)
        unconfirmed = set(self.others) - set(commits)
        if unconfirmed:
            if not self.unresponsive:
                self.context.deadlines.record_timeout(self.phase_timeout)
            raise AllReduceError("commit", f"round {round_no}: {len(unconfirmed)} member(s) did not confirm; "
                                 "nothing applied", unconfirmed)
        await self.committed(commits)

    def reveal(self):
        """The body of our commit header (a subclass that verifies reducers reveals its nonce), or None."""
        return None

    async def committed(self, commits: dict) -> None:
        """Every member committed (`commits`: sender -> its commit header as received, a dict): a subclass may still
        check the averages before we apply them, raising AllReduceError if it does not accept them."""

    async def collect(self, phase: str, senders: list[str], timeout: float) -> dict:
        """Headers of `phase` from `senders` that arrive within `timeout` s: {sender: header}."""
        slots = {sender: self.mailbox.slot(phase, sender) for sender in senders}
        aborts = {sender: self.mailbox.slot("abort", sender) for sender in senders}
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

    def outgoing(self, part: torch.Tensor, codec: Codec) -> bytes:
        """The encoded part, or (under fault injection) a named kind of bad data."""
        if self.bad == "garbage":
            return b"\x00garbage" * 8
        if self.bad == "nan":  # a well-formed fp32 payload whose values are NaN
            payload = bytearray(self.exact.encode(torch.zeros_like(part)))
            payload[len(payload) - 4 * part.numel():] = torch.full_like(part, float("nan")).numpy().tobytes()
            return bytes(payload)
        if self.bad == "short":
            return codec.encode(part[: max(part.numel() // 2, 1)])
        if self.bad in LYING_VALUES:
            return codec.encode(part * (-1.0 if self.bad == "flipped" else SCALE))
        return codec.encode(part)

    def declared_weight(self, member: str, said: float) -> Optional[float]:
        """The weight `member` declared in its matchmaking entry (the group's), which must be what its header `said`
        (None if it is not: it declared another weight to us than to the group); its header's where the group names
        no weights."""
        if not self.group.weights:
            return said
        declared = self.group.weights[self.members.index(member)]
        return declared if declared == said else None

    def validated(self, sender: str, contribution: Contribution | MessageError, payload: bytes, numel: int,
                  codec: Codec) -> tuple[Optional[torch.Tensor], float]:
        """A contribution's decoded part and weight, or (None, 0) if it is bad: the sender is then left out of
        this part, which every member sees in the contributor list, so the round is redone without it.
        `contribution` is what its header said (a Contribution, or the MessageError its weight failed with)."""
        weight = None if isinstance(contribution, MessageError) else \
            self.declared_weight(sender, contribution.weight)
        if weight is None or weight > self.context.max_weight:
            self.context.on_bad_peer(sender, "bad_weight")  # an inflated weight would outvote the whole group
            return None, 0.0
        try:
            return self.decode(sender, payload, numel, codec), weight
        except AllReduceError:
            return None, 0.0

    def decode(self, sender: str, payload: bytes, numel: int, codec: Codec) -> torch.Tensor:
        """`sender`'s payload of `numel` values; raises AllReduceError (bad_data, suspecting it) if it is bad."""
        try:
            part = codec.decode(payload, max_numel=numel)
        except CodecError as e:
            self.context.on_bad_peer(sender, "undecodable")
            raise AllReduceError("bad_data", f"peer {sender[-8:]} sent undecodable data: {e}", {sender}) from None
        if part.numel() != numel or not torch.isfinite(part).all():
            self.context.on_bad_peer(sender, "bad_values")
            raise AllReduceError("bad_data", f"peer {sender[-8:]} sent {part.numel()} values (expected {numel}) "
                                             "or non-finite values", {sender})
        return part
