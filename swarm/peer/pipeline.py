"""Microbatches through pipelines of peers (SWARM parallelism): a peer hosting a stage (swarm.peer.stages) runs each
microbatch through its blocks, hands the activations to a peer of the next stage over a direct stream, and
backpropagates the gradient that comes back; the last stage computes the loss. Every hop goes through a codec
(fp16 by default), and both directions are metered.

`StageWorker` runs one stage: forward, the downstream hop (or the loss), backward, clip, optimizer step, one
microbatch at a time (a first stage streams its batches' microbatches instead: swarm/peer/microbatches.py), each
scaled by its share of its batch, and a serving stage steps once per batch's worth of rows, so the gradient of a
batch is the same however it was cut. `StageServer` serves it to the previous stage on
the run's stage protocol. `Router` picks the next stage's peer for each microbatch at random, weighted by announced
throughput over the microbatches in flight to it (SWARM's stochastic wiring), and retries a failed hop on another
peer of that stage, so a peer that dies mid-microbatch costs a retry, never the microbatch: the caller learns of a
loss only when no peer of the stage could take it (PipelineError).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import random
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Optional

import msgpack
import numpy as np
import torch
import torch.nn.functional as F

from swarm.compression import decode, get_codec
from swarm.dht.frames import recv_frame, send_frame
from swarm.dht.node import SwarmNode
from swarm.peer.stages import Stage
from swarm.runtime import LoopThread

logger = logging.getLogger(__name__)

HOP_SECONDS = 60.0  # a hop (send, the rest of the pipeline, the gradient back) that takes longer is retried elsewhere
HEADER_BYTES = 1024
RETRY_AFTER = 30.0  # s a peer that failed a hop is left out of the wiring


class PipelineError(RuntimeError):
    """No peer of the next stage could take a microbatch."""


def stage_protocol(run_id: str, start: int, end: int) -> str:
    return f"swarm.{run_id}.stage.{start}-{end}"


# (activations, targets, the microbatch's share of its batch) -> (their gradient, the microbatch's loss)
Downstream = Callable[[torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, float]]
Execute = Callable[[torch.Tensor, torch.Tensor, float], Awaitable[tuple[torch.Tensor, float]]]
Evaluate = Callable[[torch.Tensor, torch.Tensor], float]  # (activations, targets) -> the rest of the pipeline's loss


class StageWorker:
    """One hosted stage and its inner optimizer. `lr()` gives the learning rate of the next step; gradients are
    clipped to `grad_clip` (this stage's own norm: it sees no other stage's gradients)."""

    def __init__(self, stage: Stage, optimizer: torch.optim.Optimizer, lr: Callable[[], float], grad_clip: float):
        self.stage, self.optimizer, self.lr, self.grad_clip = stage, optimizer, lr, grad_clip
        self.lock = threading.Lock()  # one microbatch at a time; also what an outer step takes to change params
        self.microbatches = 0
        self.tokens = 0
        self.frozen = False  # answer microbatches (gradients of their inputs) without changing our params
        self.step_rows: Optional[int] = None  # step once this many rows' gradients are in (None: every microbatch)
        self._rows = 0
        self.busy = 0.0  # seconds computing (forward, backward, steps), not waiting for the next stage
        self.first_at: Optional[float] = None  # (time.perf_counter) when it first computed, and last did
        self.last_at = 0.0
        self.slowdown = 1.0  # > 1: every computation takes this many times as long (--inject-fault slow@R)
        # Where the stage computes: what comes off the wire (token ids, activations, gradients, targets) is on the
        # CPU, so it goes there first, and what goes back on the wire comes back to the CPU.
        self.device = next(stage.parameters()).device

    def step(self, x: torch.Tensor, targets: torch.Tensor, downstream: Optional[Downstream],
             scale: float = 1.0) -> tuple[Optional[torch.Tensor], float]:
        """Run a microbatch: `x` token ids (first stage) or the previous stage's activations, `targets` the next
        tokens, `scale` its share of its batch (its loss counts that much). The last stage takes the loss; the
        others pass their output to `downstream`, which returns its gradient and the loss. Returns (the gradient
        of `x`, None on the first stage; the loss). Raises what `downstream` raises, with nothing applied."""
        with self.lock:
            started = time.perf_counter()
            x = x.to(self.device)
            inputs = x if self.stage.first else x.detach().requires_grad_(True)
            out = self.stage(inputs)
            if self.stage.last:
                loss_tensor = F.cross_entropy(out.reshape(-1, out.shape[-1]).float(),
                                              targets.to(self.device).reshape(-1))
                (loss_tensor * scale).backward()
                loss = float(loss_tensor.detach())
            else:
                self.computed(started)
                grad, loss = downstream(out.detach(), targets, scale)
                started = time.perf_counter()
                self._backward(out, grad)
            if self.frozen:
                self.stage.zero_grad(set_to_none=True)
            else:
                self._rows += x.shape[0]
                if self.step_rows is None or self._rows >= self.step_rows:
                    self._apply()
                self.microbatches += 1
                self.tokens += targets.numel()
            self.computed(started)
            return (None if self.stage.first else inputs.grad.detach().cpu()), loss

    def evaluate(self, x: torch.Tensor, targets: torch.Tensor, downstream: Optional[Evaluate]) -> float:
        """A microbatch's loss through this stage and the rest of the pipeline (`downstream`: the next hop's loss),
        with no gradient and no step: the validation loss of the pipeline as its stages' params stand."""
        with self.lock, torch.no_grad():
            was_training = self.stage.training
            self.stage.eval()
            try:
                out = self.stage(x.to(self.device))
            finally:
                self.stage.train(was_training)
        if self.stage.last:
            return float(F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), targets.to(self.device).reshape(-1)))
        return downstream(out, targets)

    def computed(self, started: float) -> None:
        """Count the time since `started` (time.perf_counter) as computing."""
        now = time.perf_counter()
        if self.slowdown > 1:  # a weaker device: it is busy that much longer
            time.sleep((now - started) * (self.slowdown - 1))
            now = time.perf_counter()
        self.busy += now - started
        self.first_at = started if self.first_at is None else self.first_at
        self.last_at = now

    def _backward(self, out: torch.Tensor, grad: torch.Tensor) -> None:
        if grad.shape != out.shape or not torch.isfinite(grad).all():
            self.stage.zero_grad(set_to_none=True)
            raise PipelineError("the next stage returned a gradient of the wrong shape or not finite")
        out.backward(grad.to(out.device, out.dtype))

    def _apply(self) -> None:
        """Clip and step on the gradients gathered since the last step."""
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr()
        torch.nn.utils.clip_grad_norm_(self.stage.parameters(), self.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._rows = 0


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
            if not isinstance(answer, dict) or "error" in answer:
                raise PipelineError(f"stage peer {peer[-8:]} refused the microbatch: "
                                    f"{answer.get('error') if isinstance(answer, dict) else answer!r}")
            loss = answer.get("loss")
            if not isinstance(loss, float) or not np.isfinite(loss):
                raise PipelineError(f"stage peer {peer[-8:]} answered a loss of {loss!r}")
            if evaluate:
                return None, loss
            back = await recv_frame(reader, _bound(x.numel()))
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


def _bound(values: int) -> int:
    """The largest payload a codec makes of `values` floats: fp32 and a header."""
    return 4 * values + 4096


class StageServer:
    """Serves a middle or last stage to peers of the stage before: each request is a microbatch's activations and
    targets; the answer is the gradient of the activations and the loss. Requests larger than `max_tokens` tokens
    of `hidden` values, or of another shape, or with targets outside the vocabulary, are refused with a reason;
    the worker runs in a thread of its own, so the event loop keeps serving. `downstream` (middle stages) is the
    next hop, called from that thread."""

    def __init__(self, worker: StageWorker, hidden: int, max_tokens: int, vocab_size: int,
                 loop: asyncio.AbstractEventLoop, downstream: Optional["Router"] = None,
                 timeout: float = HOP_SECONDS, execute: Optional[Execute] = None,
                 execute_eval: Optional[Callable[[torch.Tensor, torch.Tensor], Awaitable[float]]] = None):
        if worker.stage.first:
            raise ValueError("the first stage reads data; it serves no microbatches")
        self.worker, self.hidden, self.max_tokens, self.vocab_size = worker, hidden, max_tokens, vocab_size
        self.loop, self.downstream, self.timeout = loop, downstream, timeout
        # Where the worker runs a microbatch: by default in a thread of the loop's executor; a peer hands it to its
        # training thread instead (swarm/peer/staged.py), which also takes its outer steps.
        self.execute = execute or self._in_executor
        self.execute_eval = execute_eval or self._eval_in_executor
        self.meter = WireMeter()
        self.refused: Counter = Counter()

    async def handle(self, remote: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(self.timeout):
                header = msgpack.unpackb(await recv_frame(reader, HEADER_BYTES))
                shape = header.get("shape") if isinstance(header, dict) else None
                codec = header.get("codec") if isinstance(header, dict) else None
                scale = header.get("scale", 1.0) if isinstance(header, dict) else None
                evaluate = header.get("eval", False) if isinstance(header, dict) else None
                problem = self._check(shape, codec) or (
                    None if isinstance(scale, float) and 0.0 < scale <= 1.0 else f"scale {scale!r} is not in (0, 1]") \
                    or (None if isinstance(evaluate, bool) else f"eval {evaluate!r} is not true or false")
                if problem is not None:
                    self.refused[problem] += 1
                    await send_frame(writer, msgpack.packb({"error": problem}))
                    return
                b, t, h = shape
                payload = await recv_frame(reader, _bound(b * t * h))
                ids = await recv_frame(reader, 4 * b * t)
                self.meter.received += len(payload) + len(ids)
                try:
                    x = decode(payload)
                except ValueError:  # CodecError: not a payload of any codec
                    x = torch.zeros(0)
                targets = torch.from_numpy(np.frombuffer(ids, dtype=np.int32).astype(np.int64)) \
                    if len(ids) == 4 * b * t else None
                if x.numel() != b * t * h or targets is None or not torch.isfinite(x).all() or \
                        targets.min() < 0 or targets.max() >= self.vocab_size:
                    self.refused["malformed"] += 1
                    await send_frame(writer, msgpack.packb({"error": "activations or targets malformed"}))
                    return
                if evaluate:
                    loss = await self.execute_eval(x.reshape(b, t, h), targets.reshape(b, t))
                    await send_frame(writer, msgpack.packb({"loss": float(loss)}))
                    return
                grad, loss = await self.execute(x.reshape(b, t, h), targets.reshape(b, t), scale)
                back = get_codec(codec).encode(grad.float().reshape(-1))
                await send_frame(writer, msgpack.packb({"loss": float(loss)}))
                await send_frame(writer, back)
                self.meter.sent += len(back)
        except PipelineError as e:
            await send_frame(writer, msgpack.packb({"error": str(e)}))
        except asyncio.TimeoutError:
            logger.info("dropped a microbatch from %s: it took over %.0f s", remote[-8:], self.timeout)
        except asyncio.CancelledError:  # the peer is stopping: the sender sees the stream end and goes elsewhere
            return

    def _check(self, shape: object, codec: object) -> Optional[str]:
        if not isinstance(shape, list) or len(shape) != 3 or \
                not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in shape):
            return "shape is not (batch, tokens, hidden)"
        if shape[2] != self.hidden:
            return f"hidden size {shape[2]}, not {self.hidden}"
        if shape[0] * shape[1] > self.max_tokens:
            return f"{shape[0] * shape[1]} tokens, over the {self.max_tokens} a microbatch may hold"
        if not isinstance(codec, str) or codec not in ("none", "fp16", "bf16", "int8"):
            return f"codec {codec!r} is not one for activations (none, fp16, bf16, int8)"
        return None

    def _eval_in_executor(self, x: torch.Tensor, targets: torch.Tensor) -> Awaitable[float]:
        downstream = None if self.downstream is None else self.downstream.evaluator(self.loop)
        return self.loop.run_in_executor(None, self.worker.evaluate, x, targets, downstream)

    def _in_executor(self, x: torch.Tensor, targets: torch.Tensor,
                     scale: float) -> Awaitable[tuple[torch.Tensor, float]]:
        hop = None if self.downstream is None else self.downstream.hop(self.loop)
        return self.loop.run_in_executor(None, self.worker.step, x, targets, hop, scale)


@dataclass
class Router:
    """Sends microbatches to the next stage's peers. `peers()` lists them now as (peer id, tokens/s); each
    microbatch goes to one drawn with probability proportional to tokens/s / (1 + its microbatches in flight from
    us), leaving out peers that failed a hop in the last RETRY_AFTER s, and is retried on another on failure, up to
    `attempts` peers."""

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
        microbatches can be in flight (swarm/peer/microbatches.py). Given a peer's LoopThread, a stop signal
        cancels the hops in flight (LoopThread.cancel_submitted): a first stage waiting on a gradient stops at
        once instead of when the hop times out (HOP_SECONDS, a try on each of `attempts` peers)."""
        submit = _submitter(loop)

        def send(out: torch.Tensor, targets: torch.Tensor, scale: float = 1.0) -> concurrent.futures.Future:
            return submit(self.forward(out, targets, scale))

        return send

    def choose(self, exclude: set[str]) -> Optional[str]:
        now = time.monotonic()
        candidates = [(peer, speed) for peer, speed in self.peers() if peer not in exclude
                      and now - self.failed.get(peer, -RETRY_AFTER) >= RETRY_AFTER]
        if not candidates:
            return None
        weights = [max(speed, 1e-9) / (1 + self.in_flight[peer]) for peer, speed in candidates]
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
                answer = await call_stage(self.node, peer, self.protocol, x, targets, self.codec, self.meter,
                                          self.timeout, scale, evaluate)
                self.sent_to[peer] += not evaluate
                return answer
            except Exception as e:  # noqa: BLE001 - any failure of the hop: the next peer
                last_error = e
                self.failed[peer] = time.monotonic()
                self.retries += 1
                logger.info("stage peer %s failed a microbatch (%s); trying another", peer[-8:],
                            str(e).splitlines()[0] if str(e) else type(e).__name__)
            finally:
                self.in_flight[peer] -= 1
        raise PipelineError(f"no peer of the next stage took the microbatch (tried {len(tried)}"
                            + (f"; last: {last_error}" if last_error else "") + ")")


class Handoff:
    """Microbatches a serving stage's handler (on `loop`) hands to the training thread, which also takes its outer
    steps: `queue` holds (activations, targets, scale, the future of the answer); scale None is a validation
    microbatch. Once `close` has run, microbatches are refused with a reason, and those queued are answered so: their
    senders try another peer at once, not when the hop times out (HOP_SECONDS)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: queue.Queue = queue.Queue()
        self.closed = False  # (set on the loop)

    async def hand_over(self, x: torch.Tensor, targets: torch.Tensor, scale: Optional[float]):
        """A served microbatch, run by the training thread (swarm/peer/staged.py); a validation one (forward only, its loss)
        with `scale` None."""
        if self.closed:
            raise PipelineError("the stage peer is stopping")
        done = self.loop.create_future()
        self.queue.put((x, targets, scale, done))
        return await done

    def answer(self, done: asyncio.Future, result=None, error: Optional[BaseException] = None) -> None:
        """From the training thread: the answer to a microbatch it took from `queue`."""
        self.loop.call_soon_threadsafe(_settle, done, result, error)

    def close(self) -> None:
        """From the training thread, once it serves no more (the end of training, a stop signal, a move)."""
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._refuse)

    def _refuse(self) -> None:
        # (on the loop, so no hand_over queues a microbatch between the flag and the queue's last get)
        self.closed = True
        while True:
            try:
                *_, done = self.queue.get_nowait()
            except queue.Empty:
                return
            _settle(done, None, PipelineError("the stage peer is stopping"))


def _settle(future: asyncio.Future, result, error: Optional[BaseException]) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
