"""Peers (and bootstraps) for the multi-process tests, forked from a template that has imported what each imports.

Every peer a test starts used to be a fresh `python -m swarm join`, and importing torch and the peer's modules cost
each about 4.5 s of CPU before it did anything (docs/measured.md#start-up): a large share of the suite's time on 2
cores, where tests start hundreds of peers. The template (the "zygote", as Android's is called) is one interpreter
per test session that imports them once and forks a peer per request; the peer is a separate process running the
CLI's own `python -m swarm` code (swarm/__main__.py), in a session of its own, its output on a pipe to the test,
its environment and working directory the test's. Forked twice, it is re-parented to the pytest process (a child
subreaper, Linux's PR_SET_CHILD_SUBREAPER), so the test waits on it and reads its exit status as a child's.

What a fork does not give as a fresh interpreter would: environment variables read at start-up or import (a peer
whose environment differs from the template's in one of START_UP_VARIABLES starts fresh; the others it gets, and
what the template's imports set in theirs, as a fresh one would), and a module imported only for the template's
sake. `SWARM_TEST_FRESH_PEERS=1` starts every peer fresh.
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import Optional

import swarm

PR_SET_CHILD_SUBREAPER = 36  # from <linux/prctl.h>

# Environment variables read before a peer's own code runs, by the interpreter, glibc, or the libraries the
# template loads (torch's allocator, OpenMP and BLAS read theirs as they load): a peer whose environment differs
# from the template's in one of them starts fresh. Others (torch's TORCHINDUCTOR_CACHE_DIR, which importing its
# compiler sets in pytest's own environment) are read later, in the peer, which has the test's.
START_UP_VARIABLES = ("PYTHON", "LD_", "MALLOC_", "GLIBC_", "THP_MEM_ALLOC_ENABLE", "OMP_", "KMP_", "MKL_",
                      "OPENBLAS_", "NPY_", "HIVEMIND")

TEMPLATE = r"""
import json, os, socket, struct, sys
launched = dict(os.environ)
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # as swarm.cli.main sets it, before torch loads
from swarm.cli import import_hivemind_without_torch
import_hivemind_without_torch()
import {modules}  # what every process of its kind loads (a peer's: torch, the model layer, the averager, DHT)
# (what those imports set where it was not set: a peer's environment gets them as a fresh interpreter's would)
added = {key: value for key, value in os.environ.items() if key not in launched}
channel = socket.socket(fileno=int(sys.argv[1]))
channel.sendall(b"ready" + json.dumps(added).encode())
while True:
    message, fds, _, _ = socket.recv_fds(channel, 1 << 20, 1)
    if not message:
        os._exit(0)
    request = json.loads(message)
    ready_r, ready_w = os.pipe()
    if os.fork() == 0:  # the intermediate: it exits at once, so that the peer is re-parented to the subreaper
        if os.fork() == 0:  # the peer
            os.setsid()
            channel.close()
            os.close(ready_r)
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.dup2(fds[0], 1)
            os.dup2(fds[0], 2)
            os.close(null)
            os.close(fds[0])
            os.chdir(request["cwd"])
            os.environ.clear()
            os.environ.update(request["env"])
            for key, value in added.items():
                os.environ.setdefault(key, value)
            os.write(ready_w, struct.pack("<i", os.getpid()))
            os.close(ready_w)
            sys.argv = [request["main"], *request["argv"]]
            import runpy
            runpy.run_module("swarm", run_name="__main__", alter_sys=True)  # swarm/__main__.py: sys.exit(main())
            sys.exit(0)
        os._exit(0)
    os.close(ready_w)
    os.close(fds[0])
    os.wait()  # the intermediate: once it is reaped, the peer is the subreaper's child
    pid = os.read(ready_r, 4)
    os.close(ready_r)
    channel.sendall(pid if len(pid) == 4 else struct.pack("<i", 0))
