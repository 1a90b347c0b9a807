"""The outer optimizer's arithmetic and what DiLoCo keeps of it: the fragments Streaming DiLoCo cuts the params
into, one outer step along a flat averaged pseudo-gradient (torch's SGD, bit for bit, a parameter at a time), and
the record of an applied step (OuterStep) that a peer behind replays."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from swarm.compression import decode
from swarm.config import RecipeError


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


def fragment_bounds(sizes: list[int], parts: int) -> list[tuple[int, int]]:
    """Cut parameters of `sizes` elements, in order, into `parts` runs [start, end) of parameter indices, none
    empty, each ending at the parameter boundary nearest to its share of the total. RecipeError if there are fewer
    parameters than parts."""
    if not 1 <= parts <= len(sizes):
        raise RecipeError(f"the recipe's outer.fragments {parts}: cannot cut {len(sizes)} parameters into {parts} "
                          f"fragments: set outer.fragments to at most {len(sizes)}")
    total, bounds, start, running = sum(sizes), [], 0, 0
    for k in range(1, parts):
        target, end = total * k / parts, start + 1
        running += sizes[start]
        while end < len(sizes) - (parts - k) and abs(running + sizes[end] - target) < abs(running - target):
            running += sizes[end]
            end += 1
        bounds.append((start, end))
        start = end
    bounds.append((start, len(sizes)))
    return bounds


def momenta(params: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> list[Optional[torch.Tensor]]:
    return [optimizer.state.get(p, {}).get("momentum_buffer") for p in params]


def outer_update(params: list[torch.Tensor], optimizer: torch.optim.SGD, average: torch.Tensor,
                 slots: Optional[list[torch.Tensor]] = None) -> None:
    """One outer step of `optimizer` (torch's SGD, Nesterov or not) on `params` along the flat averaged
    pseudo-gradient, one parameter at a time: the same arithmetic as SGD.step on the CPU (bit for bit), without
    a whole model's worth of gradients set first. The momentum buffers stay in `optimizer.state`; a parameter's
    first one is a copy of its gradient, as torch's, made in `slots` (one a param, where given) if not anew."""
    hyper = optimizer.param_groups[0]
    lr, momentum, dampening, nesterov = hyper["lr"], hyper["momentum"], hyper["dampening"], hyper["nesterov"]
    if hyper["weight_decay"] or hyper.get("maximize"):
        raise ValueError("the outer optimizer takes neither weight decay nor maximize")
    offset = 0
    with torch.no_grad():
        for k, param in enumerate(params):
            grad = average[offset:offset + param.numel()].view_as(param).to(torch.float32)
            offset += param.numel()
            if momentum:
                state = optimizer.state[param]
                buffer = state.get("momentum_buffer")
                if buffer is None:
                    buffer = state["momentum_buffer"] = \
                        torch.clone(grad).detach() if slots is None else slots[k].copy_(grad)
                else:
                    buffer.mul_(momentum).add_(grad, alpha=1 - dampening)
                grad = grad.add(buffer, alpha=momentum) if nesterov else buffer
            param.add_(grad, alpha=-lr)
