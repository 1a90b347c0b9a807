"""The state digest: what peers compare to know they hold the same global params and outer momentum of the same
round (swarm/peer/diloco.py keeps it, swarm/peer/state/download.py checks a downloaded state against it)."""

from __future__ import annotations

from typing import Optional

import blake3
import torch

ZEROS = bytes(1 << 20)


def state_digest(params: list[torch.Tensor], momenta: list[Optional[torch.Tensor]], round_no: int,
                 fragments: Optional[list[tuple[int, int]]] = None,
                 parts: Optional[list[Optional[bytes]]] = None) -> str:
    """blake3 (first 16 hex digits) of the outer round, the raw bytes of `params`, then those of their outer
    momentum buffers (None, no buffer yet, counts as zeros: torch's SGD treats the two the same): equal iff the two
    states are of the same round and bit-identical, and so take the same next outer step. Read in place (no copy of
    a CPU tensor) on all cores: about 0.2 s for the 0.7 GB of a 92M-parameter state on 2 cores.

    With several `fragments` (Streaming DiLoCo), blake3 of the round and each fragment's digest in order (its
    params' bytes, then its momenta's), so an outer step, which changes one fragment, costs that fragment's hash:
    `parts` holds the fragments' digests where known, and the missing ones (None) are computed and put in it."""
    digest = blake3.blake3(int(round_no).to_bytes(8, "little"), max_threads=blake3.blake3.AUTO)
    if fragments is None or len(fragments) == 1:
        _hash_into(digest, params, momenta)
        return digest.hexdigest()[:16]
    parts = [None] * len(fragments) if parts is None else parts
    for k, (start, end) in enumerate(fragments):
        if parts[k] is None:
            parts[k] = _hash_into(blake3.blake3(max_threads=blake3.blake3.AUTO), params[start:end],
                                  momenta[start:end]).digest()
        digest.update(parts[k])
    return digest.hexdigest()[:16]


def _hash_into(digest, params: list[torch.Tensor], momenta: list[Optional[torch.Tensor]]):
    for tensor in params:
        digest.update(_raw(tensor))
    for param, momentum in zip(params, momenta, strict=True):
        if momentum is not None:
            digest.update(_raw(momentum))
            continue
        left = param.numel() * param.element_size()
        while left:
            digest.update(memoryview(ZEROS)[:min(left, len(ZEROS))])
            left -= min(left, len(ZEROS))
    return digest


def _raw(tensor: torch.Tensor):
    """`tensor`'s bytes as a buffer, without a copy where it is a contiguous CPU tensor."""
    return tensor.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy()
