"""The settings of one machine, not shared with the swarm: a peer's (`swarm-peer join`, `doctor`) and a bootstrap
node's. Each field is one `swarm-peer` flag (swarm/settings_cli.py generates them): its description is the flag's
help, `json_schema_extra` names the flag where it is not the field's name and gives its metavar. The run's recipe,
which every peer shares, is swarm/config.py's."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional

from pydantic import Field, field_validator, model_validator

from swarm.config import _Section

DEFAULT_HOST_MADDR = "/ip4/127.0.0.1/tcp/0"



class NetworkSettings(_Section):
    """How a node listens, what it announces and which transports it uses (`swarm.dht.node.NetworkOptions`)."""

    host_maddrs: tuple[str, ...] = Field(
        (DEFAULT_HOST_MADDR,), json_schema_extra={"metavar": "MADDR"},
        description=f"multiaddrs to listen on (default {DEFAULT_HOST_MADDR}: loopback only; use /ip4/0.0.0.0/tcp/PORT "
                    "to accept peers from other machines)")
    announce_maddrs: tuple[str, ...] = Field(
        (), json_schema_extra={"metavar": "MADDR"},
        description="public multiaddrs to announce instead of the listening ones (e.g. behind port forwarding)")
    identity_path: Optional[str] = Field(
        None, json_schema_extra={"metavar": "FILE"},
        description="private key file: keeps the same peer id (and multiaddr) across restarts; created if missing")
    port_mapping: Literal["auto", "on", "off"] = Field(
        "auto", description="ask the home router to forward this peer's ports: p2pd maps the libp2p port (UPnP or "
                            "NAT-PMP) and join maps the same ports by NAT-PMP, the direct-stream port too, renews "
                            "them while the peer runs and removes them at exit; join announces the router's address "
                            "only once the swarm dialled it back there. auto (default): on unless every --host-maddrs "
                            "address is loopback. Nothing is mapped with --client-mode or --announce-maddrs; a "
                            "bootstrap only has p2pd map its port")
    nat_traversal: bool = Field(
        False, description="enable AutoNAT and circuit relays (off by default; local swarms and tests do not need "
                           "them)")
    relay_service: bool = Field(
        False, description="serve as a circuit relay for other peers (e.g. on a public bootstrap, for peers behind "
                           "NAT): off by default, since a relay carries anyone's traffic at its own bandwidth's cost")
    client_mode: bool = Field(
        False, description="for peers that cannot accept inbound connections (behind NAT, no port forwarding): open "
                           "every stream yourself; the peer still contributes to every average but reduces no part "
                           "of it, serves no state and answers no DHT requests")
    direct_streams: bool = Field(
        True, json_schema_extra={"flag": "no-direct-streams"},
        description="direct TLS streams between peers, on by default; --no-direct-streams sends every stream "
                    "through libp2p (slower; for networks where only the libp2p port is reachable and a failed "
                    "direct attempt per peer every 30 s costs too much)")
    direct_port: int = Field(
        0, ge=0, le=65535, json_schema_extra={"metavar": "PORT"},
        description="TCP port for direct streams, the all-reduce's and state download's bytes over TLS between peers "
                    "instead of through the libp2p daemons (default: any free port; fix it to forward it through a "
                    "NAT or open it in a firewall)")


class MetricsSettings(_Section):
    """Where Prometheus scrapes a node: a peer's own metrics, or the bootstrap's swarm-wide ones and status page."""

    port: Optional[int] = Field(
        None, ge=0, le=65535, json_schema_extra={"flag": "metrics-port", "metavar": "N"},
        description="serve Prometheus metrics on this port (0 picks a free port): a peer's own, or the whole "
                    "swarm's from the bootstrap")
    host: str = Field(
        "127.0.0.1", json_schema_extra={"flag": "metrics-host", "metavar": "ADDR"},
        description="address the metrics server binds to (default 127.0.0.1; 0.0.0.0 for remote scraping)")


class CheckpointSettings(_Section):
    """Where a peer writes its checkpoints and which of them it keeps."""

    dir: Optional[str] = Field(
        None, json_schema_extra={"flag": "checkpoint-dir", "metavar": "DIR"},
        description="write checkpoints here and resume from the newest one on restart")
    keep: int = Field(
        3, ge=1, json_schema_extra={"flag": "keep-checkpoints", "metavar": "N"},
        description="how many recent checkpoints to keep (default 3)")
    series: int = Field(
        100, ge=0, json_schema_extra={"flag": "checkpoint-series", "metavar": "N"},
        description="also keep a series of intermediate checkpoints, as Pythia publishes them: rounds 1, 2, 4, 8, "
                    "... and every N-th round (default 100; 0 keeps only the recent ones)")


class PeerSettings(_Section):
    """Settings of one volunteer's peer (`swarm-peer join`)."""

    initial_peers: tuple[str, ...] = Field(
        json_schema_extra={"metavar": "MADDR"},
        description="multiaddr(s) printed by `swarm-peer bootstrap` (/ip4/.../tcp/.../p2p/<id>)")
    network: NetworkSettings = NetworkSettings()
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="where to train: auto uses CUDA with bf16 autocast when available (default auto)")
    num_threads: Optional[int] = Field(
        None, gt=0, json_schema_extra={"metavar": "N"},
        description="torch CPU threads (default: all cores; set it when several peers share a machine)")
    metrics: MetricsSettings = MetricsSettings()
    checkpoints: CheckpointSettings = CheckpointSettings()
    replay_log_mb: Optional[float] = Field(
        None, ge=0, allow_inf_nan=False, json_schema_extra={"metavar": "MB"},
        description="memory for the latest outer steps, which peers a few rounds behind replay instead of "
                    "downloading the state (default: 2.5 bytes a param, a round of fp16 averages; 0 keeps none)")
    outer_state_dir: Optional[str] = Field(
        None, json_schema_extra={"metavar": "DIR"},
        description="keep the global params and outer momentum (8 bytes a param) in a file in DIR on a disk instead "
                    "of in memory, and the replay log in files beside it: paged in a fragment at a time for a sync, "
                    "then left to the kernel, which writes them out when memory is short (writes about a fragment's "
                    "8 bytes a param a sync; default: in memory)")
    recompute_activations: bool = Field(
        False, description="keep each transformer block's input alone in the forward pass and compute the rest again "
                           "in the backward (gradient checkpointing): a block's activations in memory instead of "
                           "all of them, for about a third more compute; the same gradients")
    max_rounds: Optional[int] = Field(
        None, gt=0, json_schema_extra={"metavar": "N"}, description="stop after averaging this many outer rounds")
    until_round: Optional[int] = Field(
        None, gt=0, json_schema_extra={"metavar": "N"},
        description="stop once the global round reaches N (all peers of a swarm stop at the same round)")
    recipe_file: Optional[str] = Field(
        None, json_schema_extra={"flag": "recipe", "metavar": "FILE"},
        description="refuse to start unless the swarm's recipe equals this file's (names the differences)")
    cache_dir: str = Field(
        str(Path.home() / ".cache" / "swarm"), json_schema_extra={"metavar": "DIR"},
        description="tokenizer and tokenized-corpus cache (default ~/.cache/swarm)")
    data_dir: Optional[str] = Field(
        None, json_schema_extra={"metavar": "DIR"},
        description="where the recipe's local files (data.source, data.tokenizer, model.config_file) are read "
                    "from: a recipe comes from the network, so it may name nothing outside this directory "
                    "(default: --cache-dir)")
    data_shard: Optional[int] = Field(
        None, ge=0, json_schema_extra={"metavar": "K"},
        description="start the data stream at shard K (default: where no live peer reads)")
    max_memory: Optional[float] = Field(
        None, gt=0, allow_inf_nan=False, json_schema_extra={"metavar": "MB"},
        description="train within this much memory: the whole model, or a pipeline stage that fits (default: no limit)")
    microbatches: int = Field(
        2, ge=1, le=64, json_schema_extra={"metavar": "K"},
        description="a first-stage peer of a pipelined run cuts each batch into K microbatches, one optimizer step "
                    "over all, and keeps K in flight at all times (as many as the run has stages, where that is "
                    "more): the next stage computes one while this one computes another")
    stage: Optional[int] = Field(
        None, ge=0, json_schema_extra={"metavar": "K"},
        description="in a run cut into pipeline stages, host stage K (default: the stage with the fewest live "
                    "peers; a restarted peer passes its checkpoint's)")
    trace_dir: Optional[str] = Field(
        None, json_schema_extra={"metavar": "DIR"},
        description="write every round's pseudo-gradient, average and global params as safetensors, to audit the "
                    "averaging")
    events_file: Optional[str] = Field(
        None, json_schema_extra={"metavar": "FILE"},
        description="append one JSON line per event a script or test waits on (joined, averaged, synced, ...; "
                    "see swarm/events.py)")
    invite: Optional[str] = Field(
        None, json_schema_extra={"metavar": "TOKEN"},
        description="the invite the owner of a private run gave you (`swarm-peer invite <your peer id>` prints it; "
                    "keep the same --identity-path: it is bound to your peer id)")
    inject_fault: Optional[str] = Field(
        None, json_schema_extra={"metavar": "PHASE@ROUND"},
        description="for tests and drills: SIGKILL this peer at a phase (matchmaking, send, reduce, commit; ring: "
                    "while sending along a ring; serve: while answering a state request) of the first round >= ROUND "
                    "it averages in (or holds, for serve), send bad data (garbage, "
                    "nan, short; ring-garbage: garbage along rings only; scaled: its pseudo-gradient x1000, flipped: "
                    "x-1, inflated: x1000 declaring the most weight the swarm accepts, as a lying member would; "
                    "lying-reducer: its part averaged x1000, hidden as well as it can; reject-all: as a reducer, it "
                    "names every other member as having sent bad data) from that round on, name every "
                    "other peer as caught lying (accuse-all) or always the same one (accuse-one), lie in what "
                    "matchmaking writes (unverified-entry: entries without a nonce commitment, declaring 1e11 B/s; "
                    "foreign-digest: a state digest no other peer holds; inflated-swarm-size: groups it leads "
                    "published with a swarm size of 2^20), as a pipeline stage answer with input-gradients x1000 "
                    "(scale-grad), losses / 1000 (low-loss) or noise of the input-gradients' norm (garbage-grad), send "
                    "noise of its activations' norm (garbage-act, a first stage), or break its own "
                    "training once (diverge: NaN params; explode: an absurd pseudo-gradient), or compute 4x "
                    "slower from that round on (slow: a weaker device, for rebalancing drills)")

    @field_validator("initial_peers")
    @classmethod
    def _with_peer_ids(cls, maddrs: tuple[str, ...]) -> tuple[str, ...]:
        """An address copied without its peer id fails here at once, not after the start-up checks (`doctor` says
        the same of any other malformed one)."""
        for maddr in maddrs:
            if "/p2p/" not in maddr:
                raise ValueError(f"{maddr} has no /p2p/<peer id> part: copy the full multiaddr that `swarm-peer "
                                 "bootstrap` printed")
        return maddrs


