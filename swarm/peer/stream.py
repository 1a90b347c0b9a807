"""Where one peer reads the training data: the shard its stream starts at and its step in that stream. Placed so
that peers training at the same time read different windows, and kept in the checkpoint across restarts."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from swarm.dht.records import PeerRecord
from swarm.data.prepare import TokenDataset, choose_data_shard

logger = logging.getLogger(__name__)


def peer_id_hash(peer_id: str) -> int:
    """A peer id as a number: the tie-break of shard choices."""
    return int(hashlib.sha256(peer_id.encode()).hexdigest(), 16)


@dataclass(frozen=True)
class Moved:
    """Why leave_if_shared moved our stream: the peer that started at our shard, the shard we left, and a line
    for the log."""

    rival: str
    from_shard: int
    text: str


class DataStream:
    """A peer's stream of batches (TokenDataset.batches from shard `start`) and the number read so far (`step`).
    `pinned` (--data-shard) fixes the start; otherwise place() chooses it."""

    def __init__(self, data: TokenDataset, num_shards: int, batch_size: int, seed: int, peer_id: str,
                 pinned: Optional[int] = None):
        self.data, self.num_shards, self.batch_size, self.seed = data, num_shards, batch_size, seed
        self.id_hash = peer_id_hash(peer_id)
        self.pinned = None if pinned is None else pinned % num_shards
        self.start: Optional[int] = None
        self.step = 0

    def place(self, others: Sequence[PeerRecord], saved: Optional[dict]) -> str:
        """Choose the start and step; returns why, for the log. `others`: the other live peers' records; `saved`:
        the meta of our checkpoint of this run, if any.

        A restart goes on where its checkpoint left off, wherever its params come from (a peer that read its
        stream again from the start would repeat what it already trained on). A new peer starts inside the widest
        run of shards that no live peer reads now. Peers used to start where their ids hashed to, and two of ten
        then shared a start (identical batches) about half the time."""
        shard = None if saved is None else saved.get("data_shard")
        if saved is not None:
            steps = saved.get("data_step", saved.get("inner_steps", 0))  # older checkpoints: inner_steps
            if _is_count(steps):
                self.step = steps
            else:
                logger.warning("checkpoint: data_step %r is not a step count; reading our stream from its start",
                               steps)
        if self.pinned is not None:
            if _is_count(shard) and shard != self.pinned:
                self.step = 0  # our checkpoint's place was in another stream
            self.start = self.pinned
            return "as --data-shard says"
        if _is_count(shard) and shard < self.num_shards:
            self.start = shard
            return "as our checkpoint says"
        if saved is not None:  # a checkpoint from before shards were chosen: its stream started where our id hashes
            self.start = self.id_hash % self.num_shards
            return "hashed from our peer id, as our checkpoint's stream did"
        reading = _reading(others)
        self.start = choose_data_shard(reading, self.num_shards, self.id_hash)
        return f"inside the widest run of shards no live peer reads (they read {reading})"

    def leave_if_shared(self, others: Sequence[PeerRecord]) -> Optional[Moved]:
        """Peers that join at the same moment choose from the same view (each before the other announced a shard)
        and can start at one shard: their streams are then identical, batch for batch. When another live peer
        announces our start and its id hashes lower than ours, we start a new stream inside the widest unread run
        (of two such peers, exactly one moves); a pinned start stays. Returns what happened, for the log, if we
        moved (a Moved): then batches() must be called again."""
        if self.pinned is not None or self.start is None:
            return None
        rival = next((p for p in others if p.data_start == self.start and peer_id_hash(p.peer_id) < self.id_hash),
                     None)
        if rival is None:
            return None
        reading = _reading(others)
        before, self.start, self.step = self.start, choose_data_shard(reading, self.num_shards, self.id_hash), 0
        return Moved(rival.peer_id, before, f"peer {rival.peer_id} started at shard {before} too (identical "
                     f"batches); moving to shard {self.start}, inside the widest run of shards no live peer reads "
                     f"(they read {reading})")

    def reading(self) -> Optional[int]:
        """The shard we read now (announced), or None before place()."""
        if self.start is None:
            return None
        return self.data.shard_at(self.start, self.num_shards, self.batch_size, self.step)

    def batches(self) -> Iterator[torch.Tensor]:
        """Our batches from `step` on; the caller counts each one it reads in `step`."""
        return self.data.batches(self.start, self.num_shards, self.batch_size, self.seed, start_step=self.step)

    def meta(self) -> dict:
        """What a checkpoint keeps of our place."""
        return {"data_shard": self.start, "data_step": self.step}


def _reading(others: Sequence[PeerRecord]) -> list[int]:
    return sorted(p.data_shard for p in others if p.data_shard is not None)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
