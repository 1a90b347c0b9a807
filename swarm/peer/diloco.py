"""DiLoCo around an ordinary inner optimizer: the global params (fp32, CPU) and the outer Nesterov optimizer
live beside the local model; a round's pseudo-gradient is global minus local, and the outer step applies the
group's average of them and resets the local model to the new global params.
"""

from __future__ import annotations

import threading
from typing import Optional

import torch

from swarm.config import OuterRecipe
from swarm.peer.model import params_digest


class DiLoCo:
    """Global params + outer optimizer of one peer. Thread-safe snapshots for serving state to other peers."""

    def __init__(self, model: torch.nn.Module, outer: OuterRecipe):
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

    def pseudo_gradient(self) -> torch.Tensor:
        """Flat fp32 vector of global minus local params, in parameter order."""
        with torch.no_grad():
            return torch.cat([(g - l.detach().to("cpu", torch.float32)).view(-1)
                              for g, l in zip(self.global_params, self.local_params)])

    def outer_step(self, average: torch.Tensor, tokens: int) -> None:
        """Apply the averaged pseudo-gradient with the outer optimizer, advance the round, reset local params."""
        if average.numel() != self.numel:
            raise ValueError(f"averaged pseudo-gradient has {average.numel()} elements, expected {self.numel}")
        with self.lock, torch.no_grad():
            offset = 0
            for param in self.global_params:
                param.grad = average[offset:offset + param.numel()].view_as(param).to(torch.float32).clone()
                offset += param.numel()
            self.outer_optimizer.step()
            self.outer_optimizer.zero_grad(set_to_none=True)
            self.round += 1
            self.tokens_seen += int(tokens)
            self._digest = None
        self.reset_local()

    def flat_state(self) -> torch.Tensor:
        """Global params then outer momentum (zeros before the first outer step, which torch's SGD treats the
        same), flat fp32: what a mixing group averages besides the pseudo-gradients."""
        with self.lock:
            momentum = [self.outer_optimizer.state.get(p, {}).get("momentum_buffer") for p in self.global_params]
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
        with self.lock:
            if self._digest is None:
                self._digest = params_digest(self.global_params)
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
        self.reset_local()
