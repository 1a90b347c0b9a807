"""The live progress line of `swarm-peer join` on a terminal: round, tokens/s, loss, time to the next average
(estimated from the swarm's progress) and peers in the group, redrawn in place with log lines printed above it.
When stdout is not a terminal it draws nothing: the one log line per event stays the whole output."""

from __future__ import annotations

import logging
import shutil
import sys
import threading
import time
from typing import Optional, Sequence, TextIO

from swarm.config import Recipe
from swarm.dht.records import PeerRecord
from swarm.dht.view import at_round, others

CLEAR_LINE = "\r\x1b[K"  # carriage return, then erase to the end of the line


def seconds_to_average(tokens_per_round: int, swarm_tokens: int, swarm_rate: float) -> Optional[float]:
    """Seconds until the swarm's tokens in this round reach `tokens_per_round` at `swarm_rate` tokens/s: 0 when
    already there, None when nothing is training (no estimate)."""
    remaining = tokens_per_round - swarm_tokens
    if remaining <= 0:
        return 0.0
    return remaining / swarm_rate if swarm_rate > 0 else None


def _duration(seconds: Optional[float]) -> str:
    if seconds is None:
        return "?"
    if seconds < 100:
        return f"{seconds:.0f} s"
    if seconds < 6000:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _rate(tokens_per_s: float) -> str:
    return f"{tokens_per_s / 1000:.1f}k" if tokens_per_s >= 1000 else f"{tokens_per_s:.0f}"


def format_progress(state: str, round_no: int, tokens_per_s: float, swarm_rate: float, loss: Optional[float],
                    eta: Optional[float], share: float, peers_in_round: int, last_group_size: Optional[int]) -> str:
    """One line: `round 3 | 1.2k tok/s (swarm 2.4k) | loss 4.123 | next average ~12 s (73%) | 2 peers in round,
    last group 2 | training`. `eta` is seconds to the next average (None: unknown), `share` the round's progress."""
    if state == "averaging":
        average = "averaging now"
    else:
        average = "next average due" if eta == 0 else f"next average ~{_duration(eta)}"
        average += f" ({min(share, 1.0):.0%})"
    group = f"{peers_in_round} peer{'s' if peers_in_round != 1 else ''} in round"
    if last_group_size:
        group += f", last group {last_group_size}"
    loss_text = f"{loss:.3f}" if loss is not None else "-"
    return " | ".join([f"round {round_no}", f"{_rate(tokens_per_s)} tok/s (swarm {_rate(swarm_rate)})",
                       f"loss {loss_text}", average, group, state])


class ProgressLine:
    """A status line redrawn in place on a terminal. Log handlers writing to the same stream are wrapped so a log
    record first erases the line and the line is redrawn under it. On anything that is not a terminal, every
    method does nothing."""

    def __init__(self, stream: Optional[TextIO] = None, min_interval: float = 0.25):
        self.stream = stream if stream is not None else sys.stdout
        self.enabled = _is_terminal(self.stream)
        self.min_interval = min_interval
        self._lock = threading.Lock()
        self._text = ""
        self._state = ""
        self._shown = False
        self._last_draw = 0.0
        self._wrapped: list[tuple[logging.StreamHandler, TextIO]] = []
        if self.enabled:
            for handler in logging.getLogger().handlers:
                if isinstance(handler, logging.StreamHandler) and handler.stream is self.stream:
                    self._wrapped.append((handler, handler.setStream(_AboveTheLine(self))))

    def update(self, *, state: str, round_no: int, tokens_per_s: float, loss: Optional[float], swarm_tokens: int,
               steps_in_round: int, recipe: Recipe, view: Sequence[PeerRecord], peer_id: str,
               last_group_size: Optional[int] = None) -> None:
        """Redraw with the peer's current numbers (at most every `min_interval` seconds unless the state
        changed). `view` is the announcer's swarm view, from which the swarm's rate and peers are read. The next
        average comes when the swarm's tokens reach the recipe's tokens_per_round, or, in a recipe with
        inner_steps_per_round, after that many of our own steps (a fragment's share of either with
        outer.fragments)."""
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._last_draw < self.min_interval and state == self._state:
            return
        self._last_draw, self._state = now, state
        others_in_round = at_round(others(view, peer_id), round_no)
        swarm_rate = tokens_per_s + sum(p.tokens_per_s for p in others_in_round)  # ours live, theirs announced
        if recipe.steps_per_sync():
            tokens_per_step = recipe.data.batch_size * recipe.data.seq_len
            done, target, rate = steps_in_round * tokens_per_step, recipe.steps_per_sync() * tokens_per_step, \
                tokens_per_s
        else:
            done, target, rate = swarm_tokens, recipe.tokens_per_sync(), swarm_rate
        text = format_progress(state, round_no, tokens_per_s, swarm_rate, loss, seconds_to_average(target, done, rate),
                               done / target, len(others_in_round) + 1, last_group_size)
        with self._lock:
            self._text = text
            self._draw()

    def close(self) -> None:
        """Erase the line and give the log handlers their stream back."""
        if not self.enabled:
            return
        with self._lock:
            self._clear()
            self._text = ""
            self.stream.flush()
        for handler, original in self._wrapped:
            handler.setStream(original)
        self._wrapped.clear()
        self.enabled = False

    # Callers hold self._lock.
    def _draw(self) -> None:
        if not self._text:
            return
        width = shutil.get_terminal_size((120, 24)).columns
        self.stream.write(CLEAR_LINE + self._text[:max(width - 1, 10)])  # never wrap: \r must reach its start
        self.stream.flush()
        self._shown = True

    def _clear(self) -> None:
        if self._shown:
            self.stream.write(CLEAR_LINE)
            self._shown = False


class _AboveTheLine:
    """The stream a wrapped log handler writes to: erase the progress line, write the record, redraw the line."""

    def __init__(self, line: ProgressLine):
        self._line = line

    def write(self, text: str) -> int:
        with self._line._lock:
            self._line._clear()
            written = self._line.stream.write(text)
            if text.endswith("\n"):
                self._line._draw()
            return written

    def flush(self) -> None:
        self._line.stream.flush()

    def __getattr__(self, name: str):
        return getattr(self._line.stream, name)


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False
