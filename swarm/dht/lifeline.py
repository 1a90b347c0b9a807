"""Helper processes die with the process that started them. Our DHT process (swarm/dht/process.py) spawns p2pd;
killed with SIGKILL, a peer once left both running for good, holding its identity. Here each helper gets a
parent-death signal (Linux) and a thread that watches its parent's pid (everywhere); `identity_holders` finds a
local p2pd that still holds an identity file, so a refused restart can say which process to stop. Standard library
only: the DHT process imports this before anything else.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from typing import Callable, Iterator, Optional

PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
WATCH_SECONDS = 0.2  # how often a helper checks that its parent lives (the portable watch)
Prctl = Callable[..., int]


def load_prctl() -> Optional[Prctl]:
    """libc's prctl on Linux, resolved here so that a freshly forked child only calls it; None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # libc is loaded: no find_library (it runs ldconfig)
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


def die_with_parent(prctl: Optional[Prctl], parent_pid: int, signum: int) -> None:
    """Have the kernel send `signum` to this process when its parent dies (Linux), and end now if it already has
    died (between the fork and this call). The signal comes when the parent *thread* that forked us exits: call
    this only in a child forked by a thread that lives as long as its process."""
    if prctl is not None:
        prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0)
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGKILL)


def watch_parent(parent_pid: int, on_death: Callable[[], None]) -> threading.Thread:
    """Call `on_death()` once, from a daemon thread, when this process's parent is gone: it was re-parented (to
    init or a subreaper). Polling the pid works on macOS as on Linux."""
    def _watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(WATCH_SECONDS)
        on_death()

    thread = threading.Thread(target=_watch, name="parent-watch", daemon=True)
    thread.start()
    return thread


@contextlib.contextmanager
def children_die_with_this_process(prctl: Optional[Prctl], children: list) -> Iterator[None]:
    """While inside, each process that asyncio spawns here (hivemind starts p2pd with
    `asyncio.subprocess.create_subprocess_exec`, from the loop's thread) gets SIGTERM when this process dies, and is
    appended to `children`. p2pd stops cleanly on SIGTERM and removes its socket. Each runs in a process group of its
    own (Linux: where the death signal ends it): a terminal's Ctrl-C, SIGINT to its whole foreground group, stopped
    p2pd at once, before this process could shut the node down through it, which then hung until our parent's
    timeout (3 s), and a peer's offline record could not go out. Use it only in a process that exists to run
    hivemind: it rebinds that function for the whole process."""
    original = asyncio.subprocess.create_subprocess_exec
    parent_pid = os.getpid()

    def _in_child() -> None:
        os.setpgid(0, 0)
        die_with_parent(prctl, parent_pid, signal.SIGTERM)

    async def _create(*args, **kwargs):
        if prctl is not None and "preexec_fn" not in kwargs:
            kwargs["preexec_fn"] = _in_child
        process = await original(*args, **kwargs)
        children.append(process)
        return process

    asyncio.subprocess.create_subprocess_exec = _create
    try:
        yield
    finally:
        asyncio.subprocess.create_subprocess_exec = original


def end_children(children: list, grace: float) -> None:
    """SIGTERM the children still running, wait up to `grace` seconds, then SIGKILL those left."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        running = [child for child in children if child.returncode is None]
        for child in running:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, sig)
        deadline = time.monotonic() + grace
        while running and time.monotonic() < deadline and any(alive(child.pid) for child in running):
            time.sleep(0.05)


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (macOS): a zombie counts as running, which only makes us wait the grace out
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False


def gone(pid: int, within: float) -> bool:
    """Whether `pid` is dead, or dies within `within` seconds. A process being SIGKILLed closes its files (which its
    children see at once, as EOF) a moment before it is a zombie: alive() read at that EOF can still say it runs."""
    deadline = time.monotonic() + within
    while alive(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


def identity_held_here(identity_path: str, wait: float = 0.0) -> Optional[str]:
    """Which local process holds this identity file (see `describe_holder`), or None. A peer that crashed a moment
    ago may still be taking its p2pd down (within 2 s): a holder is given `wait` seconds to exit first."""
    deadline = time.monotonic() + wait
    holders = identity_holders(identity_path)
    while holders and time.monotonic() < deadline:
        time.sleep(0.1)
        holders = identity_holders(identity_path)
    return describe_holder(holders[0]) if holders else None


def identity_holders(identity_path: str) -> list[int]:
    """Pids of the p2pd daemons on this machine started with this identity file (read from /proc; none where there
    is no /proc)."""
    try:
        target = os.stat(identity_path)
        entries = [entry for entry in os.listdir("/proc") if entry.isdigit()]
    except OSError:
        return []
    holders = []
    for entry in entries:
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            if not os.path.basename(argv[0]).startswith(b"p2pd") or not alive(int(entry)):
                continue
            for arg in argv[1:]:
                if arg.startswith(b"-id="):  # relative to p2pd's working directory
                    path = os.path.join(os.readlink(f"/proc/{entry}/cwd"), os.fsdecode(arg[len(b"-id="):]))
                    if os.path.samestat(os.stat(path), target):
                        holders.append(int(entry))
        except (OSError, IndexError):
            continue  # it exited meanwhile, or is not ours to read
    return holders


def describe_holder(pid: int) -> str:
    """`p2pd pid N`, what it belongs to (p2pd <- a DHT process <- a peer or bootstrap) and what to stop."""
    dht = _parent(pid)
    owner = _parent(dht)
    if dht is None or dht <= 1:
        return f"p2pd pid {pid}, left running by a process that crashed: kill {pid}"
    if owner is None or owner <= 1:
        return f"p2pd pid {pid} and its DHT process {dht}, left running by a peer that crashed: kill {dht} {pid}"
    try:
        with open(f"/proc/{owner}/cmdline", "rb") as f:
            argv = [os.fsdecode(a) for a in f.read().split(b"\0") if a]
    except OSError:
        argv = ["?"]
    # `python -m swarm join ...`, `python swarm-peer bootstrap ...`: enough to tell which of one's peers it is
    words = [os.path.basename(a) for a in argv[:2]] + argv[2:4] + (["..."] if len(argv) > 4 else [])
    shown = " ".join(" ".join(words).split())  # one line, whatever its arguments hold (`python -c` code: newlines)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return f"p2pd pid {pid} of process {owner} ({shown}): stop that process (kill {owner})"


def _parent(pid: Optional[int]) -> Optional[int]:
    if pid is None or pid <= 1:
        return pid
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None
