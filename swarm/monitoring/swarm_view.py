"""The swarm as the DHT shows it: read every peer's announcement of a run and summarise it (peers by state,
compute, block coverage, params agreement) for the bootstrap's metrics and for `swarm-peer status`."""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Optional

from prometheus_client import CollectorRegistry, Gauge

from swarm.config import Recipe
from swarm.dht.node import SwarmNode
from swarm.dht.records import PEER_STATES, PeerRecord, parse_peer_records, peers_key
from swarm.peer.block_selection import block_throughputs

LIVE_STATES = ("joining", "syncing", "training", "averaging")


@dataclass
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

    def to_json(self) -> dict:
        out = asdict(self)
        out["peers"] = [{**asdict(p), "last_seen_s": round(max(self.read_at - p.updated, 0.0), 3)}
                        for p in self.peers]
        return out


def recipe_blocks(recipe: Recipe) -> Optional[int]:
    """How many blocks the recipe's model has, when the recipe says it without its config file."""
    return recipe.model.num_layers if recipe.model.config_file is None else None


def summarize(peers: list[PeerRecord], invalid: int, n_blocks: Optional[int] = None,
              read_at: float = 0.0) -> SwarmSummary:
    live = [p for p in peers if p.state in LIVE_STATES]
    training = [p for p in live if p.state in ("training", "averaging")]
    top = max((p.round for p in training), default=0)
    at_top = [p for p in training if p.round == top]
    digests = Counter(p.digest for p in at_top)
    losses = [p.loss for p in live if p.loss is not None]
    if n_blocks is None:
        n_blocks = max((p.block_end for p in peers), default=0)
    coverage = [sum(p.block_start <= block < p.block_end for p in live) for block in range(n_blocks)]
    return SwarmSummary(
        peers=peers, invalid_records=invalid,
        by_state={state: sum(p.state == state for p in peers) for state in PEER_STATES},
        peers_online=len(live), tokens_per_s=sum(p.tokens_per_s for p in live), round=top,
        loss_mean=statistics.fmean(losses) if losses else None,
        loss_spread=statistics.pstdev(losses) if len(losses) > 1 else (0.0 if losses else None),
        digests_agree=len(digests) <= 1,
        majority_digest=min(digests, key=lambda d: (-digests[d], d)) if digests else "",
        n_blocks=n_blocks, block_coverage=coverage,
        uncovered_blocks=[block for block, count in enumerate(coverage) if count == 0],
        block_tokens_per_s=block_throughputs(live, n_blocks), read_at=read_at)


async def read_swarm(node: SwarmNode, run_id: str, n_blocks: Optional[int] = None) -> SwarmSummary:
    """The run's announcements, validated (records with blocks outside `n_blocks` are rejected) and summarised."""
    read_at = node.now()
    peers, invalid = parse_peer_records(await node.get(peers_key(run_id)), n_blocks)
    return summarize(peers, invalid, n_blocks, read_at)


class SwarmExporter:
    """Gauges of the whole swarm, for the bootstrap's /metrics: one scrape target shows everything."""

    def __init__(self, registry: CollectorRegistry):
        self.peers = Gauge("swarm_peers", "Peers announced in the DHT, by state", ["state"], registry=registry)
        self.tokens_per_s = Gauge("swarm_swarm_tokens_per_second", "Sum of live peers' throughput",
                                  registry=registry)
        self.round = Gauge("swarm_swarm_round", "Highest outer round of training peers", registry=registry)
        self.loss = Gauge("swarm_swarm_loss_mean", "Mean of live peers' last training loss", registry=registry)
        self.divergent = Gauge("swarm_swarm_divergent_peers", "Training peers whose state digest is not the "
                               "majority's", registry=registry)
        self.invalid = Gauge("swarm_swarm_invalid_records", "Malformed peer records in the last read",
                             registry=registry)
        self.uncovered = Gauge("swarm_swarm_uncovered_blocks", "Model blocks no online peer hosts",
                               registry=registry)

    def update(self, summary: SwarmSummary) -> None:
        for state, count in summary.by_state.items():
            self.peers.labels(state=state).set(count)
        self.tokens_per_s.set(summary.tokens_per_s)
        self.round.set(summary.round)
        if summary.loss_mean is not None:
            self.loss.set(summary.loss_mean)
        self.divergent.set(sum(1 for p in summary.peers if p.state in ("training", "averaging")
                               and p.round == summary.round and p.digest != summary.majority_digest))
        self.invalid.set(summary.invalid_records)
        self.uncovered.set(len(summary.uncovered_blocks))


def coverage_runs(coverage: list[int]) -> list[tuple[int, int, int]]:
    """Runs of equal coverage as (start, end, peers): [3, 3, 0] -> [(0, 2, 3), (2, 3, 0)]."""
    runs: list[tuple[int, int, int]] = []
    for block, count in enumerate(coverage):
        if runs and runs[-1][2] == count:
            runs[-1] = (runs[-1][0], block + 1, count)
        else:
            runs.append((block, block + 1, count))
    return runs


def render_status(summary: SwarmSummary, run_id: str, recipe_digest: str) -> str:
    """The human-readable `swarm-peer status`: totals, then one line per peer."""
    s = summary
    states = ", ".join(f"{state} {count}" for state, count in s.by_state.items() if count and state != "offline")
    lines = [f"run {run_id} (recipe {recipe_digest[:12]}), round {s.round}: {s.peers_online} "
             f"peer{'' if s.peers_online == 1 else 's'} online"
             + (f" ({states})" if states else "") + f", {s.by_state.get('offline', 0)} offline"
             + (f", {s.invalid_records} invalid records" if s.invalid_records else "")]
    lines.append(f"compute: {s.tokens_per_s:.0f} tokens/s; state digests: "
                 + ("none yet" if not s.majority_digest else
                    f"agree ({s.majority_digest})" if s.digests_agree else f"DIFFER (majority {s.majority_digest})"))
    coverage = ", ".join(f"[{start}, {end}) {count}" for start, end, count in coverage_runs(s.block_coverage))
    nobody = ", ".join(map(str, s.uncovered_blocks)) if s.uncovered_blocks else "none"
    lines.append(f"blocks: {s.n_blocks}; peers per block: {coverage or '-'}; hosted by nobody: {nobody}")
    lines.append(f"{'peer':<14}{'state':<11}{'blocks':<9}{'device':<26}{'tok/s':>9}{'up MB/s':>9}{'down MB/s':>10}"
                 f"{'round':>7}{'shard':>6}{'loss':>8}{'seen':>7}")
    for p in s.peers:
        loss = f"{p.loss:.3f}" if p.loss is not None else "-"
        shard = "-" if p.data_shard is None else str(p.data_shard)
        memory = f"{p.device_memory / 2 ** 30:.0f}GiB" if p.device_memory else ""
        device = " ".join(part for part in (p.device, memory, p.device_name) if part)  # the name may be cut
        lines.append(f"{p.peer_id[-12:]:<14}{p.state:<11}{f'{p.block_start}-{p.block_end}':<9}{device[:25]:<26}"
                     f"{p.tokens_per_s:>9.0f}{p.bandwidth_up / 1e6:>9.1f}{p.bandwidth_down / 1e6:>10.1f}"
                     f"{p.round:>7}{shard:>6}{loss:>8}{max(s.read_at - p.updated, 0):>6.0f}s")
    return "\n".join(lines)
