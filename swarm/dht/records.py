"""What peers write into the DHT: the run recipe (written by the bootstrap) and each peer's announcement
(state, round, progress, state digest, hosted blocks, device, throughput, bandwidth). Both sit under owned,
signed subkeys (see validation.py); readers validate every record and skip, and count, malformed ones; unknown
fields are ignored so peers of different versions can share a swarm.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any, Optional, Sequence

from swarm.config import MAX_RECIPE_JSON, Recipe, RecipeError, recipe_from_json
from swarm.dht.validation import KeyRule, subkey_owner
from swarm.words import shown

RECIPE_KEY = "swarm.recipe"
DATASET = "dataset"  # the recipe record's field naming the run's dataset
# Peer states, grouped once by what a reader counts on a peer for (see swarm/dht/view.py).
ONLINE_STATES = ("joining", "syncing", "training", "averaging")  # every state but offline: the peer is up
ROUND_STATES = ("syncing", "training", "averaging")  # takes part in rounds (a syncing peer joins the next one)
TRAINING_STATES = ("training", "averaging")  # holds the swarm's state: counts toward progress, rounds, digests
PEER_STATES = ONLINE_STATES + ("offline",)
MAX_STRING = 256
MAX_FIELDS = 64  # a record with more keys than this is padding, not a newer version
# Bounds far above any real device or link, so only broken or hostile values fail them.
MAX_TOKENS_PER_S = 1e12
MAX_BANDWIDTH = 1e13  # bytes/s
MAX_MEMORY = 1 << 50  # bytes
# Lifetimes and sizes every node enforces when it stores or receives these records (validation.KeyRule).
RECIPE_RULE = KeyRule(max_ttl=3600.0, max_bytes=MAX_RECIPE_JSON)
PEER_RECORD_RULE = KeyRule(max_ttl=600.0, max_bytes=8 << 10)
DATA_HOLDER_RULE = KeyRule(max_ttl=600.0, max_bytes=1 << 10)


def peers_key(run_id: str) -> str:
    return f"swarm.{run_id}.peers"


def group_key(run_id: str, round_no: int, attempt: int) -> str:
    return f"swarm.{run_id}.group.{round_no}.{attempt}"


def final_key(run_id: str, round_no: int, attempt: int) -> str:
    return f"swarm.{run_id}.final.{round_no}.{attempt}"


def data_key(run_id: str) -> str:
    """Where peers that hold files of the run's dataset say so (swarm.data.share)."""
    return f"swarm.{run_id}.data"


def protected_keys(recipe: Recipe) -> dict[str, KeyRule]:
    """A run's keys that accept only owned, signed entries (a node protects them once it knows the run): its peers
    and its stages' peers, and its data holders."""
    stages = {peers_key(recipe.stage_run_id(k)): PEER_RECORD_RULE for k in range(recipe.pipeline.stages)}
    return {peers_key(recipe.run_id): PEER_RECORD_RULE, **stages, data_key(recipe.run_id): DATA_HOLDER_RULE}


class InvalidRecord(ValueError):
    """A record that fails validation; the message says which field."""


