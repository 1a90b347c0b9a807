"""One pipeline stage's computation (SWARM parallelism: microbatches through pipelines of peers). `StageWorker`
runs a microbatch through its stage (swarm.model.stages): forward, the downstream hop (or the loss, on the last
stage), backward, clip, optimizer step, one microbatch at a time (a first stage streams its batches' microbatches
instead: microbatches.py), each scaled by its share of its batch; a serving stage steps once per batch's worth of
rows, so the gradient of a batch is the same however it was cut. The hops themselves are routing.py's; serving a
stage to the stage before is server.py's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Awaitable, Callable
from typing import Optional

import torch
import torch.nn.functional as F

from swarm.model.stages import Stage


class PipelineError(RuntimeError):
    """No peer of the next stage could take a microbatch."""


class RetryLog:
    """A first stage's log of its retries while no next-stage peer takes its microbatches (it tries again every
    second): the first failure, then one line every `every` seconds while they go on, and one when a peer takes a
    microbatch again; not a line a second."""

    def __init__(self, log: Callable[..., None], every: float = 30.0, clock: Callable[[], float] = time.monotonic):
        self.log, self.every, self.clock = log, every, clock
        self.since: Optional[float] = None
        self.logged = 0.0

    def failed(self, reason: object) -> None:
        now = self.clock()
        if self.since is None:
            self.since, self.logged = now, now
            self.log("pipeline: %s; trying again every second", reason)
        elif now - self.logged >= self.every:
            self.logged = now
            self.log("pipeline: %s; still trying, for %.0f s now", reason, now - self.since)

    def succeeded(self) -> None:
        if self.since is not None:
            self.log("pipeline: the next stage takes our microbatches again, after %.0f s", self.clock() - self.since)
            self.since = None


# (activations, token ids (split_ids), the microbatch's share of its batch) -> (their gradient, the microbatch's loss)
Downstream = Callable[[torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, float]]
# A microbatch's loss, before anything is applied -> None, or raises PipelineError to refuse the microbatch
Accept = Callable[[float], None]
# (activations, token ids, share, accept) -> (their gradient, the microbatch's loss)
Execute = Callable[[torch.Tensor, torch.Tensor, float, Optional[Accept]], Awaitable[tuple[torch.Tensor, float]]]
Evaluate = Callable[[torch.Tensor, torch.Tensor], float]  # (activations, token ids) -> the rest of the pipeline's loss


def split_ids(ids: torch.Tensor, tokens: int) -> tuple[Optional[torch.Tensor], torch.Tensor]:
    """(the input ids, or None; the targets) of a microbatch of rows of `tokens` tokens, from the token ids that
    travel with it: its targets (rows of `tokens`), or its whole rows (of `tokens` + 1: the inputs are the first
    `tokens`, the targets the last), which a first stage sends and a stage after a bottleneck needs (it embeds the
    input ids again, swarm/model/stages.py)."""
    if ids.shape[-1] == tokens + 1:
        return ids[..., :-1], ids[..., 1:]
    return None, ids


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

    def step(self, x: torch.Tensor, ids: torch.Tensor, downstream: Optional[Downstream],
             scale: float = 1.0, accept: Optional[Accept] = None) -> tuple[Optional[torch.Tensor], float]:
        """Run a microbatch: `x` token ids (first stage) or the previous stage's activations, `ids` its targets or
        whole rows (split_ids; passed on as they came), `scale` its share of its batch (its loss counts that much).
        The last stage takes the loss; the others pass their output to `downstream`, which returns its gradient and
        the loss. Returns (the gradient of `x`, None on the first stage; the loss). Raises what `downstream` raises,
        with nothing applied, and so does `accept` (given the loss before anything is applied: StageServer's check
        of the stage before)."""
        with self.lock:
            started = time.perf_counter()
            x = x.to(self.device)
            inputs = x if self.stage.first else x.detach().requires_grad_(True)
            input_ids, targets = split_ids(ids, x.shape[1])
            out = self.stage(inputs, self.on_device(input_ids))
            if self.stage.last:
                loss_tensor = F.cross_entropy(out.reshape(-1, out.shape[-1]).float(),
                                              targets.to(self.device).reshape(-1))
                loss = float(loss_tensor.detach())
                if accept is not None:
                    accept(loss)
                (loss_tensor * scale).backward()
            else:
                self.computed(started)
                grad, loss = downstream(out.detach(), ids, scale)
                if accept is not None:
                    accept(loss)
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

    def evaluate(self, x: torch.Tensor, ids: torch.Tensor, downstream: Optional[Evaluate]) -> float:
        """A microbatch's loss through this stage and the rest of the pipeline (`downstream`: the next hop's loss),
        with no gradient and no step: the validation loss of the pipeline as its stages' params stand."""
        input_ids, targets = split_ids(ids, x.shape[1])
        out = self.output(x, input_ids)
        if self.stage.last:
            return float(F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), targets.to(self.device).reshape(-1)))
        return downstream(out, ids)

    def output(self, x: torch.Tensor, input_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The stage's output for `x` in eval mode, with no gradient (a validation microbatch's; `input_ids`: its
        input token ids, for a stage after a bottleneck)."""
        with self.lock, torch.no_grad():
            was_training = self.stage.training
            self.stage.eval()
            try:
                return self.stage(x.to(self.device), self.on_device(input_ids))
            finally:
                self.stage.train(was_training)

    def on_device(self, ids: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Token ids (or None) where the stage computes, as the embedding takes them."""
        return None if ids is None else ids.to(self.device, torch.long)

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

    def stash(self) -> dict[str, torch.Tensor]:
        """A copy of the stage's weights, as leaves that collect the gradient of the forwards run on them (weight
        stashing: microbatches.py, relay.py)."""
        with self.lock, torch.no_grad():
            return {name: param.detach().clone().requires_grad_(True) for name, param in self.stage.named_parameters()}

    def apply_stashed(self, weights: dict[str, torch.Tensor]) -> None:
        """Clip and step the live weights on the gradient gathered in `weights` (a stash)."""
        for name, param in self.stage.named_parameters():
            param.grad = weights[name].grad
        self._apply()

    def _apply(self) -> None:
        """Clip and step on the gradients gathered since the last step."""
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr()
        torch.nn.utils.clip_grad_norm_(self.stage.parameters(), self.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._rows = 0
