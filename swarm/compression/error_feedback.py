"""Error feedback: what a lossy codec failed to send this round is added to what the peer sends next round.

With it the sum of decoded contributions over rounds tracks the sum of true pseudo-gradients up to one round's
residual, instead of losing the dropped part for good (essential for top-k and int4).
"""

from __future__ import annotations

import torch

RESIDUAL_KEY = "residual"


class ErrorFeedback:
    """Holds one peer's residual: the part of its last contribution that the codec did not deliver.

    Typical round: to_send = ef.compensate(pseudo_gradient); payload = codec.encode(to_send);
    ef.update(to_send, codec.decode(payload)). The residual lives on the device of the tensors it is given.
    """

    def __init__(self, enabled: bool = True, decay: float = 1.0) -> None:
        self.enabled = enabled  # False: a pass-through that keeps no residual (Codec.error_feedback)
        self.decay = decay  # what the residual counts for next round (Codec.feedback_decay)
        self._residual: torch.Tensor | None = None

    @property
    def residual(self) -> torch.Tensor | None:
        """The current residual (float32, shape of the last `to_send`), or None before the first update."""
        return self._residual

    def compensate(self, pseudo_gradient: torch.Tensor, in_place: bool = False) -> torch.Tensor:
        """Returns a new float32 tensor pseudo_gradient + decay * residual (a float32 copy before the first update),
        or, `in_place`, a float32 `pseudo_gradient` itself with it added (no model's worth of a copy).

        Raises ValueError if the residual has a different number of elements than pseudo_gradient.
        """
        to_send = pseudo_gradient.detach()
        if not (in_place and to_send.dtype == torch.float32):
            to_send = to_send.to(torch.float32, copy=True)
        if not self.enabled:
            return to_send
        if self._residual is None:
            return to_send
        if self._residual.numel() != to_send.numel():
            raise ValueError(
                f"error feedback residual has {self._residual.numel()} elements, pseudo-gradient has "
                f"{to_send.numel()}; call reset() when the parameters change"
            )
        return to_send.add_(self._residual.to(to_send.device).view_as(to_send), alpha=self.decay)

    def update(self, to_send: torch.Tensor, decoded: torch.Tensor) -> None:
        """Sets residual = to_send - decoded. `decoded` may be the flat CPU tensor a codec's decode returns.

        Raises ValueError if the two hold different numbers of elements.
        """
        if to_send.numel() != decoded.numel():
            raise ValueError(f"to_send has {to_send.numel()} elements but decoded has {decoded.numel()}")
        if not self.enabled:
            return
        sent = to_send.detach().to(torch.float32)
        received = decoded.detach().to(device=sent.device, dtype=torch.float32).view_as(sent)
        if self._residual is not None and self._residual.shape == sent.shape and self._residual.device == sent.device:
            torch.sub(sent, received, out=self._residual)  # (in place: no second residual while the first lives)
        else:
            self._residual = (sent - received).contiguous()

    def reset(self) -> None:
        """Forgets the residual (after a model resize, or when a round is abandoned and resent from scratch)."""
        self._residual = None

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Returns {"residual": contiguous float32 tensor} ({} before the first update), ready for safetensors."""
        return {} if self._residual is None else {RESIDUAL_KEY: self._residual}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restores a residual saved by state_dict; raises ValueError on unknown keys or a non-float residual."""
        unknown = set(state) - {RESIDUAL_KEY}
        if unknown:
            raise ValueError(f"unknown error feedback state keys {sorted(unknown)}; expected only {RESIDUAL_KEY!r}")
        residual = state.get(RESIDUAL_KEY)
        if residual is None:
            self._residual = None
            return
        if not isinstance(residual, torch.Tensor) or not residual.is_floating_point():
            raise ValueError(f"error feedback residual must be a float tensor, got {type(residual).__name__}")
        self._residual = residual.detach().to(torch.float32).contiguous().clone()


class FragmentFeedback:
    """One ErrorFeedback per fragment of a model that is averaged a fragment at a time (Streaming DiLoCo: the
    recipe's outer.fragments): what a fragment's codec did not deliver is carried to that fragment's next sync.
    `sizes`: each fragment's elements. Saved as "residual" for a single fragment (as one ErrorFeedback saves it),
    else "residual.K" for fragment K."""

    def __init__(self, sizes: list[int], enabled: bool = True, decay: float = 1.0) -> None:
        self.sizes = list(sizes)
        self.parts = [ErrorFeedback(enabled, decay) for _ in self.sizes]

    @classmethod
    def for_codec(cls, sizes: list[int], codec: str) -> "FragmentFeedback":
        """Residuals for a run averaging with the codec named `codec`: none where it keeps no error feedback."""
        from swarm.compression.registry import get_codec

        codec = get_codec(codec)
        return cls(sizes, codec.error_feedback, codec.feedback_decay)

    def __getitem__(self, fragment: int) -> ErrorFeedback:
        return self.parts[fragment]

    def _key(self, fragment: int) -> str:
        return RESIDUAL_KEY if len(self.parts) == 1 else f"{RESIDUAL_KEY}.{fragment}"

    def reset(self) -> None:
        for part in self.parts:
            part.reset()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {self._key(k): part.residual for k, part in enumerate(self.parts) if part.residual is not None}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> int:
        """Restore the residuals of `state` that are of a fragment of ours and of its size (a checkpoint of
        another fragment count or model leaves the others empty: they start again from nothing); returns how many
        were restored."""
        restored = 0
        for k, part in enumerate(self.parts):
            residual = state.get(self._key(k))
            if isinstance(residual, torch.Tensor) and residual.numel() == self.sizes[k] and part.enabled:
                part.load_state_dict({RESIDUAL_KEY: residual})
                restored += 1
        return restored
