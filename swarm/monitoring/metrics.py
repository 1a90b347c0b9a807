"""Prometheus metrics of one peer, in a registry of its own, served over HTTP on --metrics-port.

Names share the `swarm_` prefix and carry their unit; labels stay low-cardinality (no per-step or per-tensor)."""

from __future__ import annotations

import logging
from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

logger = logging.getLogger(__name__)


class PeerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.outer_round = Gauge("swarm_outer_round", "Outer round this peer is in", registry=r)
        self.inner_steps = Counter("swarm_inner_steps_total", "Inner optimizer steps", registry=r)
        self.tokens = Counter("swarm_tokens_total", "Training tokens processed by this peer", registry=r)
        self.tokens_per_second = Gauge("swarm_tokens_per_second", "Recent training throughput", registry=r)
        self.train_loss = Gauge("swarm_train_loss", "Last inner-step training loss", registry=r)
        self.val_loss = Gauge("swarm_val_loss", "Last validation loss of the global params", registry=r)
        self.allreduce_seconds = Histogram("swarm_allreduce_seconds", "Duration of successful all-reduces",
                                           buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300), registry=r)
        self.round_seconds = Gauge("swarm_round_duration_seconds", "Wall time of the last outer round", registry=r)
        self.group_size = Gauge("swarm_group_size", "Peers in the last averaging group", registry=r)
        self.bytes_sent = Counter("swarm_allreduce_bytes_sent_total", "All-reduce payload bytes sent", registry=r)
        self.bytes_received = Counter("swarm_allreduce_bytes_received_total", "All-reduce payload bytes received",
                                      registry=r)
        self.averaging_failures = Counter("swarm_averaging_failures_total", "Rounds not averaged, by reason",
                                          ["reason"], registry=r)
        self.resyncs = Counter("swarm_resyncs_total", "State downloads from other peers", registry=r)
        self.bad_peers = Counter("swarm_bad_peer_messages_total", "Invalid contributions from peers, by reason",
                                 ["reason"], registry=r)
        self.invalid_records = Counter("swarm_invalid_records_total", "Malformed DHT records seen", registry=r)
        self.checkpoint_round = Gauge("swarm_checkpoint_round", "Round of the newest checkpoint written",
                                      registry=r)
        self.state = Gauge("swarm_peer_state", "1 for the state this peer is in", ["state"], registry=r)

    def set_state(self, state: str) -> None:
        from swarm.dht.records import PEER_STATES

        for name in PEER_STATES:
            self.state.labels(state=name).set(1 if name == state else 0)

    def serve(self, port: Optional[int], host: str = "127.0.0.1") -> Optional[int]:
        """Start the /metrics HTTP server; returns the bound port (port 0 picks a free one)."""
        if port is None:
            return None
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        return server.server_address[1]
