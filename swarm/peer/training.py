"""The inner loop's pieces: one AdamW (or Muon) step (bf16 autocast on CUDA: swarm.model.device), the warm-up + cosine
learning-rate schedule over the run's tokens, validation loss, and the clock of training speed and utilisation."""

from __future__ import annotations

import ctypes
import functools
import math
import sys
import time
from typing import Callable, Optional, TypeVar

import torch

from swarm.config import InnerRecipe
from swarm.model.build import hidden_size, lm_loss

O = TypeVar("O", bound=torch.optim.Optimizer)


def learning_rate(inner: InnerRecipe, tokens: int, total_tokens: int) -> float:
    """Linear warm-up over the recipe's warm-up tokens, then cosine decay to `min_lr_ratio * lr` at `total_tokens`.
    `inner` is resolved for the model (InnerRecipe.resolved): its lr is a number."""
    peak = _peak(inner)
    warmup = inner.warmup(total_tokens)
    if warmup and tokens < warmup:
        return peak * max(tokens, 1) / warmup
    span = max(total_tokens - warmup, 1)
    progress = min(max(tokens - warmup, 0) / span, 1.0)
    floor = inner.min_lr_ratio * peak
    return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def inner_for(inner: InnerRecipe, model: torch.nn.Module) -> InnerRecipe:
    """`inner` resolved for `model` (a whole model, or the whole model a stage is cut from): its lr a number."""
    return inner.resolved(hidden_size(model))


def _peak(inner: InnerRecipe) -> float:
    if inner.lr is None:
        raise ValueError("inner.lr is null: the inner loop takes the recipe resolved for its model "
                         "(InnerRecipe.resolved(hidden size))")
    return inner.lr


def schedule_tokens(tokens_seen: int, tokens_in_round: int, last_group_size: int) -> int:
    """The swarm's position in the lr schedule: tokens averaged so far plus this round's, estimated as ours times
    the size of the last group (every peer computes it from its own state, so runs are reproducible)."""
    return tokens_seen + tokens_in_round * max(last_group_size, 1)


def make_inner_optimizer(model: torch.nn.Module, inner: InnerRecipe) -> "torch.optim.Optimizer | Optimizers":
    """The recipe's inner optimizer over `model` (a whole model or a stage): AdamW, weight decay on matrices only;
    or, with `optimizer: muon`, Muon on the blocks' weight matrices (muon_params) and AdamW on the rest."""
    matrices = muon_params(model) if inner.optimizer == "muon" else []
    taken = {id(p) for p in matrices}
    decay = [p for p in model.parameters() if p.ndim >= 2 and id(p) not in taken]
    no_decay = [p for p in model.parameters() if p.ndim < 2]  # norms and biases are not decayed
    adamw = eager(torch.optim.AdamW, [{"params": decay, "weight_decay": inner.weight_decay},
                                      {"params": no_decay, "weight_decay": 0.0}],
                  lr=_peak(inner), betas=(inner.beta1, inner.beta2))
    if not matrices:
        return adamw
    muon = eager(torch.optim.Muon, matrices, lr=_peak(inner), weight_decay=inner.weight_decay,
                 adjust_lr_fn="match_rms_adamw")
    return Optimizers([muon, adamw])


def eager(optimizer_class: type[O], *args, **kwargs) -> O:
    """`optimizer_class(*args, **kwargs)`, which never imports torch._dynamo. torch guards an optimizer for
    torch.compile, which a peer never runs: its add_param_group, zero_grad, state_dict and load_state_dict are marked
    not to be compiled, and most classes' step runs inside a wrapper that breaks a compiled graph; both import
    torch._dynamo at their first call: 1.4-2.4 s of CPU and 50-70 MB in every peer (docs/measured.md#start-up).
    The marks are resolved ahead to the methods themselves (what they are outside a compiled graph), and the step
    runs torch's own step function under no_grad, as the wrapper does for an optimizer that is not differentiable.
    Where torch's wrapping is not the one known here, it is left as it is."""
    if "torch._dynamo" not in sys.modules:
        for name in ("add_param_group", "zero_grad", "state_dict", "load_state_dict"):
            marked = getattr(torch.optim.Optimizer, name, None)
            code = getattr(marked, "__code__", None)
            method = getattr(marked, "__wrapped__", None)
            if code is not None and code.co_name == "inner" and "fn" in code.co_freevars and callable(method):
                setattr(method, "__dynamo_disable", method)  # (torch._compile._disable_dynamo's cache of its wrapper)
    optimizer = optimizer_class(*args, **kwargs)
    step = _unguarded_step(type(optimizer).step)
    if step is not None and not optimizer.defaults.get("differentiable"):
        optimizer.step = functools.partial(_step_without_grad, step, optimizer)  # (an instance attribute)
    return optimizer


def _unguarded_step(step: Callable) -> Optional[Callable]:
    """The function under torch's step wrapper for torch.compile (torch.optim.optimizer's _use_grad, itself under the
    profiling hook's wrapper), or None where `step` has no such wrapper."""
    while step is not None:
        code = getattr(step, "__code__", None)
        if code is not None and code.co_name == "_use_grad":
            return getattr(step, "__wrapped__", None)
        step = getattr(step, "__wrapped__", None)
    return None


