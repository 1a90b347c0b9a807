"""The swarm for its operators: read every peer's announcement of a run and summarise it (swarm/dht/view.py),
then show that summary as the bootstrap's swarm-wide gauges and as the text of `swarm-peer status`."""

from __future__ import annotations

from typing import Optional

from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.core import GaugeMetricFamily

from swarm.config import Recipe, even_bounds
from swarm.dht.node import SwarmNode
from swarm.dht.records import parse_peer_records, peers_key
from swarm.dht.view import SwarmSummary, at_round, summarize, summarize_stages


def recipe_blocks(recipe: Recipe) -> Optional[int]:
    """How many blocks the recipe's model has, when the recipe says it without its config file."""
    return recipe.model.num_layers if recipe.model.config_file is None else None


async def read_swarm(node: SwarmNode, recipe: Recipe) -> SwarmSummary:
    """The run's announcements, validated (records with blocks outside the model's are rejected) and summarised;
    a pipelined run's stage by stage (each stage's peers announce under the stage's run id)."""
    n_blocks, stages = recipe_blocks(recipe), recipe.pipeline.stages
    read_at = node.now()
    per_stage, invalid = [], 0
    for k in range(stages):
        records, bad = parse_peer_records(await node.get(peers_key(recipe.stage_run_id(k))), n_blocks)
        per_stage.append(records)
        invalid += bad
    if stages == 1:
        return summarize(per_stage[0], invalid, n_blocks, read_at)
    if n_blocks is not None:
        bounds = even_bounds(n_blocks, stages)
    else:  # (a config-file model: the stages' bounds as their peers announce them, unknown for an empty stage)
        bounds = [(records[0].block_start, records[0].block_end) if records else (0, 0) for records in per_stage]
    return summarize_stages(per_stage, bounds, invalid, n_blocks, read_at)


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
        # A pipelined run's stages (pipeline.stages > 1), each averaging on its own.
        self.stage_peers = Gauge("swarm_stage_peers", "Online peers hosting each pipeline stage", ["stage"],
                                 registry=registry)
        self.stage_round = Gauge("swarm_stage_round", "Highest outer round of each stage's training peers",
                                 ["stage"], registry=registry)
        self.stage_tokens = Gauge("swarm_stage_tokens_per_second", "Sum of each stage's online peers' throughput",
                                  ["stage"], registry=registry)
        self.stage_capacity = Gauge("swarm_stage_capacity_tokens_per_second", "Tokens/s each stage's training "
                                    "peers compute when they never wait for another stage (absent until measured)",
                                    ["stage"], registry=registry)
        self.stage_backup = Gauge("swarm_stage_backup_round", "Round of the state of each stage that the peers of "
                                  "the stage before keep and vouch for (absent while none does)", ["stage"],
                                  registry=registry)
        self.backed_up: set[str] = set()  # the stages whose backup round the gauge shows
        self.stage_divergent = Gauge("swarm_stage_divergent_peers", "Each stage's training peers whose digest is "
                                     "not the stage's majority's", ["stage"], registry=registry)
        self.bottleneck = _Bottleneck()
        registry.register(self.bottleneck)

    def update(self, summary: SwarmSummary) -> None:
        for state, count in summary.by_state.items():
            self.peers.labels(state=state).set(count)
        self.tokens_per_s.set(summary.tokens_per_s)
        self.round.set(summary.round)
        if summary.loss_mean is not None:
            self.loss.set(summary.loss_mean)
        if summary.stages:
            self.divergent.set(sum(stage.divergent_peers for stage in summary.stages))
        else:
            self.divergent.set(sum(1 for p in at_round(summary.peers, summary.round)
                                   if p.digest != summary.majority_digest))
        self.bottleneck.stage = None  # a whole-model run has no stages: no gauge at all, rather than a 0
        for stage in summary.stages:
            label = str(stage.stage)
            self.stage_peers.labels(stage=label).set(stage.peers_online)
            self.stage_round.labels(stage=label).set(stage.round)
            self.stage_tokens.labels(stage=label).set(stage.tokens_per_s)
            if stage.capacity is not None:
                self.stage_capacity.labels(stage=label).set(stage.capacity)
            if stage.backup_round is not None:
                self.stage_backup.labels(stage=label).set(stage.backup_round)
                self.backed_up.add(label)
            elif label in self.backed_up:  # (its keepers left: no backup, rather than the last one's round)
                self.stage_backup.remove(label)
                self.backed_up.discard(label)
            self.stage_divergent.labels(stage=label).set(stage.divergent_peers)
            if stage.bottleneck:
                self.bottleneck.stage = stage.stage
        self.invalid.set(summary.invalid_records)
        self.uncovered.set(len(summary.uncovered_blocks))


