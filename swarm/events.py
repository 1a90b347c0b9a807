"""A structured event stream: one JSON object a line (`{"event": NAME, "time": UNIX_S, ...fields}`) for each
thing a peer or bootstrap does that a script or a test waits on, written to the file `--events-file` names. Log
lines are for people and may change wording; these events and their fields may only grow.

Peer: joined(peer_id) · check(name, ok, message) · metrics(port) · data_prepared(train_docs, train_tokens,
val_docs, seconds) · model(parameters, blocks, device, replay_log_bytes) · resumed(round, path) · data(shard, step,
resumed, how, others_reading) · data_moved(shard, step, how, rival, from_shard) · synced(round, digest, how:
replay|download, reason, replayed, bytes) · sync_failed(error, moved_on, reason) · stopping(signal) ·
training(round, overlap, client) · no_group(round, attempt) · averaging_failed(round, attempt, reason, suspects,
rejected) · bad_peer(peer_id, reason) · averaged(round, group_size, swarm_size, mix, ring, members, seconds,
bytes_sent, total_weight, val_loss, loss, digest) · recovered(round, reason) · checkpoint(round, path) ·
fault(kind, phase, round) · pipeline(stage, microbatches, taken, trained, pending, retries, refreshed, busy, wall,
span, wire_bytes, tokens; a stage peer, as it stops) · stopped(streams_direct, streams_fallback; forced when the stop
deadline ran out).
Bootstrap: listening(peer_id, maddrs, run_id, metrics_port) · stopped.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, Optional


class EventLog:
    """Appends events to a JSON-lines file; without a path, emit() does nothing. Thread-safe; each line is
    flushed at once, so a reader sees an event as soon as it happened."""

    def __init__(self, path: Optional[str | Path] = None):
        self._lock = threading.RLock()  # (reentrant: a thread that emits while emitting waits on nothing)
        self._file = None
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - closed in close()

    def emit(self, event: str, **fields: Any) -> None:
        if self._file is None:
            return
        line = json.dumps({"event": event, "time": round(time.time(), 3), **fields}, default=str)
        with self._lock:
            if self._file is not None:
                self._file.write(line + "\n")

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def read_events(path: str | Path) -> list[dict]:
    """Every complete event in the file so far (a line still being written is left for the next read)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    events = []
    for line in text.splitlines(keepends=True):
        if line.endswith("\n"):
            events.append(json.loads(line))
    return events