def _step_without_grad(step: Callable, optimizer: torch.optim.Optimizer, closure: Optional[Callable] = None):
    with torch.no_grad():
        return step(optimizer, closure)


def muon_params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The 2-D weights Muon is for: those of the hidden layers, not of an embedding or the LM head (a transformers
    model's lm_head, a last stage's head, or tied to an embedding), which an element-wise optimizer trains better
    (Muon's authors' advice)."""
    excluded = {id(p) for name, module in model.named_modules()
                if isinstance(module, torch.nn.Embedding) or name.rsplit(".", 1)[-1] in ("lm_head", "head")
                for p in module.parameters()}
    return [p for p in model.parameters() if p.ndim == 2 and id(p) not in excluded]


class Optimizers:
    """Several optimizers over disjoint params, stepped as one: what the inner loop needs of an optimizer
    (param_groups, whose lr it sets, step, zero_grad)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict]:
        return [group for optimizer in self.optimizers for group in optimizer.param_groups]

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)


def inner_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor,
               device: torch.device, lr: float, grad_clip: float) -> float:
    """One AdamW step; returns the loss (may be NaN/inf: the caller decides what to do then)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    loss = lm_loss(model, batch, device)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    on_cpu = device.type == "cpu"
    # On the CPU the gradients stay, zeroed in place (a GPU frees them for the forward pass's activations), and the
    # heap's free pages go back to the kernel: glibc keeps freed memory resident, and gradients, activations and a
    # round's buffers freed and taken again in other shapes cost a 92M peer 2.8 bytes a parameter of peak
    # (docs/measured.md#scale). The same steps bit for bit (test_inner_optimizer.py).
    optimizer.zero_grad(set_to_none=not on_cpu)
    if on_cpu:
        _trim(0)
    return float(loss.detach())


def _malloc_trim() -> Callable[[int], int]:
    """glibc's malloc_trim: hands the C heap's free pages back to the kernel."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # another C library (musl, macOS): its heap is its own business
        return lambda pad: 0


_trim = _malloc_trim()


# Of a whole-model peer's wall time, at most, spent on validation losses (issue 39: a round's overhead a few
# percent of it, validation included; a 92M model's ten seconds on one CPU thread come every eight minutes)...
VALIDATION_SHARE = 0.02
VALIDATION_FREE = 1.0  # ...unless one takes less than this many seconds: then after every round


@torch.no_grad()
def validation_loss(model: torch.nn.Module, batches: list[torch.Tensor], device: torch.device) -> float:
    model.eval()
    try:
        return sum(float(lm_loss(model, batch, device)) for batch in batches) / max(len(batches), 1)
    finally:
        model.train()


class ValidationBudget:
    """When a whole-model peer measures the validation loss after a round: when the last one took under
    VALIDATION_FREE seconds (a small model: every round), or the time since it is enough for its cost to stay
    within `share` of it (every few rounds for a model whose validation takes seconds, as a 92M model's ten on one
    CPU thread do)."""

    def __init__(self, share: float = VALIDATION_SHARE, clock=time.monotonic):
        self.share, self.clock = share, clock
        self.cost, self.last = 0.0, clock()

    def due(self) -> bool:
        return self.cost < VALIDATION_FREE or self.cost <= self.share * (self.clock() - self.last)

    def measure(self, loss: Callable[[], Optional[float]]) -> Optional[float]:
        """`loss()` if due (timing it), else None."""
        if not self.due():
            return None
        started = self.clock()
        try:
            return loss()
        finally:
            self.last = self.clock()
            self.cost = self.last - started


class StepClock:
    """Time in inner steps against wall time (compute utilisation), and the training speed measured over a window
    of `window` seconds (what a peer announces as its tokens/s)."""

    def __init__(self, window: float = 2.0, clock=time.monotonic):
        self.window, self.clock = window, clock
        self.started = self.window_start = clock()
        self.compute_seconds = 0.0
        self._lap = (self.started, 0.0)  # (time, compute seconds) when the last round was reported
        self.window_tokens = 0

    def stepped(self, seconds: float, tokens: int) -> Optional[float]:
        """Count one inner step; returns the tokens/s of the window it closed, if it closed one."""
        self.compute_seconds += seconds
        self.window_tokens += tokens
        elapsed = self.clock() - self.window_start
        if elapsed < self.window:
            return None
        rate = self.window_tokens / elapsed
        self.window_start, self.window_tokens = self.clock(), 0
        return rate

    def lap(self) -> tuple[float, float]:
        """(wall seconds, seconds in inner steps) since the last call, or since training started: a round's, from
        one round's report to the next."""
        now = self.clock()
        (then, computed), self._lap = self._lap, (now, self.compute_seconds)
        return now - then, self.compute_seconds - computed

    def utilization(self) -> float:
        return self.compute_seconds / max(self.clock() - self.started, 1e-9)
