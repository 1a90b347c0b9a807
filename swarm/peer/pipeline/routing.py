"""Hops between the peers of consecutive stages: `call_stage` sends one microbatch's activations (through a codec,
fp16 by default; both directions metered) and gets their gradient and the loss back; `Router` picks the next
stage's peer for each microbatch at random, weighted by the throughput it measured of each over the microbatches in
flight to it (SWARM's stochastic wiring; integrity.py: an announced rate alone buys no share), checks each answer
against the other peers' and the peer's own (integrity.AnswerCheck: a refused one is not applied, and its peer is
left out), and retries a failed or refused hop on another peer of that stage, so a peer that dies or lies
mid-microbatch costs a retry, never the microbatch: the caller learns of a loss only when no peer of the stage
could take it (PipelineError).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Optional

import msgpack
import numpy as np
import torch

from swarm.compression import decode, get_codec
from swarm.dht.frames import recv_frame, send_frame
from swarm.dht.node import SwarmNode
from swarm.peer.pipeline.integrity import (ANSWER_RULES, EXCLUDE_SECONDS, AnswerCheck, routing_weights, sensitivity,
                                           smoothed)
from swarm.peer.pipeline.worker import Downstream, Evaluate, PipelineError
from swarm.runtime import LoopThread

logger = logging.getLogger(__name__)
BUSY = "busy"  # how a stage server's refusal for a full queue starts (swarm.peer.pipeline.server)


class StageBusy(PipelineError):
    """A stage peer refused a microbatch because its queue is full: the sender tries another, and nothing counts
    against the busy peer."""


class AnswerRefused(PipelineError):
    """A stage peer's answer was far outside the others' or its own (integrity.AnswerCheck): not applied."""


HOP_SECONDS = 60.0  # a hop (send, the rest of the pipeline, the gradient back) that takes longer is retried elsewhere
HEADER_BYTES = 1024
RETRY_AFTER = 30.0  # s a peer that failed a hop is left out of the wiring


def stage_protocol(run_id: str, start: int, end: int) -> str:
    return f"swarm.{run_id}.stage.{start}-{end}"


@dataclass
class WireMeter:
    """Bytes this peer sent and received on stage hops, activations and gradients alike."""

    sent: int = 0
    received: int = 0


async def call_stage(node: SwarmNode, peer: str, protocol: str, x: torch.Tensor, targets: torch.Tensor,
                     codec_name: str, meter: WireMeter, timeout: float = HOP_SECONDS,
                     scale: float = 1.0, evaluate: bool = False) -> tuple[Optional[torch.Tensor], float]:
    """One hop: `x` (activations, shape (b, t, h)) and `targets` (b, t) to `peer`'s stage, `scale` the microbatch's
    share of its batch; its answer: the gradient of `x` (None with `evaluate`: a validation microbatch, forward
    only) and the microbatch's loss. Raises on any failure (the caller retries elsewhere)."""
    codec = get_codec(codec_name)
    payload = codec.encode(x.detach().float().reshape(-1).cpu())
    ids = targets.to("cpu", torch.int32).numpy().tobytes()
    async with asyncio.timeout(timeout):
        reader, writer = await node.open_stream(peer, protocol)
        try:
            await send_frame(writer, msgpack.packb({"shape": list(x.shape), "codec": codec_name, "scale": scale,
                                                    **({"eval": True} if evaluate else {})}))
            await send_frame(writer, payload)
            await send_frame(writer, ids)
            meter.sent += len(payload) + len(ids)
            answer = msgpack.unpackb(await recv_frame(reader, HEADER_BYTES))
            if isinstance(answer, dict) and str(answer.get("error", "")).startswith(BUSY):
                raise StageBusy(f"stage peer {peer[-8:]} refused the microbatch: {answer['error']}")
            if not isinstance(answer, dict) or "error" in answer:
                raise PipelineError(f"stage peer {peer[-8:]} refused the microbatch: "
                                    f"{answer.get('error') if isinstance(answer, dict) else answer!r}")
            loss = answer.get("loss")
            if not isinstance(loss, float) or not np.isfinite(loss) or loss < 0:  # (a cross-entropy)
                raise PipelineError(f"stage peer {peer[-8:]} answered a loss of {loss!r}")
            if evaluate:
                return None, loss
            back = await recv_frame(reader, payload_bound(x.numel()))
            meter.received += len(back)
            grad = decode(back)
            if grad.numel() != x.numel():
                raise PipelineError(f"stage peer {peer[-8:]} answered a gradient of {grad.numel()} values, not "
                                    f"{x.numel()}")
            return grad.reshape(x.shape), loss
        finally:
            writer.close()


