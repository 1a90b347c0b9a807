"""What the bootstrap's status page shows: a bounded in-memory loss-over-rounds history, the JSON document served
at /api/swarm (the swarm view plus that history), and the self-contained HTML page at / that renders it."""

from __future__ import annotations

import json
import math
import statistics
import threading
import time
from collections import OrderedDict
from importlib import resources
from typing import Any, Optional

from swarm.dht.records import TRAINING_STATES
from swarm.dht.view import SwarmSummary

MAX_HISTORY_ROUNDS = 2000  # ~150 KB of JSON: months of hourly rounds, still quick to send on every refresh
REFRESH_SECONDS = 5.0  # how often the page re-reads /api/swarm (the bootstrap re-reads the DHT as often)


class SwarmHistory:
    """Loss and participation per outer round, as the bootstrap saw them in peers' announcements. Only the
    newest `max_rounds` rounds are kept; an entry is updated while peers still report that round."""

    def __init__(self, max_rounds: int = MAX_HISTORY_ROUNDS):
        self.max_rounds = max_rounds
        self._rounds: OrderedDict[int, dict] = OrderedDict()

    def observe(self, summary: SwarmSummary, now: float) -> None:
        by_round: dict[int, list] = {}
        for peer in summary.peers:
            if peer.state in TRAINING_STATES:
                by_round.setdefault(peer.round, []).append(peer)
        # A peer in round R announces the validation loss of the params round R - 1's outer step made (the loss its
        # log line gives for round R - 1), so it goes under R - 1, beside that round's training losses.
        val_by_round: dict[int, list[float]] = {}
        for round_no, peers in by_round.items():
            val = [p.val_loss for p in peers if p.val_loss is not None]
            if val and round_no > 0:
                val_by_round[round_no - 1] = val
        for round_no in sorted(by_round.keys() | val_by_round.keys()):
            entry = self._entry(round_no, now)
            if entry is None:
                continue
            if round_no in by_round:
                peers = by_round[round_no]
                losses = [p.loss for p in peers if p.loss is not None]
                entry.update(last_seen=now, peers=len(peers), tokens_per_s=sum(p.tokens_per_s for p in peers),
                             train_loss_mean=statistics.fmean(losses) if losses else None,
                             train_loss_min=min(losses, default=None), train_loss_max=max(losses, default=None))
            if round_no in val_by_round:
                entry["val_loss_mean"] = statistics.fmean(val_by_round[round_no])
        while len(self._rounds) > self.max_rounds:
            self._rounds.popitem(last=False)

    def _entry(self, round_no: int, now: float) -> Optional[dict]:
        """The history's entry of `round_no`, made if new; None for a round older than everything a full history
        keeps (it would be evicted at once)."""
        if round_no not in self._rounds:
            if self._rounds and round_no < min(self._rounds) and len(self._rounds) >= self.max_rounds:
                return None
            self._rounds[round_no] = {"round": round_no, "first_seen": now, "last_seen": now, "peers": 0,
                                      "tokens_per_s": 0.0, "train_loss_mean": None, "train_loss_min": None,
                                      "train_loss_max": None, "val_loss_mean": None}
            self._rounds = OrderedDict(sorted(self._rounds.items()))
        return self._rounds[round_no]

    def rounds(self) -> list[dict]:
        """Entries oldest first: round, first_seen/last_seen (Unix s), peers, tokens_per_s, train_loss_mean/min/max
        (last inner-step losses reported in the round), val_loss_mean (of the global params its outer step made,
        as the peers' log lines give it for the round; announced once they are in the next round)."""
        return [dict(entry) for entry in self._rounds.values()]


class StatusBoard:
    """The latest swarm view and its history, shared between the bootstrap's refresh loop (writer) and the HTTP
    server's threads (readers)."""

    def __init__(self, run_id: str, recipe_digest: str, bootstrap_peer_id: str,
                 history: Optional[SwarmHistory] = None):
        self.run_id, self.recipe_digest, self.bootstrap_peer_id = run_id, recipe_digest, bootstrap_peer_id
        self.history = history or SwarmHistory()
        self._lock = threading.Lock()
        self._summary: Optional[SwarmSummary] = None
        self._updated_at: Optional[float] = None
        self._error: Optional[str] = None

    def update(self, summary: SwarmSummary, now: Optional[float] = None) -> None:
        now = time.time() if now is None else now
        with self._lock:
            self.history.observe(summary, now)
            self._summary, self._updated_at, self._error = summary, now, None

    def failed(self, error: str) -> None:
        """The last refresh failed: the page shows the previous view with this warning."""
        with self._lock:
            self._error = error

    def payload(self) -> dict:
        """The /api/swarm document: `summary`, exactly what `swarm-peer status --json` prints (null until the first
        DHT read), beside the run's identity, freshness and the loss history."""
        with self._lock:
            summary = status_json(self._summary, self.run_id, self.recipe_digest) if self._summary is not None \
                else None
            return finite({"run_id": self.run_id, "recipe_digest": self.recipe_digest,
                           "bootstrap_peer_id": self.bootstrap_peer_id, "updated_at": self._updated_at,
                           "error": self._error, "refresh_seconds": REFRESH_SECONDS, "summary": summary,
                           "history": self.history.rounds()})


def status_json(summary: SwarmSummary, run_id: str, recipe_digest: str) -> dict:
    """What `swarm-peer status --json` prints, and /api/swarm's `summary`: the run's identity and the summary."""
    return {"run_id": run_id, "recipe_digest": recipe_digest, **summary.to_json()}


def finite(value: Any) -> Any:
    """`value` with every non-finite float replaced by None, so json.dumps writes strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(item) for item in value]
    return value


def to_json_bytes(payload: dict) -> bytes:
    return json.dumps(payload, separators=(",", ":"), allow_nan=False).encode()


def render_page(payload: dict) -> bytes:
    """The status page with `payload` embedded, so it draws at once and then refreshes from /api/swarm."""
    template = resources.files("swarm.monitoring").joinpath("static/status.html").read_text(encoding="utf-8")
    # Inside <script>, "</" could end the element early: escape "<" in the JSON (a peer's strings are untrusted).
    data = json.dumps(payload, separators=(",", ":"), allow_nan=False).replace("<", "\\u003c")
    return template.replace("/*INITIAL_DATA*/null", data, 1).encode("utf-8")
