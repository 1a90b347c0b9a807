"""Serving a middle or last stage to the peers of the stage before (`StageServer`, on the run's stage protocol), and
the hand-off of served microbatches to a peer's training thread (`Handoff`), which also takes its outer steps. A
server holds at most MAX_WAITING microbatches, MAX_WAITING_PER_PEER of them from one peer, and refuses more at once
("busy", so the sender goes to another peer); a microbatch whose handler gave up on it is never trained on. A
server refuses activations far above those the same sender sent before (integrity.REQUEST_RULES: honest senders of
a stage may differ by orders of magnitude, so none is judged by the others'), and leaves their sender out for a while.
A last stage right after the first (`judge_losses`) also holds each sender's microbatches' losses, before it applies
anything, to the other senders' (integrity.LOSS_RULES: activations that are not the first stage's computation,
noise of any norm, predict nothing, and their loss stays near ln(vocabulary) as the stage learns).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Optional

import msgpack
import torch

from swarm.compression import decode, get_codec
from swarm.dht.frames import FRAME_HEADER, recv_frame, send_frame
from swarm.peer.pipeline.integrity import (EXCLUDE_SECONDS, LOSS_FRESH_SECONDS, LOSS_RULES, REQUEST_RULES, AnswerCheck,
                                           rms)
from swarm.peer.pipeline.recompute import Recheck
from swarm.peer.pipeline.routing import (BUSY, HEADER_BYTES, HOP_SECONDS, NoPeerTook, Router, WireMeter,
                                         payload_bound, round_number, size_problem, token_ids)
from swarm.peer.pipeline.worker import Accept, Downstream, Execute, PipelineError, StageWorker
from swarm.words import shown

logger = logging.getLogger(__name__)

# Microbatches a server holds (being received, waiting for the training thread, computed): a few times the one the
# training thread runs at once, so it always has the next; past this, a sender is better served by another peer.
MAX_WAITING = 8
# Of them from one peer: an honest first stage keeps --microbatches (2 by default) in flight, spread over the next
# stage's peers, so one stranger cannot keep everyone else's out.
MAX_WAITING_PER_PEER = 4
DROPPED = "the microbatch's handler gave up on it"  # (timed out or cancelled: its sender has gone elsewhere)
SKIP_SECONDS = 5.0  # the longest a refused sender's request is read (and forgotten) so that it reads our reason
# Lies a server can be told to tell (drills and tests of the senders' checks): scale-grad, the gradients it returns
# x LIE_SCALE; low-loss, the losses it returns / LIE_SCALE (a validation loss written by one peer); garbage-grad,
# gradients of the right shape and norm but random (noise in place of the computation, the loss left honest).
LIES = ("scale-grad", "low-loss", "garbage-grad")
LIE_SCALE = 1000.0


class StageServer:
    """Serves a middle or last stage to peers of the stage before: each request is a microbatch's activations and
    targets; the answer is the gradient of the activations and the loss. Requests larger than `max_tokens` tokens
    of `hidden` values, or of another shape, or with targets outside the vocabulary, are refused with a reason;
    the worker runs in a thread of its own, so the event loop keeps serving. `downstream` (middle stages) is the
    next hop, called from that thread. `lie` (one of LIES) makes it answer dishonestly, for drills. `round`, when
    set, gives our stage's outer round (read on the event loop), which each training answer carries (left out when
    the round changed while the microbatch ran), so that senders compare only answers of one round."""

    def __init__(self, worker: StageWorker, hidden: int, max_tokens: int, vocab_size: int,
                 loop: asyncio.AbstractEventLoop, downstream: Optional["Router"] = None,
                 timeout: float = HOP_SECONDS, execute: Optional[Execute] = None,
                 execute_eval: Optional[Callable[[torch.Tensor, torch.Tensor], Awaitable[float]]] = None,
                 max_waiting: int = MAX_WAITING, max_waiting_per_peer: int = MAX_WAITING_PER_PEER,
                 lie: Optional[str] = None):
        if worker.stage.first:
            raise ValueError("the first stage reads data; it serves no microbatches")
        if lie is not None and lie not in LIES:
            raise ValueError(f"lie {lie!r} is not one of {', '.join(LIES)}")
        self.lie = lie
        self.round: Optional[Callable[[], int]] = None
        self.worker, self.hidden, self.max_tokens, self.vocab_size = worker, hidden, max_tokens, vocab_size
        self.max_seq: Optional[int] = None  # the longest row a microbatch may hold (a peer's: its recipe's seq_len)
        self.loop, self.downstream, self.timeout = loop, downstream, timeout
        # Where the worker runs a microbatch: by default in a thread of the server's own, one at a time; a peer hands
        # it to its training thread instead (swarm/peer/pipeline/part.py), which also takes its outer steps.
        self.execute = execute or self._in_executor
        self.execute_eval = execute_eval or self._eval_in_executor
        self.max_waiting, self.max_waiting_per_peer = max_waiting, max_waiting_per_peer
        self.waiting: Counter = Counter()  # microbatches held now, by sending peer (peers with none left out)
        self.meter = WireMeter()
        self.refused: Counter = Counter()
        self.dropped = 0  # microbatches whose handler timed out: never trained on, never answered
        self.check = AnswerCheck(REQUEST_RULES)  # the activations each sender sent
        self.judge_losses = False  # hold senders' losses to the others' (a last stage whose senders are the first)
        # The stage right after the first: training microbatches carry their whole rows of token ids (targets and
        # inputs), and a sampled share of their activations is computed again by other first-stage peers
        self.verify: Optional[Recheck] = None
        # (judged on the thread that trains: under _loss_lock; a sender is refused, never left out, by its losses)
        self.losses = AnswerCheck(LOSS_RULES, limit=None, fresh=LOSS_FRESH_SECONDS)
        self._loss_lock = threading.Lock()
        self._thread: Optional[concurrent.futures.ThreadPoolExecutor] = None  # (the default execute's, made on use)

    async def handle(self, remote: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held = False
        try:
            async with asyncio.timeout(self.timeout):
                header = msgpack.unpackb(await recv_frame(reader, HEADER_BYTES))
                shape = header.get("shape") if isinstance(header, dict) else None
                codec = header.get("codec") if isinstance(header, dict) else None
                scale = header.get("scale", 1.0) if isinstance(header, dict) else None
                evaluate = header.get("eval", False) if isinstance(header, dict) else None
                claimed = header.get("round") if isinstance(header, dict) else None
                problem = self._check(shape, codec) or (
                    None if isinstance(scale, float) and 0.0 < scale <= 1.0
                    else f"scale {shown(scale)} is not in (0, 1]") \
                    or (None if isinstance(evaluate, bool) else f"eval {shown(evaluate)} is not true or false") or (
                    None if claimed is None or round_number(claimed)
                    else f"round {shown(claimed)} is not a round number")
                if problem is not None:
                    self.refused["header"] += 1  # (by kind: the problem quotes what the sender wrote)
                    await send_frame(writer, msgpack.packb({"error": problem}))
                    return
                b, t, h = shape
                busy = self._busy(remote)
                if busy is not None:  # refused before its payload is read: it costs us no memory
                    self.refused[BUSY] += 1
                    await send_frame(writer, msgpack.packb({"error": busy}))
                    # The sender writes its whole request before it reads an answer: what it sends is skipped for a
                    # few seconds, so that it reads our reason rather than a reset stream.
                    await _skip(reader, 2 * FRAME_HEADER.size + payload_bound(b * t * h) + 4 * b * (t + 1),
                                SKIP_SECONDS)
                    return
                self.waiting[remote] += 1
                held = True
                payload = await recv_frame(reader, payload_bound(b * t * h))
                ids = await recv_frame(reader, 4 * b * (t + 1))  # (the targets, or the whole rows: see _rows)
                self.meter.received += len(payload) + len(ids)
                x = await asyncio.to_thread(_decoded, payload)  # (off the event loop, as the encoding below)
                rows, targets, problem = self._rows(ids, b, t)
                if problem is None and x.numel() != b * t * h:
                    problem = "activations or targets malformed"
                if problem is not None:
                    self.refused["malformed"] += 1
                    await send_frame(writer, msgpack.packb({"error": problem}))
                    return
                problem = self._judge(remote, x, judged=not evaluate, claimed=claimed)
                if problem is None and self.verify is not None and not evaluate:
                    problem = await self.verify.judge(remote, x.reshape(b, t, h), rows)
                    self.refused["recomputed"] += problem is not None
                if problem is not None:
                    self.refused["activations"] += 1
                    await send_frame(writer, msgpack.packb({"error": problem}))
                    return
                ids = targets if rows is None else rows  # (passed on as they came: worker.split_ids)
                if evaluate:
                    loss = await self.execute_eval(x.reshape(b, t, h), ids)
                    loss = float(loss) / (LIE_SCALE if self.lie == "low-loss" else 1.0)
                    await send_frame(writer, msgpack.packb({"loss": float(loss)}))
                    return
                round_before = self.round() if self.round is not None else None
                grad, loss = await self.execute(x.reshape(b, t, h), ids, scale,
                                                self._loss_check(remote) if self.judge_losses else None)
                round_no = self.round() if self.round is not None else None
                grad = _lie_about(grad, self.lie)
                loss = float(loss) / (LIE_SCALE if self.lie == "low-loss" else 1.0)
                back = await asyncio.to_thread(get_codec(codec).encode, grad.float().reshape(-1))
                await send_frame(writer, msgpack.packb({"loss": float(loss), **(
                    {"round": round_no} if round_no is not None and round_no == round_before else {})}))
                await send_frame(writer, back)
                self.meter.sent += len(back)
        except PipelineError as e:  # (our own next hop taken nowhere: busy, so that the sender tries us again)
            error = f"{BUSY}: the stage after ours: {e}" if isinstance(e, NoPeerTook) else str(e)
            await send_frame(writer, msgpack.packb({"error": error}))
        except asyncio.TimeoutError:
            self.dropped += 1
            logger.info("dropped a microbatch from %s: it took over %.0f s", remote[-8:], self.timeout)
        except asyncio.CancelledError:  # the peer is stopping: the sender sees the stream end and goes elsewhere
            return
        finally:
            if held:
                self.waiting[remote] -= 1
                if not self.waiting[remote]:
                    del self.waiting[remote]

    def _judge(self, remote: str, x: torch.Tensor, judged: bool = True, claimed: Optional[int] = None) -> Optional[str]:
        """Why the activations `x` from `remote` are refused (None: they are not): it is left out, or (`judged`: a
        training microbatch) they are far above what it sent before (integrity.AnswerCheck with REQUEST_RULES, which
        leaves it out at its STRIKES-th refusal in a row). Only what it sent in the round of its stage it `claimed`
        counts as before: a new round's params can move its activations 100x and more. A claim counts up to one
        round past ours (an honest stage before may finish a round first), so a sender that claims a new round with
        each microbatch starts its history anew once a round of ours at most, and one that says no round (or a
        server that knows no round of its own) never does. A validation microbatch trains nothing here, so whatever
        it holds costs only its sender's own validation loss: it is neither judged nor kept as the sender's history
        (a first stage's validation activations, from the round's new global params, once came 160x its training
        ones, and the refusal cost that round's validation loss)."""
        left_out = self.check.excluded.get(remote)
        if self.check.is_excluded(remote):
            return f"activations refused: you are left out ({left_out[1]})"
        if not judged:
            return None
        ours = self.round() if self.round is not None else None
        epoch = None if claimed is None or ours is None else min(claimed, ours + 1)
        why = self.check.judge(remote, {"activations": rms(x)}, epoch=epoch)
        if why is None:
            return None
        if self.check.is_excluded(remote):
            logger.warning("pipeline: refused the activations of peer %s and left it out for %.0f s: %s", remote,
                           EXCLUDE_SECONDS, why)
        else:
            logger.info("pipeline: refused the activations of peer %s: %s", remote, why)
        return f"activations refused: {why}"

    def _rows(self, ids: bytes, b: int, t: int) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[str]]:
        """The token ids of a microbatch of `b` rows of `t` tokens: its targets (b, t), or its whole rows (b, t + 1),
        of which the targets are the last t and the inputs the first t (what a first stage sends, so that the stage
        after it can have the activations computed again: `verify`, which needs them). Returns (the whole rows, or
        None; the targets; None), or (None, None, what is wrong)."""
        whole = len(ids) == 4 * b * (t + 1)
        if len(ids) != 4 * b * t and not whole:
            return None, None, "activations or targets malformed"
        if self.verify is not None and not whole:
            return None, None, ("the stage after the first takes the whole rows of token ids (inputs and targets), "
                                "so that other first-stage peers can compute the activations again: update swarm")
        if self.worker.stage.embed is not None and not whole:
            return None, None, ("a stage after a bottleneck takes the whole rows of token ids (inputs and targets): "
                                "it embeds the input ids again; update swarm")
        ids = token_ids(ids, self.vocab_size)
        if ids is None:
            return None, None, "activations or targets malformed"
        if not whole:
            return None, ids.reshape(b, t), None
        rows = ids.reshape(b, t + 1)
        return rows, rows[:, 1:], None

    def _loss_check(self, remote: str) -> Accept:
        """What the training thread calls with the loss of a microbatch from `remote` before it applies anything:
        raises PipelineError (nothing applied) when LOSS_RULES refuse it against the other senders' recent losses."""
        def accept(loss: float) -> None:
            with self._loss_lock:
                why = self.losses.judge(remote, {"loss": loss})
            if why is not None:
                self.refused["loss"] += 1
                logger.info("pipeline: refused the activations of peer %s: %s", remote, why)
                raise PipelineError(f"activations refused: {why}")
        return accept

    def _busy(self, remote: str) -> Optional[str]:
        """Why a microbatch from `remote` finds no room here now (None: it does)."""
        if self.waiting[remote] >= self.max_waiting_per_peer:
            return f"{BUSY}: {self.waiting[remote]} microbatches of yours are here already; try another peer"
        if sum(self.waiting.values()) >= self.max_waiting:
            return f"{BUSY}: {self.max_waiting} microbatches are here already; try another peer"
        return None

    def _check(self, shape: object, codec: object) -> Optional[str]:
        if not isinstance(shape, list) or len(shape) != 3 or \
                not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in shape):
            return "shape is not (batch, tokens, width)"
        if shape[2] != self.hidden:
            return f"{shape[2]} values a token, not the {self.hidden} this stage takes"
        too_large = size_problem(shape[0], shape[1], self.max_tokens, self.max_seq)
        if too_large is not None:
            return too_large
        if not isinstance(codec, str) or codec not in ("none", "fp16", "bf16", "int8"):
            return f"codec {shown(codec)} is not one for activations (none, fp16, bf16, int8)"
        return None

    async def _eval_in_executor(self, x: torch.Tensor, ids: torch.Tensor) -> float:
        downstream = None if self.downstream is None else self.downstream.evaluator(self.loop)
        return await self._in_thread(lambda dropped: self.worker.evaluate(x, ids, downstream))

    async def _in_executor(self, x: torch.Tensor, ids: torch.Tensor, scale: float,
                           accept: Optional[Accept] = None) -> tuple[torch.Tensor, float]:
        hop = None if self.downstream is None else self.downstream.hop(self.loop)
        return await self._in_thread(lambda dropped: self.worker.step(
            x, ids, None if hop is None else unless_dropped(hop, dropped), scale, accept))

    async def _in_thread(self, run: Callable[[Callable[[], bool]], object]):
        """`run(dropped)` in the server's one thread (microbatches wait their turn here, not on the worker's lock),
        unless the handler gave up on it first; `dropped()` says, from that thread, whether it has since."""
        if self._thread is None:
            self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="stage-server")
        gave_up = threading.Event()

        def guarded():
            if gave_up.is_set():
                raise PipelineError(DROPPED)
            return run(gave_up.is_set)

        try:  # (cancelled while it waits its turn, it never runs: the executor's future is cancelled with ours)
            return await self.loop.run_in_executor(self._thread, guarded)
        finally:
            gave_up.set()


