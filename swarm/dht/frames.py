"""Frames on our streams: an 8-byte big-endian length, then the bytes. The cap stops a hostile length from making
us allocate without bound; the largest legitimate frame is one model's state (checked by callers against the model).
Bulk bytes (a state range, a dataset file's range) go as frames of FRAME_BYTES under a stall and a minimum rate, so
a holder that dribbles is dropped and a requester that stops reading is too.
"""

from __future__ import annotations

import asyncio
import struct

FRAME_HEADER = struct.Struct(">Q")
MAX_FRAME_BYTES = 16 << 30
FRAME_BYTES = 1 << 20  # bytes per frame within a range or a step
STALL_SECONDS = 60.0  # a holder that sends nothing for this long is dropped (slow links are fine, silent ones not)
MIN_BYTES_PER_S = 32_000  # a holder slower than this over a whole range or step is dropped (256 kbit/s: a holder
# dribbling a byte just under the stall would otherwise hold a range, and the training thread, forever)


async def send_frame(writer: asyncio.StreamWriter, data: bytes | memoryview) -> None:
    writer.write(FRAME_HEADER.pack(len(data)))
    view = memoryview(data)
    for offset in range(0, len(view), 1 << 20):
        writer.write(view[offset:offset + (1 << 20)])
        await writer.drain()
    await writer.drain()


async def recv_frame(reader: asyncio.StreamReader, max_bytes: int = MAX_FRAME_BYTES) -> bytes:
    """Read one frame; raises ValueError if the peer announces more than `max_bytes`."""
    (length,) = FRAME_HEADER.unpack(await reader.readexactly(FRAME_HEADER.size))
    if length > max_bytes:
        raise ValueError(f"peer announced a {length}-byte frame, over the {max_bytes}-byte limit")
    return await reader.readexactly(length)


async def send_bytes(writer: asyncio.StreamWriter, data: bytes | memoryview) -> None:
    """`data` as frames of FRAME_BYTES, so the receiver can bound each frame it reads."""
    view = memoryview(data)
    for start in range(0, len(view), FRAME_BYTES):
        await send_frame(writer, view[start:start + FRAME_BYTES])


async def receive_bytes(reader: asyncio.StreamReader, size: int, stall: float, what: str) -> bytearray:
    """`size` bytes sent as frames, each within `stall` seconds and all of them at MIN_BYTES_PER_S at least;
    ValueError if the frames add up to anything else, TimeoutError if the holder is too slow."""
    data = bytearray()
    async with asyncio.timeout(stall + size / MIN_BYTES_PER_S):
        while len(data) < size:
            frame = await asyncio.wait_for(recv_frame(reader, FRAME_BYTES), stall)
            if not frame or len(data) + len(frame) > size:
                raise ValueError(f"{what} of the wrong length")
            data += frame
    return data


def failure_reason(error: BaseException) -> str:
    """Why a holder failed us, in a few words for a log line."""
    if isinstance(error, asyncio.TimeoutError):
        return "stalled"
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def answer_seconds(size: int) -> float:
    """The longest a server keeps sending `size` bytes to one requester: what a requester allows a holder (a stall,
    then MIN_BYTES_PER_S), so an honest requester never loses an answer to it and one that stops reading is
    dropped."""
    return STALL_SECONDS + size / MIN_BYTES_PER_S
