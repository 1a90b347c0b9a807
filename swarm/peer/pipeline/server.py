"""Serving a middle or last stage to the peers of the stage before (`StageServer`, on the run's stage protocol), and
the hand-off of served microbatches to a peer's training thread (`Handoff`), which also takes its outer steps.
"""

from __future__ import annotations

import asyncio
import logging
import queue
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Optional

import msgpack
import numpy as np
import torch

from swarm.compression import decode, get_codec
from swarm.dht.frames import recv_frame, send_frame
from swarm.peer.pipeline.routing import HEADER_BYTES, HOP_SECONDS, Router, WireMeter, payload_bound
from swarm.peer.pipeline.worker import Execute, PipelineError, StageWorker

logger = logging.getLogger(__name__)


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
        # training thread instead (swarm/peer/pipeline/part.py), which also takes its outer steps.
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
                payload = await recv_frame(reader, payload_bound(b * t * h))
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
        """A served microbatch, run by the training thread (part.py); a validation one (forward only, its loss) with
        `scale` None."""
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
