"""DiLoCo around an ordinary inner optimizer: the global params (fp32, CPU) and the outer Nesterov optimizer
live beside the local model; a round's pseudo-gradient is global minus local, and the outer step applies the
group's average of them and resets the local model to the new global params. The last few outer steps are kept
(OuterStep), so a peer a few rounds behind can replay them instead of downloading the whole state.
"""

from __future__ import annotations

import hashlib
import threading
from collections import deque
from dataclasses import dataclass
from typing import Optional

import torch

from swarm.compression import decode
from swarm.config import OuterRecipe


@dataclass(frozen=True)
class OuterStep:
    """One applied outer step, enough to redo it: the averaged pseudo-gradient and tokens that took the state of
    round `round` with state digest `digest` (round, params and outer momentum) to the state digest `after`. The
    average is kept as the encoded chunks every member of the group decoded (`wire`: (start, end, bytes), in
    order), so it costs what it cost on the wire (int8: about a byte a param), or in fp32 where it never travelled
    encoded (the ring's)."""

    round: int
    digest: str
    after: str
    tokens: int
    average: Optional[torch.Tensor] = None
    wire: Optional[tuple[tuple[int, int, bytes], ...]] = None

    @property
    def nbytes(self) -> int:
        if self.wire is not None:
            return sum(len(payload) for _, _, payload in self.wire)
        return self.average.numel() * 4

    def vector(self, numel: int) -> torch.Tensor:
        """The average, flat fp32; ValueError if it does not hold `numel` values."""
        if self.wire is None:
            if self.average is None or self.average.numel() != numel:
                raise ValueError(f"outer step of round {self.round} has no average of {numel} values")
            return self.average.to(torch.float32)
        out, at = torch.empty(numel, dtype=torch.float32), 0
        for start, end, payload in self.wire:
            if start != at or not start < end <= numel:
                raise ValueError(f"outer step of round {self.round}: chunks do not cover its {numel} values")
            part = decode(payload, max_numel=end - start)
            if part.numel() != end - start or not torch.isfinite(part).all():
                raise ValueError(f"outer step of round {self.round}: a chunk of the wrong size or not finite")
            out[start:end] = part
            at = end
        if at != numel:
            raise ValueError(f"outer step of round {self.round}: chunks do not cover its {numel} values")
        return out