class BootstrapSettings(_Section):
    """Settings of a bootstrap node (`swarm-peer bootstrap`)."""

    network: NetworkSettings = NetworkSettings()
    recipe_file: Optional[str] = Field(
        None, json_schema_extra={"flag": "recipe", "metavar": "FILE"},
        description="run recipe (.yaml/.json); default: the embedded demo run (small Llama on the bundled "
                    "Shakespeare corpus)")
    metrics: MetricsSettings = MetricsSettings()
    private: bool = Field(
        False, description="a private run: only peers with an invite signed by this bootstrap's --identity-path "
                           "key (`swarm-peer invite PEER_ID`), or listed in --allowlist, may take part")
    allowlist: Optional[str] = Field(
        None, json_schema_extra={"metavar": "FILE"},
        description="with --private: peer ids (one a line) admitted without a token; the bootstrap signs their "
                    "invites and publishes them with the recipe")
    events_file: Optional[str] = Field(
        None, json_schema_extra={"metavar": "FILE"},
        description="append one JSON line per event a script or test waits on (listening; see swarm/events.py)")
    share_data: Optional[bool] = Field(
        None, description="tokenize the recipe's corpus into content-addressed files, publish their manifest with "
                          "the recipe and serve them, so peers need no copy of the data (default: when the recipe "
                          "names local files: data.source, data.tokenizer or model.config_file; a bootstrap "
                          "that cannot share them refuses to start). --no-share-data: every peer reads the "
                          "recipe's files from its own --data-dir instead")
    cache_dir: str = Field(
        str(Path.home() / ".cache" / "swarm"), json_schema_extra={"metavar": "DIR"},
        description="where the shared dataset's files and the tokenizer cache live (default ~/.cache/swarm)")
    data_dir: Optional[str] = Field(
        None, json_schema_extra={"metavar": "DIR"},
        description="where the recipe's local files are read from (default: --cache-dir)")

    @model_validator(mode="after")
    def _private_needs_a_lasting_key(self) -> "BootstrapSettings":
        if self.allowlist is not None and not self.private:
            raise ValueError("--allowlist admits peers to a private run: add --private")
        if self.private and self.network.identity_path is None:
            raise ValueError("--private needs --identity-path FILE: invites are signed with that key, and peers "
                             "trust the run's owner by the peer id it gives")
        return self
