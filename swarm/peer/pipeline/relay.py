"""A middle stage's microbatches, several in flight: each one's forward pass runs and its activations go on to the
next stage, and the training thread takes the next microbatch from the stage before while they travel; a gradient
that comes back is backpropagated, and the gradient of the microbatch's input goes back to its sender.

Holding one microbatch from its forward pass to its gradient's return (StageWorker.step, the schedule before this
one) left a middle stage idle for the whole downstream hop and made every middle stage of a pipeline of three or
more handle one microbatch at a time end to end. In flight together, microbatches of one step's worth of rows
(`StageWorker.step_rows`) form a generation: its forwards use a copy of the stage's weights taken when its first
microbatch came (weight stashing, as the first stage's stream does: microbatches.py), its backward passes gather
its gradient there, and it is stepped on once all of its microbatches are back, oldest generation first. A
generation that starts while the one before is in flight takes its copy before that one's step: its gradient is
applied one step late. At most two generations, so two copies of the weights, are held at once.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch.func import functional_call

from swarm.peer.pipeline.microbatches import Send
from swarm.peer.pipeline.worker import Accept, PipelineError, StageWorker, split_ids

GENERATIONS = 2  # copies of the weights in flight at most
POLL_SECONDS = 0.002  # with microbatches in flight, how long a look at the stage before's queue waits

# (the microbatch's future, its answer or None, the error instead or None): Handoff.answer
Answer = Callable[..., None]


@dataclass(eq=False)
class _Generation:
    weights: dict[str, torch.Tensor]  # the stage's weights when its first microbatch came: its forwards use these
    rows: int = 0  # rows forwarded with them
    out: int = 0  # of its microbatches, those in flight
    trained: int = 0  # those backpropagated


@dataclass(eq=False)
class _Hop:
    generation: Optional[_Generation]  # None: a validation microbatch
    inputs: torch.Tensor  # the activations that came, a leaf whose gradient goes back
    out: torch.Tensor  # our output, with the graph its gradient is backpropagated through
    ids: torch.Tensor  # its token ids: targets or whole rows (worker.split_ids), sent on as they came
    accept: Optional[Accept]
    done: object  # the sender's future (Handoff's): done once answered, or once its handler gave up
    future: concurrent.futures.Future = field(default=None)

    @property
    def tokens(self) -> int:
        return self.inputs.shape[0] * self.inputs.shape[1]


class Relay:
    """Runs `worker`'s stage (a middle one) with up to `window` microbatches in flight, sent on with `send` (training
    ones) and `send_eval` (validation ones, which go through with the live weights and train nothing); what `take`
    returns are Handoff entries (activations, token ids, scale or None for validation, accept, future), and `answer`
    answers them."""

    def __init__(self, worker: StageWorker, send: Send, send_eval: Send, answer: Answer, window: int):
        if worker.stage.first or worker.stage.last:
            raise ValueError("only a middle stage relays microbatches")
        self.worker, self.send, self.send_eval, self.answer = worker, send, send_eval, answer
        self.window = max(window, 1)
        self.flight: list[_Hop] = []
        self.generations: list[_Generation] = []  # not yet stepped on, oldest first

    @property
    def pending(self) -> bool:
        """Whether a microbatch is in flight or a gradient not yet stepped on (see `settle`)."""
        return bool(self.flight) or any(g.trained for g in self.generations)

    def serve(self, take: Callable[[float], Optional[tuple]], wait: float) -> list[tuple[float, int]]:
        """Take microbatches from `take(timeout)` while fewer than `window` are in flight and finish those whose
        gradient came back, for at most `wait` seconds and until one is finished: (loss, tokens) of each
        microbatch trained."""
        deadline = time.monotonic() + wait
        while True:
            finished = self._finish(0.0)
            if finished:
                return finished
            left = deadline - time.monotonic()
            if left <= 0:
                return []
            if len(self.flight) < self.window and self._room():
                entry = take(min(left, POLL_SECONDS) if self.flight else left)
                if entry is not None:
                    self._take(entry)
            else:
                finished = self._finish(left)
                if finished:
                    return finished

    def settle(self, timeout: float) -> list[tuple[float, int]]:
        """Finish every microbatch in flight (waiting at most `timeout` for their gradients) and step on every
        generation, a part-filled one too, so that the stage's weights hold every microbatch it trained (before
        they are averaged): (loss, tokens) of each microbatch finished."""
        deadline = time.monotonic() + timeout
        finished = []
        while self.flight and time.monotonic() < deadline:
            finished += self._finish(deadline - time.monotonic())
        if not self.flight:
            while self.generations:
                self._step(self.generations.pop(0))
        return finished

    def _room(self) -> bool:
        """Whether a microbatch can start now: its generation is open, or a new one may be."""
        newest = self.generations[-1] if self.generations else None
        return newest is not None and not self._full(newest) or len(self.generations) < GENERATIONS

    def _full(self, generation: _Generation) -> bool:
        return generation.rows >= (self.worker.step_rows or 1)

    def _take(self, entry: tuple) -> None:
        x, ids, scale, accept, done = entry
        input_ids = split_ids(ids, x.shape[1])[0]
        if scale is None:  # a validation microbatch: the pipeline's loss with the live weights, nothing trained
            out = self.worker.output(x, input_ids)
            self.flight.append(_Hop(None, x, out, ids, None, done, self.send_eval(out, ids, 1.0)))
            return
        if not self.generations or self._full(self.generations[-1]):
            self.generations.append(_Generation(self.worker.stash()))
        generation = self.generations[-1]
        with self.worker.lock:
            started = time.perf_counter()
            inputs = x.to(self.worker.device).detach().requires_grad_(True)
            out = functional_call(self.worker.stage, generation.weights, (inputs, self.worker.on_device(input_ids)))
            self.worker.computed(started)
        generation.rows += x.shape[0]
        generation.out += 1
        hop = _Hop(generation, inputs, out, ids, accept, done)
        hop.future = self.send(out.detach(), ids, scale)
        self.flight.append(hop)

    def _finish(self, timeout: float) -> list[tuple[float, int]]:
        """Backpropagate the gradients that came back (waiting up to `timeout` for one), step on the generations
        they complete, then answer their senders (so a sender that waits for its batch's answers before its next
        batch sees our step taken: pipeline.schedule flush)."""
        if not self.flight:
            return []
        if timeout > 0:
            concurrent.futures.wait([h.future for h in self.flight], timeout,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        back, still = [], []
        for hop in self.flight:  # (each future read once: one that came back between two reads would be lost)
            (back if hop.future.done() else still).append(hop)
        self.flight = still
        finished, answers = [], []
        for hop in back:
            if hop.generation is None:  # (a validation microbatch's loss, as it came)
                error = hop.future.exception()
                answers.append((hop.done, None if error else hop.future.result()[1], error and _stopping(error)))
                continue
            hop.generation.out -= 1
            try:
                loss = self._backward(hop)
            except Exception as e:  # noqa: BLE001 - its sender learns of it, and retries elsewhere
                answers.append((hop.done, None, _stopping(e)))
            else:
                finished.append((loss, hop.tokens))
                answers.append((hop.done, (hop.inputs.grad.detach().cpu(), loss), None))
        # (the newest generation stays open for more rows while nothing else is in flight)
        while self.generations and self.generations[0].out == 0 and (
                self._full(self.generations[0]) or len(self.generations) > 1):
            self._step(self.generations.pop(0))
        for done, result, error in answers:
            self.answer(done, result, error)
        return finished

    def _backward(self, hop: _Hop) -> float:
        """Backpropagate `hop`'s gradient into its generation: its loss. Raises, with nothing applied, if the next
        stage failed it, its sender gave up on it (it was sent elsewhere), or `accept` refuses its loss."""
        grad, loss = hop.future.result()
        if hop.done.done():
            raise PipelineError("its sender gave up on it")
        if hop.accept is not None:
            hop.accept(loss)
        with self.worker.lock:
            started = time.perf_counter()
            self.worker._backward(hop.out, grad)
            hop.generation.trained += 1
            if not self.worker.frozen:
                self.worker.microbatches += 1
                self.worker.tokens += hop.tokens
            self.worker.computed(started)
        return loss

    def _step(self, generation: _Generation) -> None:
        """Step the live weights on `generation`'s gradient (none when frozen, or when none came back)."""
        if self.worker.frozen or not generation.trained:
            return
        with self.worker.lock:
            started = time.perf_counter()
            self.worker.apply_stashed(generation.weights)
            self.worker.computed(started)


def _stopping(error: BaseException) -> BaseException:
    if isinstance(error, concurrent.futures.CancelledError):  # (our next hop, cancelled by a stop signal)
        return PipelineError("the stage peer is stopping")
    return error

