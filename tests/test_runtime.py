"""The loop thread every peer runs its networking on."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import subprocess
import sys
import threading
import weakref
from pathlib import Path

from conftest import wait_until
from swarm.events import EventLog
from swarm.peer.stop import Stop
from swarm.runtime import LoopThread

ROOT = Path(__file__).resolve().parent.parent


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


def test_a_stop_refuses_interruptible_work_submitted_after_it():
    """A stop signal cancels what the loop was given; a peer that checked its stop flag just before the signal
    would still start matchmaking after it, and wait there past the stop deadline (CI saw it). So after
    cancel_submitted(interrupt=True), interruptible work is cancelled without starting, at once; other work (the
    offline record, the final checkpoint's network part) still runs."""
    import concurrent.futures
    import time

    import pytest

    loop = LoopThread()
    started = []

    async def matchmaking() -> None:
        started.append(True)
        await asyncio.sleep(60)

    try:
        waiting = loop.submit(matchmaking(), interruptible=True)
        wait_until(lambda: started, 5)
        assert started and loop.cancel_submitted(interrupt=True) == 1
        with pytest.raises(concurrent.futures.CancelledError):
            waiting.result(timeout=2)
        began = time.monotonic()
        with pytest.raises(concurrent.futures.CancelledError):
            loop.run(matchmaking(), timeout=30, interruptible=True)
        assert time.monotonic() - began < 1 and len(started) == 1, "the coroutine never started"
        assert loop.run(asyncio.sleep(0, result="offline record"), timeout=5) == "offline record"
    finally:
        loop.close()


def test_cancel_without_interrupt_leaves_later_work_alone():
    """Without `interrupt`, cancelling what was submitted does not refuse interruptible work that comes after."""
    loop = LoopThread()
    try:
        assert loop.cancel_submitted() == 0
        assert loop.run(asyncio.sleep(0, result=3), timeout=5, interruptible=True) == 3
    finally:
        loop.close()


def test_a_stop_between_the_check_and_the_submission_still_cancels_it(monkeypatch):
    """The stop signal's handler runs on the main thread, which may itself be inside submit() (a first stage sends
    its pipeline hops from there): so submit takes no lock, and a stop landing after its check of the flag and
    before the future is listed must still cancel the work. Here the stop lands exactly there."""
    import concurrent.futures

    import pytest

    import swarm.runtime as runtime

    loop = LoopThread()
    original = runtime.asyncio.run_coroutine_threadsafe

    def stop_lands_now(coro, target):
        future = original(coro, target)
        assert loop.cancel_submitted(interrupt=True) == 0  # (this future is not listed yet)
        return future

    try:
        monkeypatch.setattr(runtime.asyncio, "run_coroutine_threadsafe", stop_lands_now)
        with pytest.raises(concurrent.futures.CancelledError):
            loop.run(asyncio.sleep(60), timeout=5, interruptible=True)
    finally:
        monkeypatch.undo()
        loop.close()


STOP_HANDLER_SCRIPT = """
import os, signal, threading
from swarm.runtime import install_stop_handlers
lock, handled = threading.Lock(), threading.Event()

def on_stop(signum):
    with lock:  # what setting an Event takes (its own lock, held by the main thread for a few bytecodes in wait())
        print(threading.current_thread().name, signum, flush=True)
    handled.set()

install_stop_handlers(on_stop)
with lock:
    os.kill(os.getpid(), signal.SIGTERM)
    for _ in range(100000):  # (the handler runs at one of these bytecodes, on the main thread)
        pass
print("handled", handled.wait(10), flush=True)
"""


def test_a_stop_signal_is_handled_off_the_main_thread_whatever_it_holds():
    """The signal handler only queues the signal; `on_stop` runs on the swarm-stop thread, so it may wait on a lock
    the main thread held when the signal came. Run inside the handler, it waited on the main thread itself forever
    (this process hung): a peer could deadlock a stop by setting its stop Event while inside that Event's wait(),
    or raise into whatever the main thread did by writing the event log inside the log's own write."""
    try:
        done = subprocess.run([sys.executable, "-c", STOP_HANDLER_SCRIPT], capture_output=True, text=True,
                              timeout=30, env={**os.environ, "PYTHONPATH": str(ROOT)})
    except subprocess.TimeoutExpired:
        raise AssertionError("the stop handler deadlocked on a lock the main thread held") from None
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[:2] == [f"swarm-stop {int(signal.SIGTERM)}", "handled True"], done.stdout


def test_the_stop_is_seen_before_its_cancellations_and_the_shutdown_waits_for_them():
    """The stop thread sets the stop Event before it cancels the loop's work, so the training loop sees the stop
    before it sees its work cancelled (a cancelled shard fetch ends the batches' generator for good: with the
    cancellations first, the loop read it again and died of a StopIteration, a review's script 20 runs of 40). The
    shutdown's own network work (the offline record, settling) comes after `wait_handled`, so the cancellations
    cannot cut it (with the Event first and no wait: a review's script, 3 runs of 8). The stop's event write is
    held here until the main thread has submitted that work, or 0.2 s (well inside the second `wait_handled` waits
    at most: as long as it, the two timed out together and the test failed on a sound stop)."""
    submitted, seen = threading.Event(), []

    class HeldLog(EventLog):
        def emit(self, event: str, **fields) -> None:
            if event == "stopping":
                submitted.wait(0.2)

    class Loop(LoopThread):
        def cancel_submitted(self, interrupt: bool = False) -> int:
            seen.append(stop.event.is_set())
            return super().cancel_submitted(interrupt)

    loop = Loop()
    stop = Stop(HeldLog(), seconds=60.0)
    stop.loop = loop
    relay = threading.Thread(target=stop.signalled, args=(signal.SIGTERM,), name="swarm-stop")
    try:
        relay.start()
        assert stop.event.wait(5), "the stop set its Event"
        stop.wait_handled()
        shutdown_work = loop.submit(asyncio.sleep(0.5, "offline record sent"))  # (not interruptible)
        submitted.set()
        relay.join(5)
        assert seen == [True], "the Event was set before the cancellations"
        assert shutdown_work.result(5) == "offline record sent"
    finally:
        relay.join(5)
        if stop.watchdog is not None:
            stop.watchdog.cancel()  # (it would end this test process a minute from now)
        loop.close()
