"""The loop thread every peer runs its networking on."""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref

from swarm.runtime import LoopThread


def test_a_submitted_and_forgotten_coroutine_survives_garbage_collection():
    """asyncio holds tasks weakly. A heartbeat submitted and forgotten, waiting on a future that only a weak
    registry knows (as hivemind's futures are resolved), must still run to the end: a collected heartbeat made a
    peer invisible to the others and left it out of every group."""
    loop = LoopThread()
    finished = threading.Event()
    registry: list[weakref.ref] = []

    async def heartbeat() -> None:
        future = asyncio.get_running_loop().create_future()
        registry.append(weakref.ref(future))
        await future
        finished.set()

    def resolve() -> None:
        gc.collect()  # what a busy peer's allocations do at some moment
        future = registry[0]() if registry else None
        if future is not None:
            future.set_result(None)

    loop.submit(heartbeat())
    gc.collect()
    loop.loop.call_soon_threadsafe(loop.loop.call_later, 0.2, resolve)
    try:
        assert finished.wait(10), "the forgotten coroutine was garbage-collected while it waited"
    finally:
        loop.close()


def test_close_right_after_start_stops_and_closes_the_loop():
    """A peer whose start-up fails at once (a bad --initial-peers) closes its loop thread a moment after creating
    it. The loop must end closed: a loop left to the garbage collector at interpreter exit was sometimes closed
    after its self-pipe's socket, and the process printed a traceback after its one-line error (seen in CI)."""
    for _ in range(20):
        loop = LoopThread()
        loop.close()
        assert loop.loop.is_closed() and not loop._thread.is_alive()
        loop.close()  # twice is harmless
    used = LoopThread()
    assert used.run(asyncio.sleep(0, result=7), timeout=5) == 7
    used.close()
    assert used.loop.is_closed()