"""


class ForkedProcess:
    """What the tests use of a subprocess.Popen, for a peer forked by the template: pid, stdout, poll, wait,
    send_signal, kill, terminate, returncode. Safe to poll from several threads."""

    def __init__(self, pid: int, stdout, args: list[str]):
        self.pid, self.stdout, self.args = pid, stdout, args
        self.returncode: Optional[int] = None
        self._lock = threading.Lock()

    def poll(self) -> Optional[int]:
        with self._lock:
            if self.returncode is None:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            pidfd = os.pidfd_open(self.pid)
        except ProcessLookupError:  # reaped already (by another thread's poll)
            return self.poll()
        try:
            while self.poll() is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(self.args, timeout)
                select.select([pidfd], [], [], left)
        finally:
            os.close(pidfd)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class Template:
    """The template process, started at the first request; `start` forks a process from it. `modules` are what it
    imports: a peer's by default; a bootstrap's load no torch (a fresh one does not, and test_footprint.py checks)."""

    def __init__(self, modules: str = "swarm.cli, swarm.peer.peer"):
        self.modules = modules
        self._lock = threading.Lock()
        self.forked = self.fresh = 0  # processes started each way, for the session's summary
        self.fresh_because: set[str] = set()  # the variables that made peers start fresh
        self._channel: Optional[socket.socket] = None
        self._process: Optional[subprocess.Popen] = None
        self._added: dict[str, str] = {}  # what the template's imports added to its environment
        self._start_up: dict[str, str] = {}  # the template's START_UP_VARIABLES after its imports

    def start(self, argv: list[str], env: dict[str, str]) -> Optional[ForkedProcess]:
        """A peer running `python -m swarm *argv` with `env`, its stdout and stderr on a pipe; None where it must
        start fresh instead (SWARM_TEST_FRESH_PEERS, another environment than the template's, no subreaper)."""
        process = self._fork(argv, env)
        with self._lock:
            if process is None:
                self.fresh += 1
            else:
                self.forked += 1
        return process

    def _fork(self, argv: list[str], env: dict[str, str]) -> Optional[ForkedProcess]:
        if os.environ.get("SWARM_TEST_FRESH_PEERS") == "1" or not sys.platform.startswith("linux"):
            return None
        with self._lock:
            if self._channel is None and not self._launch(env):
                return None
            wanted = self._start_up_of(env)
            if wanted != self._start_up:
                self.fresh_because |= {key for key in {*wanted, *self._start_up}
                                       if wanted.get(key) != self._start_up.get(key)}
                return None
            read, write = os.pipe()
            try:
                request = {"argv": argv, "env": env, "cwd": os.getcwd(),
                           "main": os.path.join(os.path.dirname(swarm.__file__), "__main__.py")}
                socket.send_fds(self._channel, [json.dumps(request).encode()], [write])
                reply = self._channel.recv(4)
            finally:
                os.close(write)
            pid = struct.unpack("<i", reply)[0] if len(reply) == 4 else 0
            if pid <= 0:
                os.close(read)
                raise RuntimeError(f"the peer template could not start {argv}")
            return ForkedProcess(pid, os.fdopen(read, "r", encoding="utf-8", errors="replace"),
                                 [sys.executable, "-m", "swarm", *argv])

    def _launch(self, env: dict[str, str]) -> bool:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            return False
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._process = subprocess.Popen([sys.executable, "-c", TEMPLATE.replace("{modules}", self.modules),
                                          str(theirs.fileno())],
                                         pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        theirs.close()
        ready = ours.recv(1 << 16)
        if not ready.startswith(b"ready"):
            raise RuntimeError(f"the peer template exited with {self._process.wait()}")
        self._channel, self._added = ours, json.loads(ready[len(b"ready"):])
        self._start_up = self._start_up_of(env)
        return True

    def _start_up_of(self, env: dict[str, str]) -> dict[str, str]:
        """The START_UP_VARIABLES of `env` as a peer forked with it has them."""
        env = {**self._added, **env}
        return {key: value for key, value in env.items() if key.startswith(START_UP_VARIABLES)}

    def close(self) -> None:
        with self._lock:
            if self._channel is not None:
                self._channel.close()  # (the template exits at the end of its channel)
                self._process.wait(30)
                self._channel = None

