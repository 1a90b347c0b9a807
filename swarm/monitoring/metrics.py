"""Prometheus metrics of one peer (PeerMetrics) and the swarm-wide gauges the bootstrap adds to SwarmExporter's
(SwarmGauges), each in a registry of its own. Names share the `swarm_` prefix and carry their unit; labels stay
low-cardinality (no per-step, per-tensor or per-peer labels; `block` is bounded by the model's block count)."""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, ProcessCollector, start_http_server
from prometheus_client.core import GaugeMetricFamily

from swarm.dht.process import DHT_PROCESS_MAIN

if TYPE_CHECKING:  # imported for annotations only: this module must stay importable without torch
    import torch

    from swarm.dht.view import SwarmSummary

logger = logging.getLogger(__name__)
FP32_BYTES = 4  # pseudo-gradients are fp32 before any codec touches them
PROCESS_ROLES = ("main", "dht", "p2pd", "other")  # the processes of a peer or bootstrap, as the memory gauges name them


class PeerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)  # process_start_time_seconds, CPU, RSS: alerts tell new peers from stuck ones
        ProcessTreeMemory(r)
        self.info = Info("swarm_peer", "Version, device type and codec of this peer", registry=r)
        self.outer_round = Gauge("swarm_outer_round", "Outer round this peer is in", registry=r)
        self.inner_steps = Counter("swarm_inner_steps_total", "Inner optimizer steps", registry=r)
        self.tokens = Counter("swarm_tokens_total", "Training tokens processed by this peer", registry=r)
        self.tokens_per_second = Gauge("swarm_tokens_per_second", "Recent training throughput", registry=r)
        self.compute_utilization = Gauge("swarm_compute_utilization_ratio",
                                         "Time in inner steps / wall time since training started", registry=r)
        self.train_loss = Gauge("swarm_train_loss", "Last inner-step training loss (NaN before the first)",
                                registry=r)
        self.val_loss = Gauge("swarm_val_loss", "Last validation loss of the global params (NaN before "
                              "the first)", registry=r)
        self.train_loss.set(math.nan)  # NaN, not 0, until measured: a loss of 0 would look like a real value
        self.val_loss.set(math.nan)
        self.allreduce_seconds = Histogram("swarm_allreduce_seconds", "Duration of successful all-reduces",
                                           buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300), registry=r)
        self.round_seconds = Gauge("swarm_round_duration_seconds", "Wall time of the last outer round", registry=r)
        self.round_phase_seconds = Gauge(
            "swarm_round_phase_seconds", "Seconds the last outer round spent in each phase besides computing "
            "(prepare, announce, matchmaking, allreduce, verification, outer_step, validation, digest, checkpoint)",
            ["phase"], registry=r)
        self.round_compute_seconds = Gauge("swarm_round_compute_seconds",
                                           "Seconds the last outer round spent in inner steps", registry=r)
        self.group_size = Gauge("swarm_group_size", "Peers in the last averaging group", registry=r)
        self.bytes_sent = Counter("swarm_allreduce_bytes_sent_total", "All-reduce payload bytes sent (on the wire, "
                                  "after compression)", registry=r)
        self.bytes_received = Counter("swarm_allreduce_bytes_received_total", "All-reduce payload bytes received "
                                      "(on the wire, after compression)", registry=r)
        self.uncompressed_sent = Counter(
            "swarm_allreduce_uncompressed_bytes_sent_total",
            "fp32 size of the all-reduce values sent, before compression (estimated from the codec's wire size)",
            registry=r)
        self.uncompressed_received = Counter(
            "swarm_allreduce_uncompressed_bytes_received_total",
            "fp32 size of the all-reduce values received, before compression (estimated from the codec's wire "
            "size)", registry=r)
        self.compression_ratio = Gauge("swarm_compression_ratio", "fp32 bytes per wire byte in the last all-reduce "
                                       "(1 without compression)", registry=r)
        self.last_average = Gauge("swarm_last_average_timestamp_seconds", "Unix time of the last successful "
                                  "averaging round (0: none yet)", registry=r)
        self.averaging_failures = Counter("swarm_averaging_failures_total", "Rounds not averaged, by reason",
                                          ["reason"], registry=r)
        self.resyncs = Counter("swarm_resyncs_total", "Catch-ups to the swarm's state, by how: replaying the outer "
                               "steps missed, or downloading the whole state", ["how"], registry=r)
        self.resync_bytes = Counter("swarm_resync_bytes_total", "Bytes of the outer steps replayed or the state "
                                    "downloaded to catch up to the swarm's state (failed tries not counted), by how",
                                    ["how"], registry=r)
        for how in ("replay", "download"):  # both series exist from the start, at 0
            self.resyncs.labels(how=how)
            self.resync_bytes.labels(how=how)
        self.mixing_rounds = Counter("swarm_mixing_rounds_total", "Rounds whose group also averaged global params "
                                     "and outer momentum (members came from groups that had diverged)", registry=r)
        self.round_peers = Gauge("swarm_round_peers", "Peers the last round's groups were formed from (above the "
                                 "target group size they average in several groups)", registry=r)
        self.bad_peers = Counter("swarm_bad_peer_messages_total", "Invalid contributions from peers, by reason",
                                 ["reason"], registry=r)
        self.invalid_records = Counter("swarm_invalid_records_total", "Malformed DHT records seen", registry=r)
        self.checkpoint_round = Gauge("swarm_checkpoint_round", "Round of the newest checkpoint written",
                                      registry=r)
        self._checkpoint_time: Optional[float] = None
        self.checkpoint_age = Gauge("swarm_checkpoint_age_seconds", "Seconds since this peer wrote its last "
                                    "checkpoint (NaN before the first)", registry=r)
        self.checkpoint_age.set_function(
            lambda: math.nan if self._checkpoint_time is None else time.time() - self._checkpoint_time)
        self.state = Gauge("swarm_peer_state", "1 for the state this peer is in", ["state"], registry=r)
        self.hosted_blocks = Gauge("swarm_hosted_blocks", "Model blocks this peer hosts", registry=r)
        self.block_start = Gauge("swarm_hosted_block_start", "First block this peer hosts", registry=r)
        self.block_end = Gauge("swarm_hosted_block_end", "End (exclusive) of the blocks this peer hosts",
                               registry=r)
        self.data_shard = Gauge("swarm_data_shard", "Data shard this peer reads now (NaN before it chose where "
                                "to start)", registry=r)
        self.data_shard.set(math.nan)
        self.data_fetched = Counter("swarm_data_fetched_bytes_total", "Bytes of the run's dataset files fetched from "
                                    "other peers (verified or not)", registry=r)
        self.data_refused = Counter("swarm_data_refused_files_total", "Dataset files a holder sent wrong bytes for "
                                    "(the holder is not asked again)", registry=r)
        self.data_files_held = Gauge("swarm_data_files_held", "Files of the run's dataset this peer holds (and "
                                     "serves)", registry=r)
        self.data_files_total = Gauge("swarm_data_files", "Files in the run's dataset (0: the run shares none, each "
                                      "peer reads the recipe's data.source)", registry=r)
        self.data_served = Gauge("swarm_data_served_bytes", "Bytes of dataset files this peer served to others",
                                 registry=r)
        self.memory_used = Gauge("swarm_device_memory_used_bytes", "Memory in use on the training device: "
                                 "allocated tensors on a GPU, resident set of the process on a CPU", registry=r)
        self.memory_total = Gauge("swarm_device_memory_total_bytes", "Memory of the training device (system "
                                  "memory for a CPU peer)", registry=r)
        self.streams_opened = Gauge("swarm_streams_opened", "Streams this peer opened since it started, by "
                                    "transport: direct (TLS between the peers) or libp2p (through the daemons: the "
                                    "other peer cannot be reached directly)", ["transport"], registry=r)
        self.pipeline_bytes = Gauge("swarm_pipeline_bytes", "Activation and gradient bytes on this stage peer's hops "
                                    "(to the next stage and from the one before, token ids included) since it "
                                    "started, by direction: sent or received; over swarm_tokens_total, bytes a "
                                    "token", ["direction"], registry=r)
        self.memory_used.set_function(process_resident_bytes)
        self.memory_total.set(system_memory_bytes())
        self.last_group_size: Optional[int] = None  # for the progress line

    def set_state(self, state: str) -> None:
        from swarm.dht.records import PEER_STATES

        for name in PEER_STATES:
            self.state.labels(state=name).set(1 if name == state else 0)

    def describe(self, version: str, device: "torch.device", codec: str) -> None:
        """Static facts of this peer, and where its memory is read from (on scrape, so it is always current)."""
        self.info.info({"version": version, "device": device.type, "codec": codec})
        if device.type == "cuda":
            import torch

            index = device.index if device.index is not None else torch.cuda.current_device()
            self.memory_used.set_function(lambda: float(torch.cuda.memory_allocated(index)))
            self.memory_total.set(torch.cuda.get_device_properties(index).total_memory)

    def watch_streams(self, opened: dict[str, int]) -> None:
        """Read the streams opened by transport from `opened` ({"direct": n, "fallback": m}) on every scrape."""
        for transport, key in (("direct", "direct"), ("libp2p", "fallback")):
            self.streams_opened.labels(transport=transport).set_function(lambda key=key: float(opened[key]))

    def watch_pipeline(self, wire: Callable[[], tuple[int, int]]) -> None:
        """Read a stage peer's hop bytes, (sent, received), from `wire` on every scrape."""
        for index, direction in enumerate(("sent", "received")):
            self.pipeline_bytes.labels(direction=direction).set_function(lambda index=index: float(wire()[index]))

    def set_blocks(self, block_start: int, block_end: int) -> None:
        self.hosted_blocks.set(block_end - block_start)
        self.block_start.set(block_start)
        self.block_end.set(block_end)

    def record_allreduce(self, bytes_sent: int, bytes_received: int, seconds: float, group_size: int,
                         wire_bytes_per_param: float) -> None:
        """Account one successful all-reduce. `wire_bytes_per_param` is the codec's expected wire size per
        element of a part (Codec.bytes_per_param): fp32 bytes = wire bytes * 4 / it."""
        ratio = FP32_BYTES / wire_bytes_per_param
        self.allreduce_seconds.observe(seconds)
        self.group_size.set(group_size)
        self.bytes_sent.inc(bytes_sent)
        self.bytes_received.inc(bytes_received)
        self.uncompressed_sent.inc(bytes_sent * ratio)
        self.uncompressed_received.inc(bytes_received * ratio)
        self.compression_ratio.set(ratio)
        self.last_average.set(time.time())
        self.last_group_size = group_size

    def checkpoint_written(self, round_no: int) -> None:
        self.checkpoint_round.set(round_no)
        self._checkpoint_time = time.time()

    def serve(self, port: Optional[int], host: str = "127.0.0.1") -> Optional[int]:
        """Start the /metrics HTTP server; returns the bound port (port 0 picks a free one)."""
        if port is None:
            return None
        self._server, _ = start_http_server(port, addr=host, registry=self.registry)
        return self._server.server_address[1]

    def close(self) -> None:
        """Stop the /metrics server, freeing its port (a peer that joins again in this process binds it anew)."""
        server, self._server = getattr(self, "_server", None), None
        if server is not None:
            server.shutdown()
            server.server_close()