class _Bottleneck:
    """`swarm_stage_bottleneck`, exported only while the swarm is cut into stages: a plain Gauge would read 0, which
    names stage 0, on a whole-model run."""

    def __init__(self) -> None:
        self.stage: Optional[int] = None

    def describe(self) -> list:
        return [GaugeMetricFamily("swarm_stage_bottleneck", BOTTLENECK_HELP)]

    def collect(self):
        if self.stage is not None:
            yield GaugeMetricFamily("swarm_stage_bottleneck", BOTTLENECK_HELP, value=self.stage)


BOTTLENECK_HELP = ("The stage that limits the pipelines (least capacity, or fewest peers until every stage measured "
                   "its own); absent for a whole-model run")


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
    if s.stages:
        lines.append(f"compute: {s.tokens_per_s:.0f} tokens/s through {len(s.stages)} pipeline stages; state "
                     f"digests: {'agree within each stage' if s.digests_agree else 'DIFFER within a stage'}")
        lines.extend(f"  stage {t.stage} blocks [{t.block_start}, {t.block_end}): {t.peers_online} "
                     f"peer{'' if t.peers_online == 1 else 's'}, round {t.round}, {t.tokens_per_s:.0f} tokens/s"
                     + ("" if t.capacity is None else f" (could compute {t.capacity:.0f})")
                     + ("" if t.backup_round is None else f", backup of round {t.backup_round}") + ", "
                     + ("no digest yet" if not t.majority_digest else f"digests agree ({t.majority_digest})"
                        if t.digests_agree else f"digests DIFFER (majority {t.majority_digest})")
                     + ("  <- bottleneck" if t.bottleneck else "") for t in s.stages)
    else:
        lines.append(f"compute: {s.tokens_per_s:.0f} tokens/s; state digests: "
                     + ("none yet" if not s.majority_digest else f"agree ({s.majority_digest})" if s.digests_agree
                        else f"DIFFER (majority {s.majority_digest})"))
    coverage = ", ".join(f"[{start}, {end}) {count}" for start, end, count in coverage_runs(s.block_coverage))
    nobody = ", ".join(map(str, s.uncovered_blocks)) if s.uncovered_blocks else "none"
    lines.append(f"blocks: {s.n_blocks}; peers per block: {coverage or '-'}; hosted by nobody: {nobody}")
    lines.append(f"{'peer':<14}{'state':<11}{'blocks':<9}{'device':<26}{'tok/s':>9}{'up MB/s':>9}{'down MB/s':>10}"
                 f"{'round':>7}{'shard':>6}{'files':>6}{'loss':>8}{'seen':>7}")
    for p in s.peers:
        loss = f"{p.loss:.3f}" if p.loss is not None else "-"
        shard = "-" if p.data_shard is None else str(p.data_shard)
        files = "-" if p.data_files is None else str(p.data_files)
        memory = f"{p.device_memory / 2 ** 30:.0f}GiB" if p.device_memory else ""
        device = " ".join(part for part in (p.device, memory, p.device_name) if part)  # the name may be cut
        lines.append(f"{p.peer_id[-12:]:<14}{p.state:<11}{f'{p.block_start}-{p.block_end}':<9}{device[:25]:<26}"
                     f"{p.tokens_per_s:>9.0f}{p.bandwidth_up / 1e6:>9.1f}{p.bandwidth_down / 1e6:>10.1f}"
                     f"{p.round:>7}{shard:>6}{files:>6}{loss:>8}{max(s.read_at - p.updated, 0):>6.0f}s")
    return "\n".join(lines)
