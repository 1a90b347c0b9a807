"""Hops between the peers of consecutive stages: `call_stage` sends one microbatch's activations (through a codec,
fp16 by default; both directions metered) and gets their gradient and the loss back; `Router` picks the next
stage's peer for each microbatch at random, weighted by the throughput it measured of each over the microbatches in
flight to it (SWARM's stochastic wiring; integrity.py: an announced rate alone buys no share), checks each answer
against the other peers' and the peer's own (integrity.AnswerCheck: a refused one is not applied, and its peer is
left out), and retries a failed or refused hop on another peer of that stage, so a peer that dies or lies
mid-microbatch costs a retry, never the microbatch: the caller learns of a loss only when no peer of the stage
could take it (PipelineError). A share of the training microbatches (`duplicate_share`, and every one a peer answers
until PROBATION of its answers agreed with another's) is also sent to a second peer of the stage, and to a third
when the two answers do not agree (integrity.decide): only an answer another agrees with is applied, and a peer
outvoted is left out with one warning naming it, the microbatch and the numbers.
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
from swarm.peer.pipeline.integrity import (ANSWER_RULES, EXCLUDE_SECONDS, PROBATION, Answer, AnswerCheck, Verdict,
                                           decide, microbatch_id, routing_weights, same_round, sensitivity, smoothed,
                                           tally)
from swarm.peer.pipeline.worker import Downstream, Evaluate, PipelineError
from swarm.runtime import LoopThread
from swarm.words import shown

logger = logging.getLogger(__name__)
BUSY = "busy"  # how a stage server's refusal for a full queue starts (swarm.peer.pipeline.server)
DISPUTED = "activations refused: no two first-stage peers agree"  # how a refusal of disputed activations starts


class StageBusy(PipelineError):
    """A stage peer refused a microbatch because its queue is full: the sender tries another, and nothing counts
    against the busy peer."""


class NoPeerTook(PipelineError):
    """No peer of the next stage took a microbatch. A middle stage's server answers it to its sender as busy: the
    middle peer is not at fault for the stage after it (a stage whose peers it has not found yet, or all left), so
    the sender tries it again next time rather than leaving it out (a start-up race once cost a 4-stage pipeline
    30 s: each stage in turn left out the one after it)."""


class ActivationsDisputed(PipelineError):
    """The stage after the first refused our activations because no two first-stage peers agreed on them
    (recompute.py): a verdict on what we sent (activations of params a round old, as a first round moves them
    far), not a fault of the peer that refused. It counts against that peer only if another takes the same
    microbatch (Router.forward)."""


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
                     codec_name: str, meter: WireMeter, timeout: float = HOP_SECONDS, scale: float = 1.0,
                     evaluate: bool = False, our_round: Optional[int] = None
                     ) -> tuple[Optional[torch.Tensor], float, Optional[int]]:
    """One hop: `x` (activations, shape (b, t, h)) and `targets` (b, t) to `peer`'s stage, `scale` the microbatch's
    share of its batch, `our_round` the round of our stage that computed a training `x` (the server holds `x` to
    what we sent in that round: server.StageServer._judge); its answer: the gradient of `x` (None with `evaluate`: a
    validation microbatch, forward only), the microbatch's loss, and the round of its stage it says it computed them
    in (None: it does not say).
    Raises on any failure (the caller retries elsewhere)."""
    # (the codecs' math runs on a worker thread, not the event loop that carries every peer's streams and the
    # heartbeat, and on the device `x` is on: only the encoded bytes come to the CPU)
    payload = await asyncio.to_thread(get_codec(codec_name).encode, x.detach().float().reshape(-1))
    ids = targets.to("cpu", torch.int32).numpy().tobytes()
    async with asyncio.timeout(timeout):
        reader, writer = await node.open_stream(peer, protocol)
        try:
            await send_frame(writer, msgpack.packb({"shape": list(x.shape), "codec": codec_name, "scale": scale,
                                                    **({"eval": True} if evaluate else {}),
                                                    **({"round": our_round} if our_round is not None else {})}))
            await send_frame(writer, payload)
            await send_frame(writer, ids)
            meter.sent += len(payload) + len(ids)
            answer = msgpack.unpackb(await recv_frame(reader, HEADER_BYTES))
            refusal = refused_with(answer)
            if refusal is not None:
                kind = StageBusy if refusal.startswith(BUSY) else \
                    ActivationsDisputed if refusal.startswith(DISPUTED) else PipelineError
                raise kind(f"stage peer {peer[-8:]} refused the microbatch: {refusal}")
            loss, round_no = answer.get("loss"), answer.get("round")
            if not isinstance(loss, float) or not np.isfinite(loss) or loss < 0:  # (a cross-entropy)
                raise PipelineError(f"stage peer {peer[-8:]} answered a loss of {shown(loss)}")
            if round_no is not None and not round_number(round_no):
                raise PipelineError(f"stage peer {peer[-8:]} answered a round of {shown(round_no)}")
            if evaluate:
                return None, loss, round_no
            back = await recv_frame(reader, payload_bound(x.numel()))
            meter.received += len(back)
            grad = await asyncio.to_thread(decode, back)
            if grad.numel() != x.numel():
                raise PipelineError(f"stage peer {peer[-8:]} answered a gradient of {grad.numel()} values, not "
                                    f"{x.numel()}")
            return grad.reshape(x.shape), loss, round_no
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


def refused_with(answer: object) -> Optional[str]:
    """What a stage peer's answer header says when it refuses: its `error` text as it is (a header is at most
    HEADER_BYTES), or else what it sent quoted within bounds (words.shown: an error of nested lists is no text);
    None if it does not refuse."""
    if isinstance(answer, dict) and "error" not in answer:
        return None
    said = answer.get("error") if isinstance(answer, dict) else answer
    return said if isinstance(said, str) else shown(said)


def round_number(value: object) -> bool:
    """Whether `value`, as a peer wrote it, is a round: an integer of at least 0 (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def size_problem(rows: int, tokens: int, max_tokens: int, max_seq: Optional[int]) -> Optional[str]:
    """Why a microbatch of `rows` rows of `tokens` tokens is too large for a server (None: it is not): over
    `max_tokens` in all, or rows over `max_seq` (attention costs the square of a row's length)."""
    if rows * tokens > max_tokens:
        return f"{rows * tokens} tokens, over the {max_tokens} a microbatch may hold"
    if max_seq is not None and tokens > max_seq:
        return f"rows of {tokens} tokens, over the run's {max_seq}"
    return None


def token_ids(ids: bytes, vocab_size: int) -> Optional[torch.Tensor]:
    """The int32 token ids a peer sent, as int64, or None if one is outside the vocabulary."""
    tokens = torch.from_numpy(np.frombuffer(ids, dtype=np.int32).astype(np.int64))
    return None if tokens.numel() and (tokens.min() < 0 or tokens.max() >= vocab_size) else tokens


@dataclass
class Router:
    """Sends microbatches to the next stage's peers. `peers()` lists them now as (peer id, announced tokens/s); each
    microbatch goes to one drawn with probability proportional to its weight (integrity.routing_weights: the
    tokens/s we measured of its hops, smoothed; an unmeasured peer starts at the median) / (1 + its microbatches in
    flight from us), leaving out peers that failed a hop in the last RETRY_AFTER s and those whose answer `check`
    refused (EXCLUDE_SECONDS), and is retried on another on failure or refusal, up to `attempts` peers. With a
    `duplicate_share` above 0, that share of the training microbatches, and every one a peer answers until PROBATION
    of its answers agreed with another peer's, is computed again by a second peer, and by a third when the two do
    not agree (`_compare`): the next stage computes (and trains on) those microbatches twice or three times."""

    node: SwarmNode
    protocol: str
    peers: Callable[[], list[tuple[str, float]]]
    codec: str = "fp16"
    attempts: int = 3
    timeout: float = HOP_SECONDS
    seed: Optional[int] = None
    duplicate_share: float = 0.0  # the recipe's pipeline.duplicate_share (0: no microbatch is computed twice)
    round: Optional[Callable[[], int]] = None  # our stage's round, which training microbatches say they come from
    meter: WireMeter = field(default_factory=WireMeter)
    in_flight: Counter = field(default_factory=Counter)
    sent_to: Counter = field(default_factory=Counter)  # peer -> microbatches whose answer we took from it first
    failed: dict = field(default_factory=dict)  # peer -> when it last failed a hop
    retries: int = 0
    most_in_flight: int = 0  # the most microbatches we had in flight at once
    measured: dict = field(default_factory=dict)  # peer -> tokens/s of its answered hops (smoothed)
    check: AnswerCheck = field(default_factory=lambda: AnswerCheck(ANSWER_RULES))
    refused: int = 0  # answers refused by `check`
    verified: Counter = field(default_factory=Counter)  # peer -> its answers that agreed with another peer's
    odd_rounds: Counter = field(default_factory=Counter)  # peer -> its answers in a row of a round the others' weren't
    rounds: dict = field(default_factory=dict)  # peer -> the round its last training answer claimed
    garbage: bool = False  # a drill (--inject-fault garbage-act): send noise of the activations' norm instead
    duplicated: int = 0  # hops sent to compare answers (second and third peers)
    compared: int = 0  # microbatches whose answers were compared
    disputed: int = 0  # of them, those no two peers agreed on (nothing applied)
    outvoted: int = 0  # peers left out for disagreeing with two that agree

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

    def send(self, loop: "asyncio.AbstractEventLoop | LoopThread", evaluate: bool = False
             ) -> Callable[[torch.Tensor, torch.Tensor, float], concurrent.futures.Future]:
        """forward() started from a thread other than `loop`'s: returns its future at once, so that several
        microbatches can be in flight (swarm/peer/pipeline/microbatches.py); with `evaluate`, validation ones (the
        future's answer: None and the loss). Given a peer's LoopThread, a stop signal cancels the hops in flight
        (LoopThread.cancel_submitted): a first stage waiting on a gradient stops at once instead of when the hop
        times out (HOP_SECONDS, a try on each of `attempts` peers)."""
        submit = _submitter(loop)

        def send(out: torch.Tensor, targets: torch.Tensor, scale: float = 1.0) -> concurrent.futures.Future:
            return submit(self.forward(out, targets, scale, evaluate=evaluate))

        return send

    def choose(self, exclude: set[str], round_no: Optional[int] = None) -> Optional[str]:
        """A peer of the next stage for a microbatch, not one of `exclude` (see the class); with `round_no`, one whose
        last answer claimed that round where there is one (an answer to compare with is then of the same round)."""
        now = time.monotonic()
        candidates = [(peer, speed) for peer, speed in self.peers() if peer not in exclude
                      and now - self.failed.get(peer, -RETRY_AFTER) >= RETRY_AFTER
                      and not self.check.is_excluded(peer, now)]
        if round_no is not None:
            candidates = [c for c in candidates if self.rounds.get(c[0]) == round_no] or candidates
        if not candidates:
            return None
        weights = [weight / (1 + self.in_flight[peer])
                   for (peer, _), weight in zip(candidates, routing_weights(candidates, self.measured))]
        return self._random.choices([peer for peer, _ in candidates], weights)[0]

    async def forward(self, x: torch.Tensor, targets: torch.Tensor, scale: float = 1.0,
                      evaluate: bool = False) -> tuple[Optional[torch.Tensor], float]:
        tried: set[str] = set()
        last_error: Optional[BaseException] = None
        if self.garbage and not evaluate:
            noise = torch.randn(x.shape, dtype=torch.float32)
            x = (noise * (float(x.detach().float().norm()) / float(noise.norm().clamp_min(1e-30)))).to(x)
        disputed: list[str] = []  # peers that refused these activations as disputed
        for _ in range(self.attempts):
            peer = self.choose(tried)
            if peer is None:
                break
            tried.add(peer)
            try:
                grad, loss, round_no = await self._ask(peer, x, targets, scale, evaluate)
            except Exception as e:  # noqa: BLE001 - any failure of the hop: the next peer
                last_error = e
                self.retries += 1
                self._failed(peer, e)
                if isinstance(e, ActivationsDisputed):
                    disputed.append(peer)
                continue
            for other in disputed:  # another took what they refused: a refusal like any other failed hop
                self.failed[other] = time.monotonic()
            if evaluate:
                return None, loss
            self.sent_to[peer] += 1
            first = Answer(peer, grad, loss, round_no)
            if not self._duplicates(peer):
                return grad, loss
            return await self._compare(first, x, targets, scale, tried)
        raise NoPeerTook(f"no peer of the next stage took the microbatch (tried {len(tried)}"
                            + (f"; last: {last_error}" if last_error else "") + ")")

    async def _ask(self, peer: str, x: torch.Tensor, targets: torch.Tensor, scale: float,
                   evaluate: bool = False) -> tuple[Optional[torch.Tensor], float, Optional[int]]:
        """One hop to `peer` (call_stage), its answer accepted by `check` (or AnswerRefused, as when `peer` was left
        out while the hop was in flight) and its rate measured."""
        self.in_flight[peer] += 1
        self.most_in_flight = max(self.most_in_flight, sum(self.in_flight.values()))
        try:
            started = time.monotonic()
            ours = self.round() if self.round is not None and not evaluate else None
            grad, loss, round_no = await call_stage(self.node, peer, self.protocol, x, targets, self.codec,
                                                    self.meter, self.timeout, scale, evaluate, ours)
            if self.check.is_excluded(peer):  # (left out while this hop was in flight: by another microbatch's check)
                raise AnswerRefused(f"stage peer {peer[-8:]} was left out while its answer was in flight")
            self._accept(peer, x, (grad, loss), scale)
            if not evaluate:
                if round_no is not None:
                    self.rounds[peer] = round_no
                rate = targets.numel() / max(time.monotonic() - started, 1e-6)
                self.measured[peer] = smoothed(self.measured.get(peer), rate)
            return grad, loss, round_no
        finally:
            self.in_flight[peer] -= 1

    def _failed(self, peer: str, error: BaseException) -> None:
        """Bookkeeping of a hop to `peer` that failed: left out RETRY_AFTER s, unless its queue was full (no fault:
        tried again next time), it refused our activations as disputed (see forward) or `check` refused its answer
        (logged with its numbers already)."""
        if not isinstance(error, (StageBusy, AnswerRefused, ActivationsDisputed)):
            self.failed[peer] = time.monotonic()
        if isinstance(error, AnswerRefused):
            return
        logger.info("stage peer %s failed a microbatch (%s); trying another", peer[-8:],
                    str(error).splitlines()[0] if str(error) else type(error).__name__)

    def _duplicates(self, peer: str) -> bool:
        """Whether `peer`'s answer to this microbatch is compared with another peer's: while fewer than PROBATION of
        its answers agreed with another's, and then a `duplicate_share` of them, drawn at random."""
        if self.duplicate_share <= 0:
            return False
        return self.verified[peer] < PROBATION or self._random.random() < self.duplicate_share

    async def _another(self, exclude: set[str], x: torch.Tensor, targets: torch.Tensor, scale: float,
                       round_no: Optional[int]) -> Optional[Answer]:
        """The answer of one more peer of the next stage, not one of `exclude`, to the same microbatch (one last seen
        in `round_no` where there is one); None when there is none to ask, or its hop fails or is refused (one try:
        the comparison is what is lost)."""
        peer = self.choose(exclude, round_no)
        if peer is None:
            return None
        self.duplicated += 1
        try:
            grad, loss, round_no = await self._ask(peer, x, targets, scale)
        except Exception as e:  # noqa: BLE001 - a hop that failed compares nothing
            self._failed(peer, e)
            return None
        return Answer(peer, grad, loss, round_no)

    async def _compare(self, first: Answer, x: torch.Tensor, targets: torch.Tensor, scale: float,
                       tried: set[str]) -> tuple[torch.Tensor, float]:
        """`first`, an accepted answer, against a second peer's to the same microbatch, and a third's when those two
        do not agree (integrity.decide): returns the answer two agree on. Raises PipelineError, with nothing
        applied, when no two agree (or only two answered and disagree: nobody can tell who lies). Without a second
        peer to ask, or when its hop fails, `first` stands."""
        asked = tried | {first.peer}
        second = await self._another(asked, x, targets, scale, first.round)
        if second is None:
            return first.grad, first.loss
        self.compared += 1
        verdict = decide(first, second)
        if verdict.use is None:
            third = await self._another(asked | {second.peer}, x, targets, scale, first.round)
            if third is None and not same_round(first, second):  # (nothing to compare with: `first` stands, as
                return first.grad, first.loss                      # without a second peer)
            verdict = decide(first, second, third) if third is not None else verdict
        # (named only where there is something to say about it: the hash reads all of the activations)
        settled = verdict.use is not None and verdict.outvoted is None and verdict.odd_round is None
        microbatch = "" if settled else microbatch_id(x, targets)
        self._settle(verdict, microbatch)
        if verdict.use is None:
            self.disputed += 1
            logger.info("pipeline: no two stage peers agree on microbatch %s, nothing applied: %s", microbatch,
                        verdict.evidence)
            raise PipelineError(f"no two peers of the next stage agree on the microbatch ({verdict.evidence})")
        return verdict.use.grad, verdict.use.loss

    def _settle(self, verdict: Verdict, microbatch: str) -> None:
        """What a comparison of answers says about their peers: agreed (their probation advances), outvoted (left out
        at once, with the evidence), or of a round the others were not in (not used; left out at ROUND_STRIKES in a
        row of rounds far from theirs)."""
        if verdict.outvoted is not None and not self.check.is_excluded(verdict.outvoted):
            self.outvoted += 1
        tally(verdict, microbatch, self.verified, self.odd_rounds, self._leave_out)
        if verdict.odd_round is not None and not self.check.is_excluded(verdict.odd_round):
            logger.info("pipeline: stage peer %s's answer to microbatch %s was of another round, not compared: %s",
                        verdict.odd_round, microbatch, verdict.evidence)

    def _leave_out(self, peer: str, why: str) -> None:
        if self.check.is_excluded(peer):  # (settled on two microbatches in flight at once: one warning is enough)
            return
        self.check.exclude(peer, why)
        self.measured.pop(peer, None)
        self.verified.pop(peer, None)
        self.odd_rounds.pop(peer, None)
        self.rounds.pop(peer, None)
        logger.warning("pipeline: left out stage peer %s for %.0f s: %s", peer, EXCLUDE_SECONDS, why)

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
