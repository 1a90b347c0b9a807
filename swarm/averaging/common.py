"""What the group all-reduce's server (allreduce.py) and its runs (run.py, butterfly.py, ring.py) share: how a part
is cut into chunks and how large an encoded chunk can be, how an attempt ends (AllReduceError, AllReduceResult),
where a group's messages wait (Mailbox), and how an attempt's concurrent tasks are run."""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from swarm.compression import Codec

COMMIT_GRACE = 2.0  # s to wait for the commit of a member our own commit could not reach (it is likely dead)
MIN_CHUNK = 1 << 16  # elements; chunk sizes are multiples of CHUNK_ALIGN so codec blocks never straddle chunks
CHUNK_ALIGN = 4096
CHUNKS_PER_PART = 64
FRAME_SLACK = 4096  # bytes a chunk's frame may exceed its codec's size by (float rounding of bytes_per_param)
TOPK_INDEX_BYTES = 4  # the most bytes top-k spends on one kept position (it picks the smallest index coding)


def chunk_bounds(start: int, end: int, split: Optional[int] = None) -> list[tuple[int, int]]:
    """[start, end) cut into about CHUNKS_PER_PART chunks of at least MIN_CHUNK elements (the same on every peer),
    none of which straddles `split` (where the vector's lossless tail begins)."""
    if split is not None and start < split < end:
        return chunk_bounds(start, split) + chunk_bounds(split, end)
    size = max(MIN_CHUNK, CHUNK_ALIGN * -(-(end - start) // (CHUNKS_PER_PART * CHUNK_ALIGN)))
    return [(a, min(a + size, end)) for a in range(start, end, size)]


def max_encoded_len(codec: Codec, numel: int) -> int:
    """The most bytes an honest member's chunk of `numel` elements takes on the wire under `codec` (header
    included), plus FRAME_SLACK: a larger frame is refused before it is read."""
    if numel <= 0:
        return FRAME_SLACK
    size = math.ceil(codec.bytes_per_param(numel) * numel)
    if codec.name == "topk":  # bytes_per_param expects spread positions; clustered ones take up to 4 bytes each
        size += TOPK_INDEX_BYTES * codec.kept_count(numel)
    return size + FRAME_SLACK


@dataclass(frozen=True)
class StreamBound:
    """What one member may send us in one stream of one phase: at most `chunks` chunks, each payload frame at
    most `payload` bytes (the largest chunk of the part it sends, encoded)."""

    chunks: int
    payload: int


class AllReduceError(RuntimeError):
    """The attempt failed and nothing was applied. `reason` is a short metric label. `suspects` did not deliver
    (not waited for in the retry, but welcome if they show up); `rejected` sent bad data (left out of this round)."""

    def __init__(self, reason: str, message: str, suspects: set[str], rejected: set[str] = frozenset()):
        super().__init__(message)
        self.reason, self.suspects, self.rejected = reason, set(suspects), set(rejected)


@dataclass
class AllReduceResult:
    average: torch.Tensor  # flat fp32, identical on every member
    # our vector as the reducers decoded it: what error feedback compares against (None for a codec without it)
    delivered: Optional[torch.Tensor]
    total_weight: float
    group_size: int
    bytes_sent: int
    bytes_received: int
    seconds: float
    # The average as every member decoded it: (start, end, encoded bytes) per chunk, in order, or None where it
    # never travelled encoded (the ring's fp32). A peer that missed the round can redo it from these bytes.
    wire: Optional[list[tuple[int, int, bytes]]] = None
    verification_seconds: float = 0.0  # of `seconds`: checking the reducers' averages once every member committed


@dataclass
class Mailbox:
    """Messages of one group, which may arrive before this peer has started that group's all-reduce."""

    created: float = field(default_factory=time.monotonic)
    slots: dict[tuple[str, str, int], asyncio.Future] = field(default_factory=dict)

    def slot(self, phase: str, sender: str, chunk: int = -1) -> asyncio.Future:
        key = (phase, sender, chunk)
        if key not in self.slots:
            self.slots[key] = asyncio.get_running_loop().create_future()
        return self.slots[key]


async def all_or_first_failure(coroutines: list) -> None:
    """Run them together until all are done or one fails; a failure (a conflict, a fatal error) cancels the rest
    and is raised at once, so nobody waits out timeouts for an attempt that is over."""
    running = [asyncio.ensure_future(coroutine) for coroutine in coroutines]
    try:
        done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            if task.exception() is not None:
                raise task.exception()
    finally:
        for task in running:
            task.cancel()


async def no_chunks():
    return
    yield  # an empty async generator


def first_line(error: Exception) -> str:
    """An error's first line for a log line, or its type when it has no text."""
    return str(error).splitlines()[0] if str(error) else type(error).__name__