def process_resident_bytes() -> float:
    """Resident set size of this process in bytes (Linux /proc; peak RSS elsewhere)."""
    try:
        with open("/proc/self/statm") as statm:
            return float(int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"))
    except (OSError, ValueError, IndexError):
        import resource  # not on Windows, where /proc is missing too

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return float(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB on Linux


class ProcessTreeMemory:
    """Resident memory of this process and of every process below it (the DHT process, p2pd, anything else), read
    from /proc at each scrape: `swarm_process_tree_resident_bytes`, and `swarm_process_resident_bytes` by role."""

    def __init__(self, registry: CollectorRegistry, root_pid: Optional[int] = None):
        self.root_pid = os.getpid() if root_pid is None else root_pid
        registry.register(self)

    def collect(self) -> list[GaugeMetricFamily]:
        by_role = tree_resident_bytes(self.root_pid)
        total = GaugeMetricFamily("swarm_process_tree_resident_bytes", "Resident memory of this peer's (or "
                                  "bootstrap's) processes together: main, DHT process, p2pd, any other child (pages "
                                  "they share count once per process)", value=sum(by_role.values()))
        each = GaugeMetricFamily("swarm_process_resident_bytes", "Resident memory of this peer's (or bootstrap's) "
                                 "processes, by process: main, dht (the DHT process), p2pd (libp2p daemon), other "
                                 "(all others)", labels=["process"])
        for role in PROCESS_ROLES:
            each.add_metric([role], by_role[role])
        return [total, each]


def tree_resident_bytes(root_pid: int) -> dict[str, float]:
    """Resident bytes of `root_pid`'s process tree, summed by role (PROCESS_ROLES). Without /proc (macOS), the
    root's own resident set under "main" and 0 for the rest."""
    by_role = dict.fromkeys(PROCESS_ROLES, 0.0)
    if not os.path.isdir("/proc"):
        by_role["main"] = process_resident_bytes()
        return by_role
    page = os.sysconf("SC_PAGE_SIZE")
    for pid in process_tree(root_pid):
        try:
            with open(f"/proc/{pid}/statm") as statm:
                by_role[process_role(pid, root_pid)] += int(statm.read().split()[1]) * page
        except (OSError, ValueError, IndexError):
            continue  # it exited meanwhile
    return by_role


def process_tree(root_pid: int) -> list[int]:
    """`root_pid` and every live process below it, from /proc (parents before their children)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    state, ppid = f.read().rsplit(b")", 1)[1].split()[:2]
            except (OSError, ValueError):
                continue
            if state not in (b"Z", b"X"):
                children.setdefault(int(ppid), []).append(int(entry))
    tree, index = [root_pid], 0
    while index < len(tree):
        tree += children.get(tree[index], [])
        index += 1
    return tree


def process_role(pid: int, root_pid: int) -> str:
    """What `pid` is in `root_pid`'s tree: main (the root), dht (our DHT process), p2pd, or other."""
    if pid == root_pid:
        return "main"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return "other"
    if os.path.basename(argv[0]).startswith(b"p2pd"):
        return "p2pd"
    return "dht" if DHT_PROCESS_MAIN.encode() in argv else "other"


def system_memory_bytes() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (OSError, ValueError, AttributeError):
        return math.nan


class SwarmGauges:
    """The bootstrap's swarm-wide gauges beyond SwarmExporter's: per-block coverage, online peers, loss spread
    and the age of the current round. Registered beside SwarmExporter in the bootstrap's registry."""

    def __init__(self, registry: CollectorRegistry):
        self.block_replicas = Gauge("swarm_swarm_block_replicas", "Online peers hosting each block", ["block"],
                                    registry=registry)
        self.block_tokens_per_s = Gauge("swarm_swarm_block_tokens_per_second", "Throughput of the online peers "
                                        "hosting each block", ["block"], registry=registry)
        self.blocks = Gauge("swarm_swarm_blocks", "Blocks of the run's model", registry=registry)
        self.peers_online = Gauge("swarm_swarm_peers_online", "Peers in a live state (not offline)",
                                  registry=registry)
        self.loss_spread = Gauge("swarm_swarm_loss_spread", "Standard deviation of live peers' last training loss "
                                 "(NaN when no peer reports one)", registry=registry)
        self.val_loss = Gauge("swarm_swarm_val_loss_mean", "Mean validation loss reported by training peers of "
                              "the current round (NaN when none reports one)", registry=registry)
        self.sharing_data = Gauge("swarm_swarm_peers_sharing_a_data_shard", "Online peers that read a data shard "
                                  "another online peer reads now (they train on the same windows)", registry=registry)
        self.round_started = Gauge("swarm_swarm_round_start_timestamp_seconds", "Unix time at which the bootstrap "
                                   "first saw the current round", registry=registry)
        self._labelled_blocks = 0
        self._round: Optional[int] = None

    def update(self, summary: "SwarmSummary", now: Optional[float] = None) -> None:
        from swarm.dht.view import at_round, online  # here, not above: see TYPE_CHECKING

        now = time.time() if now is None else now
        for block, (replicas, tokens_per_s) in enumerate(zip(summary.block_coverage, summary.block_tokens_per_s)):
            self.block_replicas.labels(block=str(block)).set(replicas)
            self.block_tokens_per_s.labels(block=str(block)).set(tokens_per_s)
        for block in range(summary.n_blocks, self._labelled_blocks):  # the model shrank: drop stale series
            self.block_replicas.remove(str(block))
            self.block_tokens_per_s.remove(str(block))
        self._labelled_blocks = summary.n_blocks
        self.blocks.set(summary.n_blocks)
        self.peers_online.set(summary.peers_online)
        readers: dict[int, int] = {}  # data shard -> online peers reading it
        for p in online(summary.peers):
            if p.data_shard is not None:
                readers[p.data_shard] = readers.get(p.data_shard, 0) + 1
        self.sharing_data.set(sum(n for n in readers.values() if n > 1))
        self.loss_spread.set(math.nan if summary.loss_spread is None else summary.loss_spread)
        val_losses = [p.val_loss for p in at_round(summary.peers, summary.round) if p.val_loss is not None]
        self.val_loss.set(sum(val_losses) / len(val_losses) if val_losses else math.nan)
        if summary.round != self._round:
            self._round = summary.round
            self.round_started.set(now)