def _submitter(loop: "asyncio.AbstractEventLoop | LoopThread") -> Callable[[Awaitable], concurrent.futures.Future]:
    """How a thread other than the loop's starts a coroutine on it: a LoopThread's submit, interruptible (a stop
    signal cancels the hop, or refuses it once the peer is stopping), or run_coroutine_threadsafe on a bare loop."""
    if isinstance(loop, asyncio.AbstractEventLoop):
        return lambda coro: asyncio.run_coroutine_threadsafe(coro, loop)
    return lambda coro: loop.submit(coro, interruptible=True)


def payload_bound(values: int) -> int:
    """The largest payload a codec makes of `values` floats: fp32 and a header."""
    return 4 * values + 4096


@dataclass
class Router:
    """Sends microbatches to the next stage's peers. `peers()` lists them now as (peer id, announced tokens/s); each
    microbatch goes to one drawn with probability proportional to its weight (integrity.routing_weights: the
    tokens/s we measured of its hops, smoothed; an unmeasured peer starts at the median) / (1 + its microbatches in
    flight from us), leaving out peers that failed a hop in the last RETRY_AFTER s and those whose answer `check`
    refused (EXCLUDE_SECONDS), and is retried on another on failure or refusal, up to `attempts` peers."""

    node: SwarmNode
    protocol: str
    peers: Callable[[], list[tuple[str, float]]]
    codec: str = "fp16"
    attempts: int = 3
    timeout: float = HOP_SECONDS
    seed: Optional[int] = None
    meter: WireMeter = field(default_factory=WireMeter)
    in_flight: Counter = field(default_factory=Counter)
    sent_to: Counter = field(default_factory=Counter)
    failed: dict = field(default_factory=dict)  # peer -> when it last failed a hop
    retries: int = 0
    most_in_flight: int = 0  # the most microbatches we had in flight at once
    measured: dict = field(default_factory=dict)  # peer -> tokens/s of its answered hops (smoothed)
    check: AnswerCheck = field(default_factory=lambda: AnswerCheck(ANSWER_RULES))
    refused: int = 0  # answers refused by `check`

    def __post_init__(self) -> None:
        self._random = random.Random(self.seed)

    def hop(self, loop: "asyncio.AbstractEventLoop | LoopThread") -> Downstream:
        """forward() as a blocking call, for a thread other than `loop`'s (a StageWorker's)."""
        send = self.send(loop)

        def hop(out: torch.Tensor, targets: torch.Tensor, scale: float = 1.0) -> tuple[torch.Tensor, float]:
            return send(out, targets, scale).result()

        return hop

    def evaluator(self, loop: "asyncio.AbstractEventLoop | LoopThread") -> Evaluate:
        """A validation microbatch's hop as a blocking call (a thread other than `loop`'s): the loss of the rest
        of the pipeline, forward only."""
        submit = _submitter(loop)

        def evaluate(out: torch.Tensor, targets: torch.Tensor) -> float:
            return submit(self.forward(out, targets, evaluate=True)).result()[1]

        return evaluate

    def send(self, loop: "asyncio.AbstractEventLoop | LoopThread") -> Callable[[torch.Tensor, torch.Tensor, float],
                                                                               concurrent.futures.Future]:
        """forward() started from a thread other than `loop`'s: returns its future at once, so that several
        microbatches can be in flight (swarm/peer/pipeline/microbatches.py). Given a peer's LoopThread, a stop signal
        cancels the hops in flight (LoopThread.cancel_submitted): a first stage waiting on a gradient stops at
        once instead of when the hop times out (HOP_SECONDS, a try on each of `attempts` peers)."""
        submit = _submitter(loop)

        def send(out: torch.Tensor, targets: torch.Tensor, scale: float = 1.0) -> concurrent.futures.Future:
            return submit(self.forward(out, targets, scale))

        return send

    def choose(self, exclude: set[str]) -> Optional[str]:
        now = time.monotonic()
        candidates = [(peer, speed) for peer, speed in self.peers() if peer not in exclude
                      and now - self.failed.get(peer, -RETRY_AFTER) >= RETRY_AFTER
                      and not self.check.is_excluded(peer, now)]
        if not candidates:
            return None
        weights = [weight / (1 + self.in_flight[peer])
                   for (peer, _), weight in zip(candidates, routing_weights(candidates, self.measured))]
        return self._random.choices([peer for peer, _ in candidates], weights)[0]

    async def forward(self, x: torch.Tensor, targets: torch.Tensor, scale: float = 1.0,
                      evaluate: bool = False) -> tuple[Optional[torch.Tensor], float]:
        tried: set[str] = set()
        last_error: Optional[BaseException] = None
        for _ in range(self.attempts):
            peer = self.choose(tried)
            if peer is None:
                break
            tried.add(peer)
            self.in_flight[peer] += 1
            self.most_in_flight = max(self.most_in_flight, sum(self.in_flight.values()))
            try:
                started = time.monotonic()
                answer = await call_stage(self.node, peer, self.protocol, x, targets, self.codec, self.meter,
                                          self.timeout, scale, evaluate)
                self._accept(peer, x, answer, scale)
                if not evaluate:
                    self.sent_to[peer] += 1
                    rate = targets.numel() / max(time.monotonic() - started, 1e-6)
                    self.measured[peer] = smoothed(self.measured.get(peer), rate)
                return answer
            except Exception as e:  # noqa: BLE001 - any failure of the hop: the next peer
                last_error = e
                # (a full queue is no fault: that peer is tried again next time; a refused answer is check's)
                if not isinstance(e, (StageBusy, AnswerRefused)):
                    self.failed[peer] = time.monotonic()
                self.retries += 1
                if isinstance(e, AnswerRefused):  # (logged with its numbers already)
                    continue
                logger.info("stage peer %s failed a microbatch (%s); trying another", peer[-8:],
                            str(e).splitlines()[0] if str(e) else type(e).__name__)
            finally:
                self.in_flight[peer] -= 1
        raise PipelineError(f"no peer of the next stage took the microbatch (tried {len(tried)}"
                            + (f"; last: {last_error}" if last_error else "") + ")")

    def _accept(self, peer: str, x: torch.Tensor, answer: tuple[Optional[torch.Tensor], float], scale: float) -> None:
        """Raise AnswerRefused (one log line with the numbers; `peer` left out) unless `check` accepts the answer."""
        grad, loss = answer
        values = {"loss": loss} if grad is None else {"sensitivity": sensitivity(x, grad, scale), "loss": loss}
        why = self.check.judge(peer, values)
        if why is None:
            return
        self.refused += 1
        self.measured.pop(peer, None)
        if self.check.is_excluded(peer):
            logger.warning("pipeline: refused the answer of stage peer %s and left it out for %.0f s: %s", peer,
                           EXCLUDE_SECONDS, why)
        else:
            logger.info("pipeline: refused the answer of stage peer %s: %s", peer, why)
        raise AnswerRefused(f"stage peer {peer[-8:]}'s answer refused: {why}")