def _momenta(params: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> list[Optional[torch.Tensor]]:
    return [optimizer.state.get(p, {}).get("momentum_buffer") for p in params]


def _outer_update(params: list[torch.Tensor], optimizer: torch.optim.Optimizer, average: torch.Tensor) -> None:
    """One outer optimizer step on `params` along the flat averaged pseudo-gradient."""
    offset = 0
    for param in params:
        param.grad = average[offset:offset + param.numel()].view_as(param).to(torch.float32).clone()
        offset += param.numel()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


class DiLoCo:
    """Global params + outer optimizer of one peer. Thread-safe snapshots for serving state to other peers."""

    def __init__(self, model: torch.nn.Module, outer: OuterRecipe, log_bytes: Optional[int] = None):
        self.model = model
        self.names = [name for name, _ in model.named_parameters()]
        self.local_params = [param for _, param in model.named_parameters()]
        self.global_params = [param.detach().to("cpu", torch.float32).clone() for param in self.local_params]
        self.outer_optimizer = torch.optim.SGD(self.global_params, lr=outer.lr, momentum=outer.momentum,
                                               nesterov=outer.nesterov and outer.momentum > 0)
        self.numel = sum(p.numel() for p in self.global_params)
        self.round = 0
        self.tokens_seen = 0
        self.lock = threading.RLock()  # guards global params and optimizer state against concurrent readers
        self._digest: Optional[str] = None
        # The latest outer steps, in order and unbroken (a state loaded from elsewhere starts a new log), holding
        # at most `log_bytes`, by default the bytes of one state: about 8 rounds of an int8 all-reduce, 4 of an
        # fp16 one, 2 of an fp32 one.
        self.replay_log: deque[OuterStep] = deque()
        self.log_bytes = 8 * self.numel if log_bytes is None else log_bytes

    def pseudo_gradient(self) -> torch.Tensor:
        """Flat fp32 vector of global minus local params, in parameter order."""
        with torch.no_grad():
            return torch.cat([(g - l.detach().to("cpu", torch.float32)).view(-1)
                              for g, l in zip(self.global_params, self.local_params)])

    def outer_step(self, average: torch.Tensor, tokens: int,
                   wire: Optional[list[tuple[int, int, bytes]]] = None, log: bool = True) -> None:
        """Apply the averaged pseudo-gradient with the outer optimizer, advance the round, reset local params.
        `wire`: the encoded chunks `average` was decoded from (AllReduceResult.wire), kept for replaying; `log`
        False for a step nobody could replay (from a mixing group's state, which only its members held)."""
        if average.numel() != self.numel:
            raise ValueError(f"averaged pseudo-gradient has {average.numel()} elements, expected {self.numel}")
        with self.lock, torch.no_grad():
            before, round_before = self.digest() if log else "", self.round
            _outer_update(self.global_params, self.outer_optimizer, average)
            self.round += 1
            self.tokens_seen += int(tokens)
            self._digest = None
            if log:
                self._log(OuterStep(round_before, before, self.digest(), int(tokens),
                                    None if wire else average.to(torch.float32).clone(), tuple(wire) if wire else None))
        self.reset_local()

    def _log(self, step: OuterStep) -> None:
        self.replay_log.append(step)
        while sum(s.nbytes for s in self.replay_log) > self.log_bytes:
            self.replay_log.popleft()

    def steps_since(self, round_no: int, digest: str) -> list[OuterStep]:
        """The logged outer steps that take the state of `round_no` with params `digest` to ours (empty if the
        log does not reach back to it)."""
        with self.lock:
            steps = list(self.replay_log)
        for i, step in enumerate(steps):
            if step.round == round_no and step.digest == digest:
                return steps[i:]
        return []

    def replay(self, steps: list[OuterStep]) -> None:
        """Redo another peer's outer steps from our state, checking the state digest before and after each, then
        take the result. They run on a copy, so the lock (which the heartbeat needs) stays free meanwhile and a
        refused step leaves everything, local params included, as it was: ValueError if one does not apply to our
        state or ends elsewhere, or if our state changed in the meantime."""
        with self.lock:
            start = (self.round, self.digest())
            tokens_seen = self.tokens_seen
            params = [p.clone() for p in self.global_params]
            buffers = _momenta(self.global_params, self.outer_optimizer)
            optimizer = torch.optim.SGD(params, **self.outer_optimizer.defaults)
            for param, buffer in zip(params, buffers):
                if buffer is not None:
                    optimizer.state[param]["momentum_buffer"] = buffer.clone()
        round_no, digest = start
        with torch.no_grad():
            for step in steps:
                if step.round != round_no or step.digest != digest:
                    raise ValueError(f"the outer step of round {step.round} is not from our state")
                _outer_update(params, optimizer, step.vector(self.numel))
                round_no, tokens_seen = round_no + 1, tokens_seen + step.tokens
                digest = state_digest(params, _momenta(params, optimizer), round_no)
                if digest != step.after:
                    raise ValueError(f"the outer step of round {step.round} ends at another state")
        with self.lock, torch.no_grad():
            if (self.round, self.digest()) != start:
                raise ValueError("our state changed while replaying")
            for mine, new in zip(self.global_params, params):
                mine.copy_(new)
                buffer = optimizer.state.get(new, {}).get("momentum_buffer")
                if buffer is not None:
                    self.outer_optimizer.state[mine]["momentum_buffer"] = buffer
                else:
                    self.outer_optimizer.state.pop(mine, None)
            self.round, self.tokens_seen, self._digest = round_no, tokens_seen, digest
            for step in steps:
                self._log(step)  # so we can pass them on
        self.reset_local()

    def flat_local(self) -> torch.Tensor:
        """Local params, flat fp32 on the CPU (parameter order)."""
        with torch.no_grad():
            return torch.cat([p.detach().to("cpu", torch.float32).view(-1) for p in self.local_params])

    def flat_global(self) -> torch.Tensor:
        """A copy of the global params, flat (parameter order)."""
        with self.lock:
            return torch.cat([p.view(-1) for p in self.global_params]).clone()

    def flat_state(self) -> torch.Tensor:
        """Global params then outer momentum (zeros before the first outer step, which torch's SGD treats the
        same), flat fp32: what a mixing group averages besides the pseudo-gradients."""
        with self.lock:
            momentum = _momenta(self.global_params, self.outer_optimizer)
            return torch.cat([p.view(-1) for p in self.global_params] +
                             [(torch.zeros_like(p) if m is None else m).view(-1)
                              for p, m in zip(self.global_params, momentum)])

    def load_flat_state(self, state: torch.Tensor) -> None:
        """Set global params and outer momentum from a `flat_state()` layout (a mixing group's average of them),
        before the outer step applies the group's averaged pseudo-gradient."""
        if state.numel() != 2 * self.numel:
            raise ValueError(f"averaged state has {state.numel()} elements, expected {2 * self.numel}")
        with self.lock, torch.no_grad():
            offset = 0
            for param in self.global_params:
                param.copy_(state[offset:offset + param.numel()].view_as(param))
                momentum = state[self.numel + offset:self.numel + offset + param.numel()].view_as(param)
                if self.outer_optimizer.defaults["momentum"] > 0:
                    self.outer_optimizer.state[param]["momentum_buffer"] = momentum.to(torch.float32).clone()
                offset += param.numel()
            self._digest = None
            self.replay_log.clear()  # a mixed state is nobody's to replay from

    def reset_local(self) -> None:
        """Local params := global params (cast to the model's device and dtype)."""
        with torch.no_grad():
            for local, global_ in zip(self.local_params, self.global_params):
                local.copy_(global_.to(local.device, local.dtype))

    def add_to_local(self, delta: torch.Tensor) -> None:
        """Local params += `delta` (flat fp32, parameter order): re-applies local progress on new global params."""
        with torch.no_grad():
            offset = 0
            for local in self.local_params:
                local.add_(delta[offset:offset + local.numel()].view_as(local).to(local.device, local.dtype))
                offset += local.numel()

    def digest(self) -> str:
        """The state digest (round, global params and outer momentum) the swarm compares and announces."""
        with self.lock:
            if self._digest is None:
                self._digest = state_digest(self.global_params, _momenta(self.global_params, self.outer_optimizer),
                                            self.round)
            return self._digest

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Global params and outer momentum as named CPU tensors (a consistent snapshot)."""
        with self.lock:
            tensors = {f"params.{name}": p.clone() for name, p in zip(self.names, self.global_params)}
            for name, param in zip(self.names, self.global_params):
                buffer = self.outer_optimizer.state.get(param, {}).get("momentum_buffer")
                if buffer is not None:
                    tensors[f"momentum.{name}"] = buffer.clone()
            return tensors

    def load_state_tensors(self, tensors: dict[str, torch.Tensor], round_no: int, tokens_seen: int) -> None:
        """Replace global params and outer momentum; raises ValueError if names or shapes do not match."""
        for name, param in zip(self.names, self.global_params):
            found = tensors.get(f"params.{name}")
            if found is None or found.shape != param.shape:
                raise ValueError(f"state has no tensor params.{name} of shape {tuple(param.shape)}")
        with self.lock, torch.no_grad():
            for name, param in zip(self.names, self.global_params):
                param.copy_(tensors[f"params.{name}"])
                buffer = tensors.get(f"momentum.{name}")
                if buffer is not None and buffer.shape == param.shape:
                    self.outer_optimizer.state[param]["momentum_buffer"] = buffer.to(torch.float32).clone()
                else:
                    self.outer_optimizer.state.pop(param, None)
            self.round, self.tokens_seen = int(round_no), int(tokens_seen)
            self._digest = None
            self.replay_log.clear()
        self.reset_local()


def state_digest(params: list[torch.Tensor], momenta: list[Optional[torch.Tensor]], round_no: int) -> str:
    """sha256 (first 16 hex digits) of the outer round, the raw bytes of `params`, then those of their outer
    momentum buffers (None, no buffer yet, counts as zeros: torch's SGD treats the two the same): equal iff the two
    states are of the same round and bit-identical, and so take the same next outer step."""
    digest = hashlib.sha256(int(round_no).to_bytes(8, "little"))
    for tensor in params:
        digest.update(_raw(tensor))
    for param, momentum in zip(params, momenta, strict=True):
        digest.update(bytes(param.numel() * param.element_size()) if momentum is None else _raw(momentum))
    return digest.hexdigest()[:16]


def _raw(tensor: torch.Tensor) -> bytes:
    return tensor.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
