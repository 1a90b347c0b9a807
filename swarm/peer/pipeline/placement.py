"""Where a stage peer goes, as pure functions of what it reads of the stages (Petals' `block_selection.py` is the
model): the stage a joining peer hosts (`weakest_stage`) and the stage an unpinned peer moves to when the stages
are out of balance (`stage_to_move_to`; `move_decision` adds when, and why). Every peer with the same readings
computes the same answer. What a peer can hold comes from its settings and device (`memory_limits`); whether the
stage before finished a round, from the rounds its peers announce (`upstream_finished`).
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import torch

from swarm.dht import view
from swarm.dht.records import PeerRecord
from swarm.peer.stream import peer_id_hash
from swarm.settings import PeerSettings


def memory_limits(settings: PeerSettings) -> tuple[Optional[int], Optional[int]]:
    """(the memory --max-memory allows, which a peer must keep to; the memory that guides the choice of a stage:
    that limit, else a GPU's total memory, else None: any stage)."""
    if settings.max_memory is not None:
        return int(settings.max_memory * 1e6), int(settings.max_memory * 1e6)
    if settings.device != "cpu" and torch.cuda.is_available():
        return None, torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return None, None


def weakest_stage(live_peers: Mapping[int, int], peer_hash: int) -> int:
    """Of the stages a joining peer can hold (the keys of `live_peers`, each with its live peers now), the one with
    the fewest live peers; ties go to the tied stage `peer_hash` (a hash of the peer's id) picks, so peers that
    join together spread over the tied stages. Raises ValueError for no candidate."""
    if not live_peers:
        raise ValueError("no stage to choose from")
    fewest = sorted(k for k, n in live_peers.items() if n == min(live_peers.values()))
    return fewest[peer_hash % len(fewest)]


# A move must make the pipelines at least this much faster (their pace is their slowest stage's): moving costs the
# mover its progress since its stage's last average and a state download, so small gains are not worth it (Petals'
# should_choose_other_blocks asks the same of a swarm's throughput, with a balance quality of 0.75).
MOVE_GAIN = 1.25


def stage_to_move_to(counts: Sequence[int], capacities: Sequence[Optional[float]], mine: int, my_capacity: float,
                     costs: Sequence[float], fits: Sequence[int], gain: float = MOVE_GAIN) -> tuple[Optional[int], str]:
    """Where a peer of stage `mine` should move, and why ("peers" or "throughput"), or (None, ""). A pure function of
    the stages' live peer `counts` and summed `capacities` (tokens/s each stage computes when it never waits; None
    where some peer has not measured its own), both counting us; `my_capacity` is ours, `costs` each stage's work
    per token (its parameters but the input embedding's), `fits` the stages we can hold.

    Peers first: to the stage with the fewest peers, if ours has at least two more (so ours stays at least as
    strong). Then throughput: every token passes every stage, so the pipelines run at the pace of the stage with
    the least capacity; we move to the stage that lifts that pace the most, if by at least `gain`, counting what
    we would compute there as our capacity scaled by the two stages' costs. We never leave a stage we are alone
    in."""
    others = [k for k in fits if k != mine]
    weakest = min(others, key=lambda k: (counts[k], k), default=None)
    if weakest is not None and counts[mine] >= counts[weakest] + 2:
        return weakest, "peers"
    if counts[mine] < 2 or my_capacity <= 0 or any(c is None or c <= 0 for c in capacities):
        return None, ""
    best, best_pace = None, gain * min(capacities)
    for k in others:
        after = list(capacities)
        after[mine] -= my_capacity
        after[k] += my_capacity * costs[mine] / costs[k]
        if min(after) > best_pace:
            best, best_pace = k, min(after)
    return best, "throughput" if best is not None else ""


def move_decision(hosts: Sequence[Sequence[PeerRecord]], mine: int, me: str, my_capacity: float,
                  costs: Sequence[float], fits: Sequence[int], settled: bool,
                  rebalance_seconds: float) -> tuple[Optional[int], str, float]:
    """The stage peer `me` of stage `mine` should move to (stage_to_move_to: a stage with two fewer live peers than
    ours, or, once `settled`, the pipelines' throughput bottleneck), why (for the log), and how long it must stay so
    before it moves: its stage's peers take turns, `rebalance_seconds` for the first in the order of their ids'
    hash, one more period for each after it, so that one moves and the others see the stages change. `hosts`: each
    stage's live peers as announced; `my_capacity`: ours, read live."""
    ours = [p for p in hosts[mine] if p.peer_id != me]
    counts = [len(stage) for stage in hosts]
    counts[mine] = len(ours) + 1
    capacities = [view.stage_capacity(stage) for stage in hosts]
    others = view.stage_capacity(ours) if ours else 0.0
    capacities[mine] = None if others is None or my_capacity <= 0 else others + my_capacity
    target, why = stage_to_move_to(counts, capacities if settled else [None] * len(hosts), mine, my_capacity, costs,
                                   fits)
    if target is None:
        return None, "", 0.0
    why = f"stage {target} has {counts[target]} live peers and ours {counts[mine]}" if why == "peers" else \
        f"the pipelines run at the pace of stage {min(range(len(hosts)), key=lambda k: capacities[k])}, which " \
        f"computes {min(capacities):.0f} tokens/s (stage {target}: {capacities[target]:.0f}, ours " \
        f"{capacities[mine]:.0f})"
    turn = sorted([peer_id_hash(p.peer_id) for p in ours] + [peer_id_hash(me)]).index(peer_id_hash(me))
    return target, why, rebalance_seconds * (1 + turn)


def upstream_finished(announced: list[int], round_no: int) -> bool:
    """Whether the stage before finished `round_no`, from the rounds its peers announce: most of those that took
    part in it (announce it or later) announce the next. One peer's word, which could be a lie, ends no round."""
    rounds = [r for r in announced if r >= round_no]
    return 2 * sum(r == round_no + 1 for r in rounds) > len(rounds)