def _lie_about(grad: torch.Tensor, lie: Optional[str]) -> torch.Tensor:
    """The gradient a server told to `lie` sends back instead of `grad`."""
    if lie == "scale-grad":
        return grad * LIE_SCALE
    if lie == "garbage-grad":  # noise of the same norm: no statistic of the answer gives it away
        noise = torch.randn(grad.shape, dtype=torch.float32)
        return noise * (grad.float().norm() / noise.norm().clamp_min(1e-30))
    return grad


def _decoded(payload: bytes) -> torch.Tensor:
    """The values a codec's `payload` holds, or none (refused as malformed) if it is not a payload of any codec or
    holds a value that is not finite."""
    try:
        x = decode(payload)
    except ValueError:  # CodecError
        return torch.zeros(0)
    return x if torch.isfinite(x).all() else torch.zeros(0)


def unless_dropped(downstream: Downstream, dropped: Callable[[], bool]) -> Downstream:
    """`downstream` (a middle stage's next hop), raising PipelineError instead once `dropped()` (the microbatch's
    handler gave up on it), before the hop and after it: StageWorker.step then applies nothing (it raises what its
    downstream raises, before the backward), so a microbatch its sender retried elsewhere is not trained twice."""
    def hop(out: torch.Tensor, ids: torch.Tensor, scale: float = 1.0) -> tuple[torch.Tensor, float]:
        if dropped():
            raise PipelineError(DROPPED)
        answer = downstream(out, ids, scale)
        if dropped():
            raise PipelineError(DROPPED)
        return answer

    return hop


