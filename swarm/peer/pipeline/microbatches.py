"""A first stage's continuous stream of microbatches: `window` microbatches always in flight, across batches, so
the next batch's forward passes run while this batch's gradients travel and neither stage waits for the other.

Waiting for a batch's last gradient before sending the next batch (the schedule before this one) left each stage
idle while the other computed: with 2 microbatches in flight a stage can compute at most 2/3 of the time, and
measured 46-51% on 100 Mbit/s links. Streaming across batches means a batch's forward passes start before the step
of the batch before is taken, so each batch's forwards use a copy of the weights taken when its first microbatch
went (weight stashing, as PipeDream-2BW does): its backward passes then see the weights its forwards saw (autograd
would refuse weights changed in place under it), and its gradient is applied one step late. The stage's live
weights take the optimizer steps; at most two batches, so two copies of the weights, are in flight at once (a
window of more than `parts` microbatches, for a pipeline of more stages than that, fills only while the next batch
is the second in flight).
A microbatch the next stage did not take is kept and sent again; none is lost and none is trained twice here.
One kept across an outer step (or a sync) is computed again on the params as they are then, with the rest of its
batch (`_fresh`): the next stage holds a first stage's activations to what its other peers compute now
(recompute.py), and a round's outer step moves the params far enough, in the first rounds above all, that the old
activations could never agree again (an honest first-stage peer once stalled on one for the rest of its run).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch.func import functional_call

from swarm.peer.pipeline.worker import PipelineError, RetryLog, StageWorker

logger = logging.getLogger(__name__)

BATCHES = 2  # batches in flight at most, so copies of the weights held (a window over `parts` waits for a step)
# (activations, their targets or whole rows of token ids, the microbatch's share of its batch) -> a future of (their
# gradient, the microbatch's loss)
Send = Callable[[torch.Tensor, torch.Tensor, float], concurrent.futures.Future]


@dataclass(eq=False)
class _Batch:
    x: torch.Tensor  # token ids, (rows, tokens)
    targets: torch.Tensor
    rows: torch.Tensor  # its whole rows (inputs and targets, on the CPU), which travel with the activations
    parts: int
    weights: dict[str, torch.Tensor]  # the stage's weights when its first microbatch went: its forwards use these
    round: Optional[int] = None  # our stage's round when they were taken (MicrobatchStream.round)
    older: list = field(default_factory=list)  # stashes it used before an outer step: their gradients count too
    sent: int = 0
    back: int = 0  # microbatches whose gradient came back and was backpropagated
    loss: float = 0.0


@dataclass(eq=False)
class _Hop:
    batch: _Batch
    index: int
    out: torch.Tensor  # our stage's output for it, with the graph its gradient is backpropagated through
    weights: dict[str, torch.Tensor]  # the stash `out` was computed on
    future: Optional[concurrent.futures.Future] = field(default=None)


class MicrobatchStream:
    """Runs `worker`'s stage (a first stage) as a stream: each batch cut into `parts` microbatches, `window` of them
    in flight at once, sent with `send`. With `across` False (the recipe's pipeline.schedule: flush), a batch is
    taken only once the one before is stepped on: no batch runs on old weights, and the stages idle more."""

    def __init__(self, worker: StageWorker, send: Send, parts: int, window: int, across: bool = True):
        if not worker.stage.first:
            raise ValueError("only a first stage reads batches")
        self.worker, self.send, self.parts, self.window = worker, send, max(parts, 1), max(window, 1)
        self.across = across
        self.flight: deque[_Hop] = deque()  # sent, not yet back, oldest first
        self.unsent: deque[_Hop] = deque()  # the next stage took them nowhere: sent again first
        self.batches: deque[_Batch] = deque()  # taken, not yet stepped on, oldest first
        self.taken = self.trained = 0  # batches taken from the data, and stepped on
        self.round: Optional[Callable[[], int]] = None  # our stage's round (Part.follow); None: never moves
        self.refreshed = 0  # microbatches computed again on new params after an outer step (`_fresh`)
        self.retries = RetryLog(logger.info)  # while no next-stage peer takes our microbatches

    @property
    def pending(self) -> int:
        """Batches taken whose step is not taken yet."""
        return len(self.batches)

    def step(self, next_batch: Callable[[], torch.Tensor]) -> tuple[float, int]:
        """Keep `window` microbatches in flight (taking batches from `next_batch` as needed), backpropagate the
        oldest one's gradient when it comes, and return once a batch is complete and stepped on: (its loss, its
        tokens). Raises PipelineError if the next stage took a microbatch nowhere; it is sent again on the next
        call. `taken` counts the batches taken from `next_batch`."""
        while True:
            self._top_up(next_batch)
            try:
                done = self._receive_oldest(next_batch)
            except PipelineError as e:
                self.retries.failed(e)
                raise
            if done is not None:
                self.retries.succeeded()
                return done.loss, done.targets.numel()

    def settle(self) -> list[tuple[float, int]]:
        """Finish the batches taken, taking no new one, so the stage's weights hold the steps of every microbatch
        it sent (before they are averaged, and at the end): (loss, tokens) of each batch finished. Stops at the
        first microbatch the next stage takes nowhere (kept, and sent again later)."""
        finished = []
        while self.batches:
            self._top_up(None)
            try:
                done = self._receive_oldest()
            except (PipelineError, concurrent.futures.CancelledError):  # (cancelled: the peer is stopping)
                break
            if done is not None:
                finished.append((done.loss, done.targets.numel()))
        return finished

    def _top_up(self, next_batch: Optional[Callable[[], torch.Tensor]]) -> None:
        while len(self.flight) < self.window:
            if self.unsent:
                hop = self.unsent.popleft()
                self._fresh(hop.batch, hop)
                self._send(hop)
                continue
            batch = self.batches[-1] if self.batches and self.batches[-1].sent < self.batches[-1].parts else None
            if batch is None:
                if next_batch is None or (self.batches and not self.across) or len(self.batches) >= BATCHES:
                    break
                tokens = next_batch()
                self.taken += 1
                # (the token ids where the stage computes; the targets travel to the next stage from the CPU)
                batch = _Batch(tokens[:, :-1].to(self.worker.device), tokens[:, 1:].cpu(), tokens.cpu(),
                               min(self.parts, tokens.shape[0]), self.worker.stash(), self._round())
                self.batches.append(batch)
            self._fresh(batch)
            index = batch.sent
            batch.sent += 1
            self._send(_Hop(batch, index, self._forward(batch, index), batch.weights))

    def _round(self) -> Optional[int]:
        return None if self.round is None else self.round()

    def _forward(self, batch: _Batch, index: int) -> torch.Tensor:
        with self.worker.lock:
            started = time.perf_counter()
            out = functional_call(self.worker.stage, batch.weights, (batch.x.chunk(batch.parts)[index],))
            self.worker.computed(started)
        return out

    def _fresh(self, batch: _Batch, hop: Optional[_Hop] = None) -> None:
        """If our round moved since `batch` took its weights (an outer step or a sync changed the params), its
        forwards from now on use the params as they are (a new stash; the gradients gathered in the old one, of its
        microbatches already back or still in flight, are added at its step), and `hop`, one to send again, is
        computed again on them."""
        now = self._round()
        if now is not None and batch.round is not None and now != batch.round:
            batch.older.append(batch.weights)
            batch.weights, batch.round = self.worker.stash(), now
        if hop is not None and hop.weights is not batch.weights:
            hop.out, hop.weights = self._forward(batch, hop.index), batch.weights
            self.refreshed += 1

    def _send(self, hop: _Hop) -> None:
        rows = hop.batch.x.chunk(hop.batch.parts)
        # (the whole rows go as the targets: the next stage can have our activations computed again from them,
        # server.StageServer._rows)
        hop.future = self.send(hop.out.detach(), hop.batch.rows.chunk(hop.batch.parts)[hop.index],
                               rows[hop.index].shape[0] / hop.batch.x.shape[0])
        self.flight.append(hop)

    def _receive_oldest(self, next_batch: Optional[Callable[[], torch.Tensor]] = None) -> Optional[_Batch]:
        """Wait for the oldest microbatch in flight and backpropagate its gradient; the batch if that completed it
        (and it was stepped on). The next microbatch's forward pass goes first (from `next_batch` if it starts a
        batch), so the next stage gets it before it runs out of work: sent after the backward pass, it arrived a
        hop and a backward late, and the next stage idled that long per microbatch (81% busy where it was the
        slower stage, on 100 Mbit/s links)."""
        hop = self.flight.popleft()
        try:
            grad, loss = hop.future.result()
        except BaseException:
            # Kept: its activations go again (the next stage trained nothing of it); so do those of the other
            # microbatches that failed meanwhile, so one outage costs the caller one wait, not one per microbatch.
            failed = [hop] + [h for h in self.flight if h.future.done() and
                              (h.future.cancelled() or h.future.exception() is not None)]
            self.flight = deque(h for h in self.flight if h not in failed)
            self.unsent.extend(failed)
            raise
        self._top_up(next_batch)
        batch = hop.batch
        with self.worker.lock:
            started = time.perf_counter()
            try:
                self.worker._backward(hop.out, grad)
            except PipelineError:
                self.unsent.append(hop)  # a gradient of the wrong shape, or not finite: ask another peer
                raise
            batch.back += 1
            batch.loss += loss * batch.x.chunk(batch.parts)[hop.index].shape[0] / batch.x.shape[0]
            self.worker.microbatches += 1
            done = batch.back == batch.parts
            if done:
                self.batches = deque(b for b in self.batches if b is not batch)
                self.trained += 1
                self.worker.apply_stashed(_gathered(batch))
                self.worker.tokens += batch.targets.numel()
            self.worker.computed(started)
        return batch if done else None


def _gathered(batch: _Batch) -> dict[str, torch.Tensor]:
    """`batch`'s stash, holding the gradients gathered in the stashes it used before (`MicrobatchStream._fresh`)."""
    for older in batch.older:
        for name, weight in batch.weights.items():
            grad = older[name].grad
            if grad is not None:
                weight.grad = grad if weight.grad is None else weight.grad + grad
    batch.older.clear()
    return batch.weights


def together(finished: list[tuple[float, int]]) -> tuple[Optional[float], int, int]:
    """Microbatches finished together as one inner step's (loss, tokens, batches taken): their mean loss by tokens."""
    tokens = sum(n for _, n in finished)
    if not tokens:
        return None, 0, 0
    return sum(loss * n for loss, n in finished) / tokens, tokens, 0
