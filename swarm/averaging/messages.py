"""The group all-reduce's messages as typed records: the header that opens every stream (with the body of its
phase: a contribution's weight, an abort's blame) and the meta of each chunk (a ring's partial sum, an averaged
chunk's accounts). `from_wire` validates what a peer sent and raises MessageError naming the bad field; whoever
reads a message decides what a bad one costs its sender. Unknown fields are ignored, so versions can mix."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Union

from swarm.words import shown

PHASES = ("part", "avg", "commit", "pull", "decision", "abort", "ping", "ring", "verify")
MAX_ROUND = 1 << 40  # bound on round and attempt numbers, far above any real run
MAX_WEIGHT = 1e18  # bound on one member's weight (tokens processed)
# Where each field stands in a header on the wire: the order peers have always written them in.
HEADER_ORDER = ("group_id", "round", "attempt", "phase", "weight", "chunks", "suspects", "rejected", "nonce", "hashes")


class MessageError(ValueError):
    """A message that fails validation; the text says which field."""


@dataclass(frozen=True)
class Contribution:
    """The body of a "part" or "ring" header: the sender's weight (tokens processed)."""

    weight: float

    def to_wire(self) -> dict:
        return {"weight": float(self.weight)}

    @classmethod
    def from_wire(cls, value: Any) -> "Contribution":
        return cls(_weight(_mapping(value, "header").get("weight"), "weight"))


@dataclass(frozen=True)
class Blame:
    """The body of an "abort" header: whom the member that gave the attempt up blames. `suspects` did not
    deliver, `rejected` sent bad data. In a ring only a member's successor sees what it sent, so the others
    learn the culprit from this."""

    suspects: tuple[str, ...] = ()
    rejected: tuple[str, ...] = ()

    def to_wire(self) -> dict:
        return {"suspects": sorted(self.suspects), "rejected": sorted(self.rejected)}

    @classmethod
    def from_wire(cls, value: Any) -> "Blame":
        value = _mapping(value, "header")
        return cls(_peers(value.get("suspects", []), "suspects"), _peers(value.get("rejected", []), "rejected"))


@dataclass(frozen=True)
class Reveal:
    """The body of a "commit" header in a verified group (verify.py): the nonce the member committed to in its
    matchmaking entry, and the sha256 of each part's averaged bytes as it received them (empty for a part with no
    elements), so members see at once whether a reducer sent them different averages."""

    nonce: bytes
    hashes: tuple[str, ...]

    def to_wire(self) -> dict:
        return {"nonce": self.nonce.hex(), "hashes": list(self.hashes)}

    @classmethod
    def from_wire(cls, value: Any, parts: int) -> "Reveal":
        value = _mapping(value, "header")
        nonce, hashes = value.get("nonce"), value.get("hashes")
        if not isinstance(nonce, str) or len(nonce) > 128 or len(nonce) % 2 or \
                not all(c in "0123456789abcdefABCDEF" for c in nonce):  # (fromhex would skip whitespace)
            raise MessageError(f"nonce must be a hex string, got {shown(nonce)}")
        raw = bytes.fromhex(nonce)
        if not isinstance(hashes, list) or len(hashes) != parts or \
                not all(isinstance(h, str) and len(h) <= 64 for h in hashes):
            raise MessageError(f"hashes must be {parts} hex strings")
        return cls(raw, tuple(hashes))


Body = Union[Contribution, Blame, Reveal]