async def _skip(reader: asyncio.StreamReader, limit: int, seconds: float) -> None:
    """Read and forget up to `limit` bytes of `reader`, for at most `seconds` (a piece at a time: no memory)."""
    try:
        async with asyncio.timeout(seconds):
            while limit > 0:
                piece = await reader.read(min(limit, 1 << 16))
                if not piece:
                    return
                limit -= len(piece)
    except (asyncio.TimeoutError, ConnectionError):
        return


class Handoff:
    """Microbatches a serving stage's handler (on `loop`) hands to the training thread, which also takes its outer
    steps: `queue` holds (activations, token ids, scale, accept, the future of the answer); scale None is a validation
    microbatch. At most `max_waiting` wait: one more is refused at once ("busy"). One whose handler gives up on it
    (its timeout, a cancel) leaves the queue then, and `queue.get` never returns one whose future is done; a hop the
    training thread runs for it is best wrapped in `unless_dropped(hop, done.done)`, so that once it is given up
    during the hop nothing is applied. Once `close` has run, microbatches are refused with a reason, and those queued
    are answered so: their senders try another peer at once, not when the hop times out (HOP_SECONDS)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, max_waiting: int = MAX_WAITING):
        self.loop = loop
        self.queue = _Waiting(max_waiting)
        self.closed = False  # (set on the loop)

    async def hand_over(self, x: torch.Tensor, ids: torch.Tensor, scale: Optional[float],
                        accept: Optional[Accept] = None):
        """A served microbatch, run by the training thread (part.py); a validation one (forward only, its loss) with
        `scale` None. Raises PipelineError at once if `max_waiting` wait already, or the peer is stopping."""
        if self.closed:
            raise PipelineError("the stage peer is stopping")
        done = self.loop.create_future()
        entry = (x, ids, scale, accept, done)
        try:
            self.queue.put_nowait(entry)
        except queue.Full:
            raise PipelineError(f"{BUSY}: {self.queue.maxsize} microbatches wait for this peer's training thread; "
                                "try another peer") from None
        try:
            return await done
        finally:
            if done.cancelled():  # given up on: out of the queue now, so it holds neither a place nor its tensors
                self.queue.discard(entry)

    def take(self, timeout: float) -> Optional[tuple]:
        """From the training thread: the next entry of `queue`, waiting up to `timeout`; None if none came."""
        try:
            return self.queue.get(timeout=timeout)
        except queue.Empty:
            return None

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


class _Waiting(queue.Queue):
    """Handoff's queue of (activations, token ids, scale, accept, future): `get` passes over entries whose future is
    done (their handler gave up on them: nobody waits for the answer, and their sender retried elsewhere), and `discard`
    takes one out before its turn. (A future is settled on the loop only; the training thread reads done(),
    one flag.)"""

    def __init__(self, maxsize: int):
        super().__init__(maxsize)
        self.passed_over = 0  # entries `get` did not return: given up on before the training thread took them

    def get(self, block: bool = True, timeout: Optional[float] = None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            entry = super().get(block, left)
            if not entry[-1].done():
                return entry
            self.passed_over += 1

    def discard(self, entry: tuple) -> None:
        with self.mutex:
            for k, queued in enumerate(self.queue):
                if queued is entry:
                    del self.queue[k]
                    self.passed_over += 1
                    self.not_full.notify()
                    return


def _settle(future: asyncio.Future, result, error: Optional[BaseException]) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
