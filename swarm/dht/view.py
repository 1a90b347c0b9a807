"""The swarm as the peers' announcements show it: pure readings of a list of PeerRecords at a DHT time `now` (live
peers, progress toward a round, the swarm's reference state, block throughputs, a summary for operators). The
announcer, the status command, the bootstrap's exporter and the progress line all read the swarm through these."""

from __future__ import annotations

import math

import statistics
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from typing import NamedTuple, Optional, Sequence

from swarm.dht.records import ONLINE_STATES, PEER_STATES, ROUND_STATES, TRAINING_STATES, PeerRecord

HEARTBEAT_SECONDS = 1.0  # how often a peer re-announces itself: progress is read from the view, so it must stay fresh
EXTRAPOLATE_SECONDS = 3 * HEARTBEAT_SECONDS  # how far ahead of its last announcement a peer's progress is estimated
FRESH_SECONDS = 5 * HEARTBEAT_SECONDS  # a record older than this is from a peer whose heartbeat stopped
FUTURE_SECONDS = FRESH_SECONDS  # a record dated further ahead than this is refused (doctor warns of clocks off 2.5 s)
PACE_SPREAD = 4.0  # in a round's progress, no peer counts more than this many times the peers' lower median

Records = Sequence[PeerRecord]


class Reference(NamedTuple):
    """The state a peer should hold: the highest round of live peers, the digest most of them hold at it, and the
    peers holding that digest who serve it."""

    round: int
    digest: str
    holders: list[str]


# ---- who is there ---------------------------------------------------------------------------------------------
def others(records: Records, me: str) -> list[PeerRecord]:
    """Every record but `me`'s: a peer reads its own numbers live, not as it last announced them."""
    return [p for p in records if p.peer_id != me]


def online(records: Records) -> list[PeerRecord]:
    """Records of peers that are up (any state but offline), however old their heartbeat."""
    return [p for p in records if p.state in ONLINE_STATES]


def live(records: Records, now: float, states: tuple[str, ...] = TRAINING_STATES) -> list[PeerRecord]:
    """Records in one of `states` whose heartbeat is fresh at `now` (a crashed peer's record lingers until it
    expires; a few missed heartbeats are enough to stop counting on it). A record dated more than FUTURE_SECONDS
    ahead of `now` is no peer's: signed once with a future time, it would stay "fresh" for its whole lifetime
    without a heartbeat."""
    fresh_after = now - FRESH_SECONDS
    return [p for p in records if fresh_after <= p.updated <= now + FUTURE_SECONDS and p.state in states]


def at_round(records: Records, round_no: int) -> list[PeerRecord]:
    """Records of training (or averaging) peers whose announced round is `round_no`, however old."""
    return [p for p in records if p.state in TRAINING_STATES and p.round == round_no]


def top_round(records: Records) -> tuple[int, list[PeerRecord]]:
    """The highest round among `records` (0 when there are none) and the records at it."""
    top = max((p.round for p in records), default=0)
    return top, [p for p in records if p.round == top]


def in_round(records: Records, round_no: int, now: float) -> list[PeerRecord]:
    """Live peers that take part in `round_no`: at that round, or (with overlap) training toward it while their
    contribution of the round before is in flight. Matchmaking waits for these; a peer with an average in flight
    enters the next round's matchmaking only once that average landed, and counting it out (by its record's round
    alone) let groups form without it: at 20 Mbit/s, two peers of four sat out a round and re-synced, at 65%
    utilisation instead of 95%."""
    return [p for p in live(records, now, ROUND_STATES) if p.takes_part_in(round_no)]


def attempts(records: Records, round_no: int) -> list[int]:
    """The averaging attempts of `round_no` that training peers announce: peers that failed together retry
    together, at the highest attempt among them."""
    return [p.attempt for p in at_round(records, round_no)]