@dataclass(frozen=True)
class Header:
    """The first frame of every all-reduce stream: the group, round and attempt it is about, its phase, how many
    chunks follow, and the phase's body (Contribution for "part" and "ring", Blame for "abort", else None)."""

    phase: str
    group_id: str
    round: int
    attempt: int
    chunks: int = 0
    body: Optional[Body] = None

    def to_wire(self) -> dict:
        fields = {"group_id": self.group_id, "round": self.round, "attempt": self.attempt, "phase": self.phase,
                  "chunks": self.chunks, **(self.body.to_wire() if self.body is not None else {})}
        return {name: fields[name] for name in HEADER_ORDER if name in fields}

    @classmethod
    def from_wire(cls, value: Any, max_chunks: int) -> "Header":
        """The envelope of a received header, validated; raises MessageError naming the bad field. The body is
        not read here (body is None): its reader judges it (see Contribution.from_wire, Blame.from_wire), since
        a bad weight costs the sender its contribution, not its stream."""
        value = _mapping(value, "header")
        phase = value.get("phase")
        if phase not in PHASES:
            raise MessageError(f"phase {shown(phase)} is not one of {', '.join(PHASES)}")
        group_id = value.get("group_id")
        if not isinstance(group_id, str):
            raise MessageError(f"group_id must be a string, got {shown(group_id)}")
        chunks = value.get("chunks", 0)
        if not _is_int(chunks) or not 0 <= chunks <= max_chunks:
            raise MessageError(f"chunks must be an integer in [0, {max_chunks}], got {shown(chunks)}")
        round_no, attempt = value.get("round"), value.get("attempt")
        for name, number in (("round", round_no), ("attempt", attempt)):
            if not _is_int(number) or not 0 <= number < MAX_ROUND:
                raise MessageError(f"{name} must be an integer in [0, {MAX_ROUND}), got {shown(number)}")
        return cls(phase, group_id, round_no, attempt, chunks)


@dataclass(frozen=True)
class PartialSum:
    """The meta of a ring's "sum" chunk: which members' contributions the running sum holds, and their weight."""

    contributors: tuple[str, ...]
    weight: float

    def to_wire(self) -> dict:
        return {"contributors": list(self.contributors), "weight": float(self.weight)}

    @classmethod
    def from_wire(cls, value: Any) -> "PartialSum":
        value = _mapping(value, "partial sum")
        contributors = _peers(value.get("contributors"), "contributors")
        if len(set(contributors)) != len(contributors):
            raise MessageError("contributors names a member twice")
        return cls(contributors, _weight(value.get("weight"), "weight"))


@dataclass(frozen=True)
class Averaged:
    """The meta of an averaged chunk (its reducer's accounts): whose contributions it averages, whose data it
    refused, the total weight, and CenteredClip's radius and norm cap (None for other aggregates). Every member reads
    the same accounts, so all agree on the outcome."""

    contributors: tuple[str, ...]
    rejected: tuple[str, ...]
    total_weight: float
    radius: Optional[float] = None
    cap: Optional[float] = None

    def to_wire(self) -> dict:
        wire = {"contributors": sorted(self.contributors), "rejected": sorted(self.rejected),
                "total_weight": float(self.total_weight)}
        if self.radius is not None:
            wire["radius"] = float(self.radius)
        if self.cap is not None:
            wire["cap"] = float(self.cap)
        return wire

    @classmethod
    def from_wire(cls, value: Any) -> "Averaged":
        value = _mapping(value, "averaged chunk's meta")
        total_weight = value.get("total_weight")
        if not isinstance(total_weight, float) or not math.isfinite(total_weight) or total_weight < 0:
            raise MessageError(f"total_weight must be a finite float >= 0, got {shown(total_weight)}")
        radius = value.get("radius")
        if radius is not None and (not isinstance(radius, float) or not radius >= 0):  # (inf: a group of two)
            raise MessageError(f"radius must be a float >= 0, got {shown(radius)}")
        cap = value.get("cap")
        if cap is not None and (not isinstance(cap, float) or not cap >= 0):  # (inf: no cap)
            raise MessageError(f"cap must be a float >= 0, got {shown(cap)}")
        return cls(_peers(value.get("contributors"), "contributors"), _peers(value.get("rejected", []), "rejected"),
                   total_weight, radius, cap)


def _mapping(value: Any, what: str) -> dict:
    if not isinstance(value, dict):
        raise MessageError(f"the {what} is a {type(value).__name__}, not a mapping")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _weight(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < MAX_WEIGHT:
        raise MessageError(f"{name} must be a number in [0, {MAX_WEIGHT:g}), got {shown(value)}")
    return float(value)


def _peers(value: Any, name: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(peer, str) for peer in value):
        raise MessageError(f"{name} must be a list of peer ids, got {shown(value)}")
    return tuple(value)
