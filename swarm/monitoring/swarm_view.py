"""The swarm as the DHT shows it: read every peer's announcement of a run and summarise it for the bootstrap's
metrics and for `swarm-peer status`."""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Optional

from prometheus_client import CollectorRegistry, Gauge

from swarm.dht.node import SwarmNode
from swarm.dht.records import PEER_STATES, PeerRecord, parse_peer_records, peers_key


@dataclass
class SwarmSummary:
    peers: list[PeerRecord]
    invalid_records: int
    by_state: dict[str, int]
    tokens_per_s: float
    round: int
    loss_mean: Optional[float]
    loss_spread: Optional[float]
    digests_agree: bool
    majority_digest: str

    def to_json(self) -> dict:
        out = asdict(self)
        out["peers"] = [asdict(p) for p in self.peers]
        return out


def summarize(peers: list[PeerRecord], invalid: int) -> SwarmSummary:
    live = [p for p in peers if p.state != "offline"]
    training = [p for p in live if p.state in ("training", "averaging")]
    top = max((p.round for p in training), default=0)
    at_top = [p for p in training if p.round == top]
    digests = Counter(p.digest for p in at_top)
    losses = [p.loss for p in live if p.loss is not None]
    return SwarmSummary(
        peers=peers, invalid_records=invalid,
        by_state={state: sum(p.state == state for p in peers) for state in PEER_STATES},
        tokens_per_s=sum(p.tokens_per_s for p in live), round=top,
        loss_mean=statistics.fmean(losses) if losses else None,
        loss_spread=statistics.pstdev(losses) if len(losses) > 1 else (0.0 if losses else None),
        digests_agree=len(digests) <= 1,
        majority_digest=min(digests, key=lambda d: (-digests[d], d)) if digests else "")


async def read_swarm(node: SwarmNode, run_id: str) -> SwarmSummary:
    peers, invalid = parse_peer_records(await node.get(peers_key(run_id)))
    return summarize(peers, invalid)


class SwarmExporter:
    """Gauges of the whole swarm, for the bootstrap's /metrics: one scrape target shows everything."""

    def __init__(self, registry: CollectorRegistry):
        self.peers = Gauge("swarm_peers", "Peers announced in the DHT, by state", ["state"], registry=registry)
        self.tokens_per_s = Gauge("swarm_swarm_tokens_per_second", "Sum of live peers' throughput",
                                  registry=registry)
        self.round = Gauge("swarm_swarm_round", "Highest outer round of training peers", registry=registry)
        self.loss = Gauge("swarm_swarm_loss_mean", "Mean of live peers' last training loss", registry=registry)
        self.divergent = Gauge("swarm_swarm_divergent_peers", "Training peers whose params digest is not the "
                               "majority's", registry=registry)
        self.invalid = Gauge("swarm_swarm_invalid_records", "Malformed peer records in the last read",
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