# ---- progress toward a round ----------------------------------------------------------------------------------
def swarm_progress(records: Records, round_no: int, my_tokens: int, now: float) -> int:
    """Tokens the swarm processed toward the contributions of round `round_no`: `my_tokens` (ours, live) plus the
    other peers' in `records`, each extrapolated from its last announcement at its announced speed while it is
    training (at most EXTRAPOLATE_SECONDS ahead). With overlap, a peer whose contribution of `round_no` is in
    flight counts with the tokens it handed in, and its tokens since count toward the round after.

    Announcements are up to a heartbeat or two old: read as they are, a swarm of fast peers reaches the round's
    tokens in one peer's view seconds before another's, and the first peer then waits that long in matchmaking
    for the last.

    A count is what its peer says: no other peer counts for more than PACE_SPREAD times the lower median of the
    others' counts (where there are two or more others), so one record claiming the whole round's tokens cannot make
    every round due after one inner step (a pair, us and it, cannot out-vote a liar); records dated in the future
    (see live) count for nothing."""
    counts = []
    for p in records:
        if p.state not in TRAINING_STATES or p.updated > now + FUTURE_SECONDS:
            continue
        if p.in_flight_tokens is not None and p.round == round_no:
            counts.append(float(p.in_flight_tokens))
            continue
        if p.counting_round != round_no:
            continue
        count = float(p.tokens_in_round)
        if p.state == "training":  # an averaging peer's tokens are all handed in: nothing to extrapolate
            count += p.tokens_per_s * min(max(now - p.updated, 0.0), EXTRAPOLATE_SECONDS)
        counts.append(count)
    ceiling = PACE_SPREAD * sorted(counts)[(len(counts) - 1) // 2] if len(counts) >= 2 else math.inf
    return my_tokens + int(sum(min(count, ceiling) for count in counts))


def handed_in(records: Records, round_no: int, now: float) -> bool:
    """Whether a live peer already handed in its contribution of `round_no` (it is averaging it, or with overlap
    has it in flight): its view of the swarm reached the round's tokens, so the round is due here too. Without
    this, each peer kept training until its own view (read once a heartbeat) caught up, and rounds without
    overlap carried 10-16% more tokens than the target."""
    return any(p.round == round_no and (p.state == "averaging" or p.in_flight_tokens is not None)
               for p in live(records, now))


def others_still_in(records: Records, round_no: int, now: float, failed: set[str], min_group_size: int,
                    target_group_size: int) -> bool:
    """Whether `round_no` can still be averaged although some group already finished it: the swarm averages in
    several groups (more live peers than a group holds, counting the reader) and enough peers are still at this
    round to form one. A lone straggler of a single-group swarm re-syncs instead. Peers in `failed` (they just
    failed to deliver in this round) do not count: a member SIGKILLed mid-round keeps a fresh-looking record for
    a few seconds, and its partner would wait a whole matchmaking timeout for it instead of re-syncing at once."""
    ahead = [p for p in live(records, now) if p.round >= round_no and p.peer_id not in failed]
    return len(ahead) + 1 > target_group_size and \
        sum(p.takes_part_in(round_no) for p in ahead) + 1 >= max(min_group_size, 2)


# ---- the swarm's state ----------------------------------------------------------------------------------------
def majority_digest(records: Records) -> str:
    """The state digest most of `records` announce, ties going to the smallest so that every reader of the same
    records picks the same; "" when there are no records."""
    counts = Counter(p.digest for p in records)
    return min(counts, key=lambda digest: (-counts[digest], digest), default="")


def reference(records: Records, now: float, quorum: int = 1, anchor: frozenset[str] = frozenset()) -> Reference:
    """The swarm's round, digest and holders among the live training peers that announce a digest: the highest
    round with a digest that at least `quorum` distinct peers announce (see `quorum`), and, given an `anchor` (the
    other members of the last group this peer averaged in, see `anchored`), a majority of the anchor among them; of
    several such digests at a round, the one most announce. So one record claiming a newer round with a state of
    its author's making leads nobody anywhere, and with an anchor, neither do the records of any number of peers
    this peer did not average with, nor of a minority of those it did. A peer whose heartbeat stopped (its record
    lingers until it expires) is not live: it can serve nothing. A client peer (it accepts no streams) vouches for a
    state but is no holder to ask. (0, "", []) when no round has the quorum."""
    announced = [p for p in live(records, now) if p.digest]
    need = len(anchor) // 2 + 1 if anchor else 0
    for round_no in sorted({p.round for p in announced}, reverse=True):
        at_round = [p for p in announced if p.round == round_no]
        counts = Counter(p.digest for p in at_round)
        for digest in sorted(counts, key=lambda d: (-counts[d], d)):
            vouching = [p for p in at_round if p.digest == digest]
            vouchers = {p.peer_id for p in vouching}
            if len(vouchers) >= quorum and len(vouchers & anchor) >= need:
                return Reference(round_no, digest, [p.peer_id for p in vouching if not p.client])
    return Reference(0, "", [])


def anchored(records: Records, now: float, last_group: frozenset[str]) -> frozenset[str]:
    """The anchor `reference` holds a state to: `last_group` (the others of the last group this peer averaged in,
    when that group was the whole swarm), while enough of them are online to make a majority of it; else none
    (they left: the quorum of live peers alone decides, as for a peer that never averaged). Peers that merely
    stopped announcing a state still count, so an attacker among them cannot lift the anchor by going quiet."""
    online_ids = {p.peer_id for p in live(records, now, ONLINE_STATES)}
    return last_group if len(last_group & online_ids) >= len(last_group) // 2 + 1 else frozenset()


def vouchers(records: Records, now: float) -> int:
    """How many distinct live peers announce a state (any round, any digest)."""
    return len({p.peer_id for p in live(records, now) if p.digest})


def quorum(last_group_size: int, vouchers: int) -> int:
    """How many distinct live peers must announce a state before this peer follows it: a majority of the last
    group it averaged in, and at least two, so that no single participant can move the swarm's reference while
    another peer is there to contradict it. The bar is lowered to all but one of the `vouchers` there are (peers
    leave; a liar's own record must not raise it past what the honest peers left can meet), but not below two;
    only a peer that sees a single other peer announce a state follows that one (a swarm of two, e.g. a peer
    restarted without a checkpoint beside its partner): averaging with it would give it as much say anyway."""
    if vouchers <= 1:
        return 1
    return min(max(2, last_group_size // 2 + 1), max(2, vouchers - 1))


def most_announced(records: Records, now: float, quorum: int = 1) -> Reference:
    """For a peer that has not averaged yet, so knows nobody: the state (round and digest) the most distinct live
    peers announce, ties to the lower round, if at least `quorum` do. Colluding peers that announce a newer state
    lead it only if they outnumber the peers of every other state: the highest round with the quorum (two) let two
    of them lead a joiner away from three honest peers."""
    announced = [p for p in live(records, now) if p.digest]
    counts = Counter((p.round, p.digest) for p in announced)
    best = min(counts, key=lambda state: (-counts[state], state), default=None)
    if best is None or counts[best] < quorum:
        return Reference(0, "", [])
    return Reference(best[0], best[1], [p.peer_id for p in announced if (p.round, p.digest) == best and not p.client])


def joiner_reference(records: Records, now: float) -> Reference:
    """The state a peer that averaged with none of `records`' peers follows: the one most of them announce
    (most_announced), with the quorum of a peer that knows nobody (`quorum` of no group)."""
    return most_announced(records, now, quorum(0, vouchers(records, now)))


def kept_reference(records: Records, now: float) -> Reference:
    """The state of a pipeline stage that its keepers vouch for (swarm/peer/pipeline/keeper.py), from their
    `records` (those of the stage before it): the (round, digest) the most live keepers announce as kept, if at
    least the quorum of `quorum` does (two where two or more announce one): joiner_reference of the kept states;
    its holders are the keepers that announce it. (0, "", []) when none has the quorum."""
    return joiner_reference([replace(p, round=p.kept_round, digest=p.kept_digest) for p in records
                             if p.kept_round is not None and p.kept_digest and not p.client], now)


def stage_capacity(records: Records) -> Optional[float]:
    """What a stage's training peers compute when they never wait for another stage (their announced capacity),
    summed; None where one of them has not measured its own yet, or none trains."""
    training = [p for p in records if p.state in TRAINING_STATES]
    if not training or any(p.capacity <= 0 for p in training):
        return None
    return sum(p.capacity for p in training)


def block_throughputs(records: Records, n_blocks: int) -> list[float]:
    """Tokens/s hosted on each block: the sum over online peers of the throughput of each peer hosting it.

    Peers are summed in peer-id order, so the float result does not depend on the order of the records."""
    throughputs = [0.0] * n_blocks
    for peer in sorted(online(records), key=lambda p: p.peer_id):
        for block in range(max(peer.block_start, 0), min(peer.block_end, n_blocks)):
            throughputs[block] += peer.tokens_per_s
    return throughputs


# ---- a summary for operators ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class StageSummary:
    """One stage of a pipelined run (`pipeline.stages` > 1). Its peers average among themselves, so a stage has a
    round and a state digest of its own."""
    stage: int
    block_start: int
    block_end: int
    peers_online: int
    tokens_per_s: float  # summed over its online peers
    round: int  # the highest round of its training peers
    digests_agree: bool
    majority_digest: str
    divergent_peers: int  # training peers at its round whose digest is not its majority's
    bottleneck: bool  # the stage that limits the pipelines (see summarize_stages)
    # Tokens/s its training peers compute when they never wait for another stage, summed (None while one of them
    # has not measured its own): the pace the stage could keep.
    capacity: Optional[float] = None
    # The round of the state that the peers of the stage before keep of it and vouch for (kept_reference), None if
    # none: where the stage goes on from if every host of it leaves.
    backup_round: Optional[int] = None


@dataclass(frozen=True)
class SwarmSummary:
    peers: list[PeerRecord]  # every valid record, offline ones included, sorted by peer id
    invalid_records: int
    by_state: dict[str, int]
    peers_online: int  # peers in a live state (not offline)
    tokens_per_s: float  # compute of the online peers
    round: int
    loss_mean: Optional[float]
    loss_spread: Optional[float]
    digests_agree: bool  # training peers of the top round hold one state digest
    majority_digest: str
    n_blocks: int  # the model's blocks (from the recipe, else the highest block any peer announces)
    block_coverage: list[int]  # online peers hosting each block
    uncovered_blocks: list[int]  # blocks no online peer hosts
    block_tokens_per_s: list[float]  # compute hosted on each block
    read_at: float  # DHT time of the read: a peer was last seen `read_at - updated` seconds before it
    stages: list[StageSummary] = field(default_factory=list)  # empty unless the run is pipelined

    def to_json(self) -> dict:
        out = asdict(self)
        out["peers"] = [{**asdict(p), "last_seen_s": round(max(self.read_at - p.updated, 0.0), 3)}
                        for p in self.peers]
        return out


def summarize(peers: list[PeerRecord], invalid: int, n_blocks: Optional[int] = None,
              read_at: float = 0.0) -> SwarmSummary:
    """Peers by state, compute, losses, digest agreement at the top round and block coverage of every valid
    record read at `read_at` (its heartbeat's age is not judged: the operator sees the records as they are)."""
    up = online(peers)
    top, at_top = top_round([p for p in up if p.state in TRAINING_STATES])
    losses = [p.loss for p in up if p.loss is not None]
    if n_blocks is None:
        n_blocks = max((p.block_end for p in peers), default=0)
    coverage = [sum(p.block_start <= block < p.block_end for p in up) for block in range(n_blocks)]
    return SwarmSummary(
        peers=peers, invalid_records=invalid,
        by_state={state: sum(p.state == state for p in peers) for state in PEER_STATES},
        peers_online=len(up), tokens_per_s=sum(p.tokens_per_s for p in up), round=top,
        loss_mean=statistics.fmean(losses) if losses else None,
        loss_spread=statistics.pstdev(losses) if len(losses) > 1 else (0.0 if losses else None),
        digests_agree=len({p.digest for p in at_top}) <= 1, majority_digest=majority_digest(at_top),
        n_blocks=n_blocks, block_coverage=coverage,
        uncovered_blocks=[block for block, count in enumerate(coverage) if count == 0],
        block_tokens_per_s=block_throughputs(up, n_blocks), read_at=read_at)


def summarize_stages(per_stage: Sequence[list[PeerRecord]], bounds: Sequence[tuple[int, int]], invalid: int,
                     n_blocks: Optional[int] = None, read_at: float = 0.0) -> SwarmSummary:
    """The summary of a pipelined run from each stage's records (read under its own run id), `bounds` the stages'
    block ranges. Each stage gets its round and digest agreement; the whole run's round is the lowest stage's
    (the round every stage has reached), its digests agree when every stage's do, its tokens/s are the first
    stage's (the tokens the pipelines train: each passes every stage) and its divergent peers are the stages'.
    Every token passes every stage, so the stage with the least hardware sets the pace: the bottleneck is the
    stage with the least capacity where every stage has measured its own, else the one with the fewest online
    peers, the least tokens/s among those (a stage nobody hosts stops the pipelines)."""
    stages = []
    for k, (records, (start, end)) in enumerate(zip(per_stage, bounds)):
        part = summarize(records, 0, n_blocks, read_at)
        kept = kept_reference(per_stage[k - 1], read_at)  # (by the stage before's peers; the first's by the last's)
        stages.append(StageSummary(
            stage=k, block_start=start, block_end=end, peers_online=part.peers_online,
            tokens_per_s=part.tokens_per_s, round=part.round, digests_agree=part.digests_agree,
            majority_digest=part.majority_digest,
            divergent_peers=sum(p.digest != part.majority_digest for p in at_round(online(records), part.round)),
            bottleneck=False, capacity=stage_capacity(online(records)),
            backup_round=kept.round if kept.holders else None))
    if stages:
        measured = all(s.capacity for s in stages)
        slowest = min(stages, key=lambda s: (s.capacity, s.stage) if measured else
                      (s.peers_online, s.tokens_per_s, s.stage))
        stages[slowest.stage] = replace(slowest, bottleneck=True)
    whole = summarize(sorted((p for records in per_stage for p in records), key=lambda p: p.peer_id), invalid,
                      n_blocks, read_at)
    return replace(whole, stages=stages, round=min((s.round for s in stages), default=0),
                   digests_agree=all(s.digests_agree for s in stages), majority_digest="",
                   tokens_per_s=stages[0].tokens_per_s if stages else 0.0)
