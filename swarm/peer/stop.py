"""How a peer stops on SIGINT/SIGTERM: within STOP_SECONDS in every phase (the network work in flight, such as
matchmaking, an all-reduce or a state download, is cancelled; a watchdog ends whatever does not return), with its
offline record on a best-effort basis; a second signal ends the process at once (its helpers die with it, see
swarm/dht/lifeline.py)."""

from __future__ import annotations

import faulthandler
import logging
import os
import threading
import time
from typing import Optional

from swarm.runtime import install_stop_handlers

logger = logging.getLogger("swarm.peer")
STOP_SECONDS = 9.0  # a stop signal ends the peer within this, inside Docker's 10 s grace


class Stop:
    """The peer's stop: `event` is set by the first signal; `loop` (a LoopThread), once set, has its submitted
    work cancelled then."""

    def __init__(self, events, seconds: float = STOP_SECONDS):
        self.events, self.seconds = events, seconds
        self.event = threading.Event()
        self.deadline: Optional[float] = None  # monotonic time a stop signal must have ended us by
        self.loop = None
        self.watchdog: Optional[threading.Timer] = None  # armed by the first signal
        self.handled = threading.Event()  # set once the first signal's cancellations are done

    def install(self) -> None:
        install_stop_handlers(self.signalled)

    def signalled(self, signum: int) -> None:
        if self.event.is_set():
            logger.warning("second signal (%d): stopping at once", signum)
            os._exit(128 + signum)
            return  # (only reached where os._exit is replaced, as in a test)
        # On the "swarm-stop" thread, not in the signal handler (see install_stop_handlers), while the main thread
        # goes on. The watchdog first, so that nothing after it can keep us past the deadline. The Event before the
        # cancellations: the training loop must see the stop before it sees its work cancelled (a cancelled shard
        # fetch ends the batches' generator for good, and the loop, not knowing it was stopping, read it again: a
        # StopIteration). `handled` after them: the shutdown waits for it (wait_handled) before its own network
        # work (the offline record, settling), which a cancellation still to come would cut.
        self.deadline = time.monotonic() + self.seconds
        self.watchdog = threading.Timer(self.seconds + 0.5, self._now)
        self.watchdog.daemon = True
        self.watchdog.start()
        self.event.set()
        try:
            logger.info("stopping within %.0f s (signal %d); Ctrl-C again to stop at once", self.seconds, signum)
            self.events.emit("stopping", signal=signum)
            if self.loop is not None:
                self.loop.cancel_submitted(interrupt=True)
        finally:
            self.handled.set()

    def wait_handled(self) -> None:
        """After a stop signal: until the stop has cancelled what it cancels (a second at most), so that what the
        caller submits next is not cancelled and its `stopping` event is written."""
        if self.event.is_set():
            self.handled.wait(1.0)

    def _now(self) -> None:
        logger.error("did not stop within %.0f s of the signal: exiting without the final checkpoint", self.seconds)
        faulthandler.dump_traceback(all_threads=True)  # where it hung, on stderr: a hang is a bug to fix
        self.events.emit("stopped", forced=True)
        os._exit(1)

    def time_left(self, wanted: float) -> float:
        """`wanted` seconds, or what is left of the stop deadline (keeping a second for the rest) if sooner."""
        if self.deadline is None:
            return wanted
        return max(min(wanted, self.deadline - time.monotonic() - 1.0), 0.1)
