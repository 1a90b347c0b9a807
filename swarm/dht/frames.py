"""Frames on our streams: an 8-byte big-endian length, then the bytes. The cap stops a hostile length from making
us allocate without bound; the largest legitimate frame is one model's state (checked by callers against the model).
"""

from __future__ import annotations

import asyncio
import struct

FRAME_HEADER = struct.Struct(">Q")
MAX_FRAME_BYTES = 16 << 30


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
