"""One asyncio event loop per process, run in a background thread and wrapped once for synchronous callers.

The training loop stays synchronous; network work (DHT calls, streams, handlers) runs on this loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import queue
import signal
import threading
from typing import Awaitable, Callable, Optional, TypeVar

T = TypeVar("T")
logger = logging.getLogger("swarm")


class LoopThread:
    """An asyncio loop in a daemon thread. `run` blocks for a result; `submit` returns a concurrent Future.

    A stop signal cancels what was submitted (`cancel_submitted`) and, with `interrupt`, refuses every
    `interruptible` submission after it: the network phases a stopping peer must not start (matchmaking, an
    all-reduce, a state download, a pipeline hop). Checking a stop flag before submitting is not enough: a signal
    between the check and the submission left a peer in matchmaking past its stop deadline (CI saw it)."""

    def __init__(self, name: str = "swarm-loop"):
        self.loop = asyncio.new_event_loop()
        # Futures of submitted coroutines, until they finish. asyncio holds tasks only weakly: a coroutine submitted
        # and forgotten (a heartbeat), awaiting a future that nothing else holds, is otherwise garbage-collected
        # mid-way ("Task was destroyed but it is pending"), and the heartbeat silently stops.
        self._pending: set[concurrent.futures.Future] = set()
        # Set by cancel_submitted(interrupt=True): interruptible work is refused from then. No lock guards it (a
        # stop signal's handling once ran on the main thread, inside submit() at times, and a lock there deadlocked
        # it); see submit for why the order of the two checks is enough, whichever thread stops.
        self.interrupted = False
        self._running = threading.Event()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()
        self._running.wait()  # so a close() right after this (a failed start-up) finds the loop running

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._running.set)
        self.loop.run_forever()

    def submit(self, coro: Awaitable[T], interruptible: bool = False) -> concurrent.futures.Future:
        """Start `coro` on the loop. If `interruptible` and the loop was interrupted (a stop signal), `coro` never
        starts and the future returned is cancelled."""
        if interruptible and self.interrupted:
            if hasattr(coro, "close"):
                coro.close()  # (never awaited: no "coroutine was never awaited" warning)
            future: concurrent.futures.Future = concurrent.futures.Future()
            future.cancel()
            return future
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        self._pending.add(future)
        future.add_done_callback(self._pending.discard)
        # A stop between the check above and the add: cancel_submitted set `interrupted` before it listed _pending,
        # so either it listed this future (and cancels it) or this check sees the flag.
        if interruptible and self.interrupted:
            future.cancel()
        return future

    def cancel_submitted(self, interrupt: bool = False) -> int:
        """Cancel every submitted coroutine not yet done, the way a stop signal interrupts matchmaking, an
        all-reduce or a state download; whoever waits in run() gets concurrent.futures.CancelledError. With
        `interrupt`, interruptible submissions from now on are cancelled at once too. Returns how many were
        cancelled."""
        if interrupt:
            self.interrupted = True  # (before _pending is listed: see submit)
        pending = [future for future in list(self._pending) if not future.done()]
        for future in pending:
            future.cancel()
        return len(pending)

    def run(self, coro: Awaitable[T], timeout: Optional[float] = None, interruptible: bool = False) -> T:
        """Run `coro` on the loop and wait for it; raises TimeoutError after `timeout` seconds (and cancels it),
        concurrent.futures.CancelledError if a stop signal cancelled it (or, `interruptible`, came before it)."""
        future = self.submit(coro, interruptible)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"timed out after {timeout} s") from None

    def close(self) -> None:
        """Cancel what runs on the loop, stop it and close it. Left unclosed, the loop was closed by the garbage
        collector at interpreter exit, sometimes after its self-pipe's socket, and the process printed a
        traceback ("Invalid file descriptor: -1") after a clean one-line error."""
        if not self.loop.is_running():
            if not self.loop.is_closed() and not self._thread.is_alive():
                self.loop.close()
            return

        async def _cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            self.submit(_cancel_all()).result(5)
        except Exception:  # noqa: BLE001 - shutting down: nothing left to report to
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        if not self._thread.is_alive():
            self.loop.close()


class _Relay:
    """The process's one stop thread and the queue its signal handler feeds (see install_stop_handlers)."""

    def __init__(self, on_stop: Callable[[int], None]):
        self.owner = os.getpid()
        self.signals: queue.SimpleQueue[int] = queue.SimpleQueue()
        self.on_stop = on_stop  # (the newest install's)
        threading.Thread(target=self._run, name="swarm-stop", daemon=True).start()

    def _run(self) -> None:
        while True:
            signum = self.signals.get()
            try:
                self.on_stop(signum)
            except Exception:  # noqa: BLE001 - a later signal must still be heard (a second one exits at once)
                logger.exception("handling signal %d failed", signum)


_relay: Optional[_Relay] = None


def install_stop_handlers(on_stop: Callable[[int], None]) -> None:
    """Call `on_stop(signum)` on SIGINT and SIGTERM in this process, on a thread of its own ("swarm-stop", one per
    process: a peer that joins again after moving stages installs its new stop in the same one): the signal
    handler itself only queues the signal. A handler runs on the main thread between two of its bytecodes,
    wherever it was, so anything more there could wait on a lock the main thread already holds: setting a
    threading.Event from inside its own wait() (a plain lock), or writing the event log from inside its own write
    (a reentrant call into a buffered file raises). SimpleQueue.put is made to be called from a signal handler.

    A process forked from ours inherits the handlers but not the thread: there SIGTERM must still kill (hivemind
    once forked its DHT process from ours and ended it with SIGTERM; with the handler inherited as is, the parent
    waited for the fork forever)."""
    global _relay
    if _relay is None or _relay.owner != os.getpid():
        _relay = _Relay(on_stop)
    relay = _relay
    relay.on_stop = on_stop

    def handler(signum: int, frame) -> None:
        if os.getpid() == relay.owner:
            relay.signals.put(signum)
        elif signum == signal.SIGTERM:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, handler)
