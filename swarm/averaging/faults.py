"""Deterministic fault injection for tests and drills: `--inject-fault PHASE@ROUND` makes this peer SIGKILL itself
at a named phase of the first round numbered ROUND or later that it averages in, or send a named kind of bad data
from that round on, so tests can assert exactly what survivors end with and that the fault really fired. ("Or
later": a peer that missed round ROUND, e.g. because a slow start left it out and it re-synced past it, still
fires, and says in which round.)"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import sys
from typing import Optional

logger = logging.getLogger(__name__)
KILL_PHASES = ("matchmaking", "send", "reduce", "commit", "ring", "serve")  # ring: while sending along a ring only;
# serve: while answering another peer's state request
BAD_DATA = ("garbage", "nan", "short", "ring-garbage", "scaled", "flipped", "inflated", "lying-reducer", "reject-all")
# ring-garbage: garbage along a ring only; scaled (x SCALE) and flipped (x -1): a well-formed contribution of lying
# values, averages left honest; inflated: scaled, and declaring the most weight the swarm accepts (four rounds'
# tokens); lying-reducer: honest contributions, but the part it reduces averaged x SCALE, with the most convincing
# verification reports it can make (every member's term as it is, its own made up to cancel the rest); reject-all:
# as a reducer, it names every other member as having sent bad data (its part averaged over itself alone)
LYING_VALUES = ("scaled", "flipped", "inflated")
ACCUSING = ("accuse-all", "accuse-one")  # in every matchmaking entry, name every other peer of the round (accuse-one:
# the first by peer id of those in the round when it first fires, the same victim from then on) as one to keep apart
# from
TAMPERING = ("unverified-entry", "foreign-digest", "inflated-swarm-size")  # what matchmaking writes, rewritten:
# unverified-entry: its entries carry no nonce commitment and declare the largest bandwidth a reader accepts;
# foreign-digest: its entries declare a state digest of its own (drawn from its real one, so colluders agree);
# inflated-swarm-size: the groups it leads are published with a swarm size of 2^20 (each member's lr at its floor)
# A pipeline stage server's answers, from the start (the round is ignored): scale-grad: the input-gradients it sends
# back x1000; low-loss: its losses / 1000; garbage-grad: random input-gradients of the honest ones' shape and norm, its
# losses honest (swarm.peer.pipeline.server.LIES)
# garbage-act: as a sender (a first-stage peer), noise of its activations' norm in place of its training activations
PIPELINE_LIES = ("scale-grad", "low-loss", "garbage-grad", "garbage-act")
LIED_BANDWIDTH = 1e11  # bytes/s: matchmaking.MAX_BANDWIDTH, the most an entry may declare
LIED_SWARM_SIZE = 1 << 20
SCALE = 1000.0
LOCAL = ("diverge", "explode", "slow")  # the peer's own training goes wrong: NaN params, or an absurd pseudo-gradient;
# slow: from then on it computes SLOWDOWN times slower, as a weaker device would (pipeline stages: rebalancing drills)
SLOWDOWN = 4.0
SERVING = ("corrupt-data",)  # the dataset files it serves other peers have every byte flipped


class FaultPlan:
    """What --inject-fault asked for; each fault that fires is printed and, with `events` (an EventLog), written
    as a `fault` event (written, and flushed, before a SIGKILL)."""

    def __init__(self, spec: Optional[str] = None, events=None):
        self.events = events
        self.phase: Optional[str] = None
        self.round = -1
        if spec:
            phase, _, round_text = spec.partition("@")
            kinds = KILL_PHASES + BAD_DATA + LOCAL + SERVING + ACCUSING + TAMPERING + PIPELINE_LIES
            if phase not in kinds or not round_text.isdigit():
                raise ValueError(f"--inject-fault {spec!r}: expected PHASE@ROUND with PHASE one of {', '.join(kinds)}")
            self.phase, self.round = phase, int(round_text)
        self._local_fired = False
        self._victim = ""  # accuse-one's

    def maybe_die(self, phase: str, round_no: int) -> None:
        if self.phase == phase and round_no >= self.round >= 0:
            print(f"FAULT INJECTED: SIGKILL at {phase} of round {round_no}", flush=True)
            sys.stdout.flush()
            if self.events is not None:
                self.events.emit("fault", kind="sigkill", phase=phase, round=round_no)
            os.kill(os.getpid(), signal.SIGKILL)

    def local(self, kind: str, round_no: int) -> bool:
        """Whether to break this peer's own training now, the `kind` way (once, in the first round >= ROUND)."""
        if self.phase == kind and round_no >= self.round >= 0 and not self._local_fired:
            self._local_fired = True
            print(f"FAULT INJECTED: {kind} in round {round_no}", flush=True)
            if self.events is not None:
                self.events.emit("fault", kind=kind, phase=kind, round=round_no)
            return True
        return False

    def declared_weight(self, honest: int, most: int, round_no: int) -> int:
        """The weight to declare: `honest`, or (inflated) `most`, the most the swarm accepts."""
        return most if self.phase == "inflated" and round_no >= self.round >= 0 else honest

    def accusations(self, honest: set[str], others: set[str], round_no: int) -> set[str]:
        """The peers to name as kept apart from: `honest` (those that failed us), or (accuse-all) all `others`, or
        (accuse-one) the first of `others` by peer id when it first fires, the same peer every attempt after."""
        if self.phase not in ACCUSING or round_no < self.round or self.round < 0 or not others:
            return honest
        if self.phase == "accuse-one":
            self._victim = self._victim or min(others)  # the same one from then on, whoever else comes and goes
        named = set(others) if self.phase == "accuse-all" else {self._victim}
        self._fired("accusation", round_no, accused=sorted(named - honest))
        return honest | named

    @property
    def tampers(self) -> bool:
        """Whether matchmaking must hand what it writes to `tamper` (a TAMPERING fault was asked for)."""
        return self.phase in TAMPERING

    def tamper(self, message: str, value: dict, round_no: int, attempt: int) -> dict:
        """What to write instead of `value`, our matchmaking `message` ("entry": our entry of an attempt; "final":
        the group we publish as its leader): `value` itself unless a TAMPERING fault rewrites that message."""
        if self.phase not in TAMPERING or round_no < self.round or self.round < 0:
            return value
        if message == "entry" and self.phase == "unverified-entry":
            value = {**{k: v for k, v in value.items() if k != "commitment"}, "bandwidth": LIED_BANDWIDTH}
        elif message == "entry" and self.phase == "foreign-digest":
            value = {**value, "digest": hashlib.sha256(f"foreign|{value['digest']}".encode()).hexdigest()[:16]}
        elif message == "final" and self.phase == "inflated-swarm-size":
            value = {**value, "swarm_size": LIED_SWARM_SIZE}
        else:
            return value
        self._fired(message, round_no, attempt=attempt)
        return value

    def _fired(self, phase: str, round_no: int, **detail) -> None:
        """Say that our fault rewrote what we send at `phase` (every time: these fire each attempt)."""
        told = "".join(f", {name} {value}" for name, value in detail.items())
        print(f"FAULT INJECTED: {self.phase} ({phase}) in round {round_no}{told}", flush=True)
        if self.events is not None:
            self.events.emit("fault", kind=self.phase, phase=phase, round=round_no, **detail)

    def stage_lie(self) -> Optional[str]:
        """The lie this peer's stage tells (PIPELINE_LIES: in its answers, or its activations), or None."""
        return self.phase if self.phase in PIPELINE_LIES else None

    def serves_corrupt_data(self) -> bool:
        return self.phase == "corrupt-data"

    def bad_data(self, round_no: int, ring: bool = False) -> Optional[str]:
        """The bad data to send in an all-reduce of `round_no` that starts now (None: honest data)."""
        if self.phase in BAD_DATA and round_no >= self.round >= 0:
            if self.phase == "ring-garbage" and not ring:
                return None
            self._fired("allreduce", round_no)
            return "garbage" if self.phase == "ring-garbage" else self.phase
        return None