@dataclass(frozen=True)
class PeerRecord:
    """One peer's announcement, re-published on a heartbeat with an expiry."""

    peer_id: str
    state: str
    version: str
    run_id: str
    round: int
    tokens_in_round: int
    block_start: int
    block_end: int
    digest: str = ""
    device: str = "cpu"  # torch device type: cpu or cuda
    device_name: str = ""  # GPU (or CPU) model
    device_memory: int = 0  # bytes of GPU memory (system memory for a CPU peer)
    tokens_per_s: float = 0.0  # a start-up probe's measurement until real training measures it
    # Tokens/s it computes when it never waits for another pipeline stage (a stage peer's tokens over its busy
    # seconds; a whole-model peer's tokens_per_s): what its stage would lose if it left. 0 until measured.
    capacity: float = 0.0
    bandwidth_up: float = 0.0  # bytes/s, measured on real all-reduce traffic; 0 until measured
    bandwidth_down: float = 0.0
    loss: Optional[float] = None
    val_loss: Optional[float] = None
    attempt: int = 0  # averaging attempts of this round so far: peers that failed together retry together
    # With overlap: the tokens of `round` handed to an all-reduce still in flight; tokens_in_round then count
    # toward round + 1 already. None otherwise.
    in_flight_tokens: Optional[int] = None
    # The data shard the peer reads now, and the one its stream started at (None before it chose one, or from a
    # peer that does not announce them): joiners start where nobody reads, and peers whose streams started at one
    # shard (identical batches) part.
    data_shard: Optional[int] = None
    data_start: Optional[int] = None
    # Of the run's shared dataset (None: the run shares none): files this peer holds and serves, and bytes of them it
    # fetched from other peers.
    data_files: Optional[int] = None
    data_fetched: Optional[int] = None
    # A stage peer's backup of the next stage's state (swarm/peer/pipeline/keeper.py): its round and state digest;
    # None and "" while it keeps none.
    kept_round: Optional[int] = None
    kept_digest: str = ""
    client: bool = False  # --client-mode: accepts no inbound streams, so it serves no state to joiners
    updated: float = 0.0

    @property
    def counting_round(self) -> int:
        """The round that tokens_in_round counts toward."""
        return self.round + (self.in_flight_tokens is not None)

    def takes_part_in(self, round_no: int) -> bool:
        """At that round, or (with overlap) training toward it while the round before is in flight."""
        return round_no in (self.round, self.counting_round)

    def to_wire(self) -> dict:
        out = asdict(self)
        del out["peer_id"]  # the subkey carries it
        return out

    @classmethod
    def from_wire(cls, peer_id: str, value: Any, n_blocks: Optional[int] = None) -> "PeerRecord":
        """Validate a decoded record; raises InvalidRecord naming the bad field. Unknown keys are ignored."""
        if not isinstance(value, dict):
            raise InvalidRecord(f"record is a {type(value).__name__}, not a mapping")
        if len(value) > MAX_FIELDS:
            raise InvalidRecord(f"record has {len(value)} fields, more than {MAX_FIELDS}")
        known = {f.name: f for f in fields(cls) if f.name != "peer_id"}
        kwargs: dict[str, Any] = {"peer_id": _string(peer_id, "peer_id")}
        for name, spec in known.items():
            if name not in value:
                if spec.default is not MISSING:
                    continue
                raise InvalidRecord(f"missing field {name!r}")
            kwargs[name] = value[name]
        record = cls(**kwargs)
        record._check(n_blocks)
        return record

    def _check(self, n_blocks: Optional[int]) -> None:
        for name in ("state", "version", "run_id", "digest", "device", "device_name", "kept_digest"):
            _string(getattr(self, name), name)
        if self.state not in PEER_STATES:
            raise InvalidRecord(f"state {shown(self.state)} is not one of {PEER_STATES}")
        for name in ("round", "tokens_in_round", "block_start", "block_end", "attempt"):
            _integer(getattr(self, name), name, 1 << 62)
        _integer(self.device_memory, "device_memory", MAX_MEMORY)
        for name in ("in_flight_tokens", "data_shard", "data_start", "data_files", "data_fetched", "kept_round"):
            if getattr(self, name) is not None:
                _integer(getattr(self, name), name, 1 << 62)
        if not self.block_start < self.block_end or (n_blocks is not None and self.block_end > n_blocks):
            raise InvalidRecord(f"block range [{self.block_start}, {self.block_end}) is outside the model")
        for name, bound in (("tokens_per_s", MAX_TOKENS_PER_S), ("capacity", MAX_TOKENS_PER_S),
                            ("bandwidth_up", MAX_BANDWIDTH),
                            ("bandwidth_down", MAX_BANDWIDTH), ("updated", math.inf)):
            value = getattr(self, name)
            if not _is_number(value) or not math.isfinite(value) or not 0 <= value <= bound:
                raise InvalidRecord(f"{name} must be a finite number in [0, {bound:g}], got {shown(value)}")
        for name in ("loss", "val_loss"):
            value = getattr(self, name)
            if value is not None and (not _is_number(value) or not math.isfinite(value)):
                raise InvalidRecord(f"{name} must be a finite number or null, got {shown(value)}")
        if not isinstance(self.client, bool):
            raise InvalidRecord(f"client must be true or false, got {shown(self.client)}")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _integer(value: Any, name: str, bound: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < bound:
        raise InvalidRecord(f"{name} must be an integer in [0, {bound}), got {shown(value)}")


def _string(value: Any, name: str) -> str:
    if not isinstance(value, str) or len(value) > MAX_STRING:
        raise InvalidRecord(f"{name} must be a string of at most {MAX_STRING} characters")
    if not value.isprintable():  # terminal escapes or line breaks would rewrite what `status` shows an operator
        raise InvalidRecord(f"{name} holds control characters")
    return value


def parse_peer_records(raw: dict[Any, Any], n_blocks: Optional[int] = None) -> tuple[list[PeerRecord], int]:
    """Valid records sorted by peer id, and how many entries were rejected. `raw` maps subkeys to values as the
    DHT returns them; an entry counts only under an owned subkey (`<peer id>[owner:<key>]`), whose peer id
    becomes the record's."""
    records, rejected = [], 0
    for subkey, value in raw.items():
        peer_id = subkey_owner(subkey)
        if peer_id is None:
            rejected += 1
            continue
        try:
            records.append(PeerRecord.from_wire(peer_id, value, n_blocks))
        except (InvalidRecord, TypeError):
            rejected += 1
    records.sort(key=lambda r: r.peer_id)
    return records, rejected


def recipe_value(recipe: Recipe, dataset: Optional[str] = None) -> dict:
    """What the run owner publishes under its owned subkey of RECIPE_KEY: the recipe, and the id (manifest sha256)
    of the dataset it shares, if any (swarm.data.dataset)."""
    value = {"json": recipe.canonical_json(), "digest": recipe.digest()}
    if dataset is not None:
        value[DATASET] = dataset
    return value


def parse_recipes(raw: dict[Any, Any]) -> tuple[dict[str, Recipe], dict[str, str]]:
    """Recipes published under RECIPE_KEY, by owner peer id, and the owners whose entry is unusable (with why).
    Entries outside owned subkeys are dropped: anyone may write those, so they say nothing about the run."""
    recipes: dict[str, Recipe] = {}
    problems: dict[str, str] = {}
    for subkey, value in raw.items():
        owner = subkey_owner(subkey)
        if owner is None:
            continue
        if not isinstance(value, dict) or not isinstance(value.get("json"), str):
            problems[owner] = "its recipe record is malformed"
            continue
        try:
            recipe = recipe_from_json(value["json"])
        except RecipeError as e:
            problems[owner] = str(e)
            continue
        if recipe.digest() != value.get("digest"):
            problems[owner] = "its recipe does not match its published hash"
            continue
        recipes[owner] = recipe
    return recipes, problems


def owner_dataset(raw: dict[Any, Any], owner: str) -> Optional[str]:
    """The dataset id (a sha256 in hex) that `owner`'s recipe record names; None if it names none or garbage."""
    for subkey, value in raw.items():
        if subkey_owner(subkey) == owner and isinstance(value, dict):
            dataset = value.get(DATASET)
            if isinstance(dataset, str) and len(dataset) == 64 and all(c in "0123456789abcdef" for c in dataset):
                return dataset
    return None


def choose_recipe(recipes: dict[str, Recipe], problems: dict[str, str], trusted: Sequence[str],
                  accept_untrusted: bool = True) -> Optional[tuple[str, Recipe]]:
    """The run owner and recipe to follow: the one published by a peer we were told to trust (our
    --initial-peers, normally the bootstrap); failing that, and only if `accept_untrusted` (the caller waited for
    the trusted one long enough), the only one published, if exactly one is. None if none is published yet.
    Raises RecipeError when the choice is ambiguous or the trusted owner's recipe is broken, naming what to do."""
    for owner in trusted:
        if owner in problems:
            raise RecipeError(f"the recipe published by {owner} is unusable: {problems[owner]}; ask the run host")
    chosen = {owner: recipes[owner] for owner in trusted if owner in recipes}
    if not chosen:
        if not accept_untrusted:
            return None
        chosen = dict(recipes)
        if len(chosen) > 1:
            raise RecipeError(f"{len(chosen)} peers ({', '.join(sorted(chosen))}) publish a run recipe and none of "
                              "them is in --initial-peers: pass the bootstrap's multiaddr as --initial-peers")
    if len({recipe.digest() for recipe in chosen.values()}) > 1:
        raise RecipeError(f"--initial-peers {', '.join(sorted(chosen))} publish different recipes: pass the "
                          "multiaddr of one run's bootstrap")
    if not chosen:
        return None
    owner = min(chosen)
    return owner, chosen[owner]
