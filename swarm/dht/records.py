"""What peers write into the DHT: the run recipe (written by the bootstrap) and each peer's announcement
(state, round, progress, params digest, hosted blocks, capacity). Readers validate every record and skip, and
count, malformed ones; unknown fields are ignored so peers of different versions can share a swarm.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any, Optional

RECIPE_KEY = "swarm.recipe"
PEER_STATES = ("joining", "syncing", "training", "averaging", "offline")
MAX_STRING = 256


def peers_key(run_id: str) -> str:
    return f"swarm.{run_id}.peers"


def group_key(run_id: str, round_no: int, attempt: int) -> str:
    return f"swarm.{run_id}.group.{round_no}.{attempt}"


def final_key(run_id: str, round_no: int, attempt: int) -> str:
    return f"swarm.{run_id}.final.{round_no}.{attempt}"


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
    device: str = "cpu"
    tokens_per_s: float = 0.0
    loss: Optional[float] = None
    val_loss: Optional[float] = None
    attempt: int = 0  # averaging attempts of this round so far: peers that failed together retry together
    updated: float = 0.0

    def to_wire(self) -> dict:
        out = asdict(self)
        del out["peer_id"]  # the subkey carries it
        return out

    @classmethod
    def from_wire(cls, peer_id: str, value: Any, n_blocks: Optional[int] = None) -> "PeerRecord":
        """Validate a decoded record; raises InvalidRecord naming the bad field. Unknown keys are ignored."""
        if not isinstance(value, dict):
            raise InvalidRecord(f"record is a {type(value).__name__}, not a mapping")
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
        for name in ("state", "version", "run_id", "digest", "device"):
            _string(getattr(self, name), name)
        if self.state not in PEER_STATES:
            raise InvalidRecord(f"state {self.state!r} is not one of {PEER_STATES}")
        for name in ("round", "tokens_in_round", "block_start", "block_end", "attempt"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 1 << 62:
                raise InvalidRecord(f"{name} must be a non-negative integer, got {value!r}")
        if not self.block_start < self.block_end or (n_blocks is not None and self.block_end > n_blocks):
            raise InvalidRecord(f"block range [{self.block_start}, {self.block_end}) is outside the model")
        for name in ("tokens_per_s", "updated"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise InvalidRecord(f"{name} must be a finite non-negative number, got {value!r}")
        for name in ("loss", "val_loss"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (int, float)) or not math.isfinite(value)):
                raise InvalidRecord(f"{name} must be a finite number or null, got {value!r}")


def _string(value: Any, name: str) -> str:
    if not isinstance(value, str) or len(value) > MAX_STRING:
        raise InvalidRecord(f"{name} must be a string of at most {MAX_STRING} characters")
    return value


def parse_peer_records(raw: dict[str, Any], n_blocks: Optional[int] = None) -> tuple[list[PeerRecord], int]:
    """Valid records sorted by peer id, and how many were rejected."""
    records, rejected = [], 0
    for peer_id, value in raw.items():
        try:
            records.append(PeerRecord.from_wire(peer_id, value, n_blocks))
        except (InvalidRecord, TypeError):
            rejected += 1
    records.sort(key=lambda r: r.peer_id)
    return records, rejected
