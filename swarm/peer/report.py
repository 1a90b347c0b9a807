"""What a peer reports of an averaged round: its metrics, log line and event, and (`--trace-dir`) a trace of the
round's pseudo-gradient, average and global params before and after, as safetensors with the group and weights in
JSON beside them, so a test or an auditor can recompute the exact mean and the outer step from what peers wrote."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import save_file

logger = logging.getLogger("swarm.peer")


PHASES = ("prepare", "announce", "matchmaking", "allreduce", "verification", "outer_step", "validation", "digest",
          "checkpoint")
PHASE_NAMES = {"allreduce": "all-reduce", "outer_step": "outer step"}


class Timeline:
    """The seconds a round spent in each phase besides computing (PHASES; the averager's three, then the training
    thread's), timed as laps from one to the next."""

    def __init__(self, phases: dict[str, float], clock=time.monotonic):
        self.phases, self.clock = dict.fromkeys(PHASES, 0.0) | dict(phases), clock
        self._since = clock()

    def add(self, phase: str, seconds: float) -> None:
        self.phases[phase] += seconds
        self._since = self.clock()

    def lap(self, phase: str) -> None:
        """Count the time since the last lap toward `phase`."""
        now = self.clock()
        self.phases[phase] += now - self._since
        self._since = now

    def done(self, clock, diloco) -> dict:
        """The round's timeline: its wall time and compute from the last round's report to this one (StepClock.lap),
        its phases, and what the state's hash took on its own thread (beside validation: its wait is `digest`)."""
        wall, compute = clock.lap()
        return {"round_seconds": round(wall, 3), "compute_seconds": round(compute, 3),
                "phases": {k: round(v, 3) for k, v in self.phases.items()},
                "hash_seconds": round(diloco.digest_seconds, 3)}


def report_round(averaged, *, metrics, events, uses_ring: bool, wire_per_param: float,
                 round_now: int, loss: Optional[float], val_loss: Optional[float], digest: str,
                 timeline: dict) -> None:
    """Metrics, the log line and the `averaged` event of an applied round (`averaged`: rounds.Averaged);
    `round_now` is our round after its outer step, `wire_per_param` the codec's bytes a value and `timeline`
    Timeline.done's."""
    result, group, round_no = averaged.result, averaged.group, averaged.contribution.round_no
    phases = timeline["phases"]
    for phase, seconds in phases.items():
        metrics.round_phase_seconds.labels(phase=phase).set(seconds)
    metrics.round_compute_seconds.set(timeline["compute_seconds"])
    metrics.round_peers.set(group.swarm_size)
    if group.mix:
        wire_per_param = (wire_per_param + 2 * 4.0) / 3  # params and momentum travel as fp32
    metrics.record_allreduce(result.bytes_sent, result.bytes_received, result.seconds, result.group_size,
                             wire_per_param)
    metrics.outer_round.set(round_now)
    if val_loss is not None:  # (a stage's peer evaluates nothing; a round without one keeps the last: NaN at first)
        metrics.val_loss.set(val_loss)
    metrics.round_seconds.set(timeline["round_seconds"])
    rest = ", ".join(f"{PHASE_NAMES.get(phase, phase)} {seconds:.1f} s" for phase, seconds in phases.items()
                     if phase not in ("matchmaking", "allreduce"))
    logger.info("round %d: averaged %s%s in %.2f s (%.1f MB sent, %d tokens), matchmaking %.1f s; "
                "val loss %s, train loss %.4f, digest %s; round %.1f s: compute %.1f s, %s", round_no,
                "alone" if result.group_size == 1 else f"with {result.group_size} peers",
                f" (one of the groups of {group.swarm_size} peers, params mixed)" if group.mix else
                f" (one of the groups of {group.swarm_size} peers)" if group.swarm_size > result.group_size
                else " along a ring" if uses_ring else "", result.seconds, result.bytes_sent / 1e6,
                int(result.total_weight), phases["matchmaking"], "-" if val_loss is None else f"{val_loss:.4f}",
                loss or float("nan"), digest, timeline["round_seconds"], timeline["compute_seconds"], rest)
    events.emit("averaged", round=round_no, group_size=result.group_size, swarm_size=group.swarm_size, mix=group.mix,
                ring=uses_ring, members=list(group.members), seconds=round(result.seconds, 3),
                bytes_sent=result.bytes_sent, total_weight=result.total_weight, val_loss=val_loss, loss=loss,
                digest=digest, **timeline)


def write_trace(directory: str | Path, peer_id: str, averaged, global_before: torch.Tensor, average: torch.Tensor,
                mixed_state: Optional[torch.Tensor], global_after: torch.Tensor, loss: Optional[float],
                val_loss: Optional[float], digest: str) -> None:
    """Write round-NNNNNN.safetensors and round-NNNNNN.json for one applied round (`averaged`: rounds.Averaged)."""
    contribution, result, group = averaged.contribution, averaged.result, averaged.group
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    name = f"round-{contribution.round_no:06d}"
    tensors = {"pseudo_gradient": contribution.pseudo_gradient.contiguous(), "average": average.contiguous(),
               "global_before": global_before, "global_after": global_after}
    if mixed_state is not None:
        tensors["mixed_state"] = mixed_state.contiguous()  # the group's average of params and momentum
    save_file(tensors, str(directory / f"{name}.safetensors"))
    (directory / f"{name}.json").write_text(json.dumps({
        "peer_id": peer_id, "round": contribution.round_no, "weight": contribution.weight,
        "members": list(group.members), "shares": list(group.shares), "clients": list(group.clients),
        "weights": list(group.weights), "group_id": group.group_id, "mix": group.mix, "swarm_size": group.swarm_size,
        "total_weight": result.total_weight, "loss": loss, "val_loss": val_loss, "digest": digest}))
