"""Fixtures for tests that start real swarm processes on 127.0.0.1 through the `swarm-peer` CLI, and kill every
process they started (by PID and process group) when the test ends."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable

import pytest

from swarm.events import read_events
from zygote import Template

TESTS = Path(__file__).parent
TINY_RECIPE = TESTS / "recipes" / "tiny.yaml"
# The join command a bootstrap prints for its users (tests read its address from the `listening` event).
MADDR = re.compile(r"--initial-peers (\S+)")
# Peers are forked from one template process per test session, which has imported what a peer imports (zygote.py);
# bootstraps from another, which has imported a bootstrap's modules and so no torch (as a fresh bootstrap).
PEER_TEMPLATE = Template()
BOOTSTRAP_TEMPLATE = Template("swarm.cli, swarm.bootstrap")
TEMPLATES = {"join": PEER_TEMPLATE, "bootstrap": BOOTSTRAP_TEMPLATE}


class EventReader:
    """Reads a child's structured events (`--events-file`, swarm/events.py). Needs `name`, `events_path` (None:
    started without an events file), `process` and `output()`."""

    name: str
    events_path: Path | None
    process: subprocess.Popen

    def events(self, event: str | None = None, where: Callable[[dict], bool] | None = None, **fields) -> list[dict]:
        """The events written so far, of kind `event` (any if None) whose fields equal `fields` and, with `where`,
        for which `where(event)` holds."""
        assert self.events_path is not None, f"{self.name} was started without an events file"
        return [e for e in read_events(self.events_path) if (event is None or e["event"] == event)
                and all(e.get(key) == value for key, value in fields.items()) and (where is None or where(e))]

    def wait_event(self, event: str, timeout: float, where: Callable[[dict], bool] | None = None, **fields) -> dict:
        """Wait for the first event of kind `event` whose fields equal `fields` (and, with `where`, for which
        `where(event)` holds); fails the test with the output if none comes (or the process exits first)."""
        deadline = time.monotonic() + timeout
        while True:
            found = self.events(event, where, **fields)
            if found:
                return found[0]
            if time.monotonic() >= deadline or self.process.poll() is not None:
                found = self.events(event, where, **fields)  # written just before it exited
                if found:
                    return found[0]
                raise AssertionError(f"{self.name}: no {event} event with {fields} within {timeout} s; output:\n"
                                     + self.report())
            time.sleep(0.05)

    def report(self) -> str:
        """The output's tail for a failed wait; if the process still runs, every thread's stack first (SIGUSR1,
        see swarm/cli.py), so that a wait that timed out on a hung peer shows where it hung."""
        if self.process.poll() is None:
            try:
                os.kill(self.process.pid, signal.SIGUSR1)
            except ProcessLookupError:
                return self.output()[-4000:]
            deadline = time.monotonic() + 3.0
            while "Current thread 0x" not in self.output()[-16000:] and time.monotonic() < deadline:
                time.sleep(0.05)  # (the dump ends with the signalled thread's stack)
            return self.output()[-16000:]
        return self.output()[-4000:]


class SwarmProcess(EventReader):
    """A `python -m swarm ...` child in its own session, with its output captured line by line and, when
    `events` is set, its structured events (`--events-file`, swarm/events.py) to wait on."""

    def __init__(self, argv: list[str], name: str, log_dir: Path, events: bool = False):
        self.name = name
        self.lines: list[str] = []
        self.log_path = log_dir / f"{name}.log"
        self.events_path = log_dir / f"{name}.events.jsonl" if events else None
        if self.events_path is not None:
            argv = [*argv, "--events-file", str(self.events_path)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        forked = TEMPLATES[argv[0]].start(argv, env) if argv[0] in TEMPLATES else None
        self.process = forked or subprocess.Popen([sys.executable, "-m", "swarm", *argv], stdout=subprocess.PIPE,
                                                  stderr=subprocess.STDOUT, text=True, start_new_session=True, env=env)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        with open(self.log_path, "w") as log:
            for line in self.process.stdout:
                self.lines.append(line)
                log.write(line)
                log.flush()

    @property
    def pid(self) -> int:
        return self.process.pid

    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        """Wait until a line matches `pattern` (regex); fails the test with the output if it does not."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        seen = 0
        while time.monotonic() < deadline:
            while seen < len(self.lines):
                match = regex.search(self.lines[seen])
                if match:
                    return match
                seen += 1
            if self.process.poll() is not None and seen >= len(self.lines):
                self._reader.join(2)
                if seen >= len(self.lines):
                    break
            time.sleep(0.05)
        raise AssertionError(f"{self.name}: no line matching {pattern!r} within {timeout} s; output:\n"
                             + self.report())

    def wait(self, timeout: float) -> int:
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name} did not exit within {timeout} s; output:\n"
                                 + self.report()) from None
        self._reader.join(5)
        return code

    def session_alive(self) -> bool:
        """Whether any process of this child's session (e.g. its p2pd daemons) is still running."""
        return bool(session_members(self.process.pid))

    def kill(self) -> None:
        kill_all_of_session(self.process)


def kill_all_of_session(process: subprocess.Popen) -> None:
    """SIGKILL every process of a child's session: its own group, and p2pd, which runs in a group of its own
    (swarm/dht/lifeline.py)."""
    for pid in [process.pid, *session_processes(process.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def kill_session(process: subprocess.Popen) -> None:
    """SIGKILL a child's whole session (its helper processes too), then reap it."""
    kill_all_of_session(process)
    process.wait(10)


def http_get(url: str, method: str = "GET") -> tuple[int, dict, bytes]:
    """(status, headers, body) of a request to `url`; an HTTP error status is returned, not raised."""
    request = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def _p2p_network():
    """(loop, add): `add()` starts one more real node on 127.0.0.1 (its own p2pd), bootstrapped from the first;
    every node is shut down at the end."""
    from swarm.dht.node import NetworkOptions, SwarmNode
    from swarm.runtime import LoopThread

    loop = LoopThread()
    nodes = []

    def add():
        initial = [nodes[0].visible_maddrs()[0]] if nodes else []
        nodes.append(SwarmNode(initial, NetworkOptions(host_maddrs=("/ip4/127.0.0.1/tcp/0",))))
        return nodes[-1]

    yield loop, add
    for node in nodes:
        node.shutdown()
    loop.close()


p2p_network = pytest.fixture(_p2p_network)
# (the same, once for a whole test module: for tests that each register their own protocols on a few nodes, whose
# start, a p2pd and a DHT process each, would otherwise cost every test a second or so a node)
p2p_network_shared = pytest.fixture(_p2p_network, scope="module", name="p2p_network_shared")


def wait_until(condition, timeout: float, step: float = 0.02) -> bool:
    """Poll `condition` until it holds or `timeout` seconds pass; whether it held."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(step)
    return True


async def dribble(reader, data: bytes, until) -> None:
    """Feed `data` to `reader` a byte each 50 ms, so its reader is never silent for a read deadline, until the
    task `until` is done: how a hostile peer holds a handler's slot without ever stalling."""
    import asyncio

    for byte in data:
        if until.done():
            return
        reader.feed_data(bytes([byte]))
        await asyncio.sleep(0.05)


def echo_handler(served: list):
    """A stream handler that notes who opened the stream and sends back its first frame (of up to 64 bytes)."""
    from swarm.dht.frames import recv_frame, send_frame

    async def handler(remote, reader, writer):
        served.append(remote)
        await send_frame(writer, await recv_frame(reader, 64))
    return handler


async def ask_echo(node, peer: str, protocol: str, data: bytes = b"hello", timeout: float = 10.0):
    """What `peer`'s echo_handler sends back for `data`, or None if the stream was closed on us."""
    import asyncio

    from swarm.dht.frames import recv_frame, send_frame

    reader, writer = await node.open_stream(peer, protocol)
    try:
        await send_frame(writer, data)
        return await asyncio.wait_for(recv_frame(reader, 64), timeout)
    except asyncio.IncompleteReadError:
        return None
    finally:
        writer.close()


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """One tokenizer cache for the whole session, so each run trains the test tokenizer once."""
    return tmp_path_factory.mktemp("swarm-cache")


def pytest_addoption(parser):
    parser.addoption("--cpu-account", action="store_true",
                     help="after the run, the machine's CPU time during the tests (from /proc/stat: every process, the "
                          "peers the tests start included) against their wall time, by file")


_CPU_ACCOUNT: list[tuple[str, float, float]] = []  # (test id, wall seconds, the machine's busy CPU seconds)


def _machine_busy_seconds() -> float:
    with open("/proc/stat") as stat:  # the first line: every CPU's jiffies by state
        jiffies = [int(x) for x in stat.readline().split()[1:]]
    return (sum(jiffies[:8]) - jiffies[3] - jiffies[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not item.config.getoption("--cpu-account"):
        yield
        return
    busy, started = _machine_busy_seconds(), time.monotonic()
    yield
    _CPU_ACCOUNT.append((item.nodeid, time.monotonic() - started, _machine_busy_seconds() - busy))


def pytest_terminal_summary(terminalreporter, config):
    for kind, template in (("peers", PEER_TEMPLATE), ("bootstraps", BOOTSTRAP_TEMPLATE)):
        if template.forked or template.fresh:
            because = f" (their environment differed in {', '.join(sorted(template.fresh_because))})"
            terminalreporter.write_line(f"{kind}: {template.forked} forked from the template (tests/zygote.py), "
                                        f"{template.fresh} started fresh" + (because if template.fresh_because else ""))
    if not _CPU_ACCOUNT:
        return
    cores, files = os.cpu_count() or 1, {}
    for nodeid, wall, cpu in _CPU_ACCOUNT:
        spent = files.setdefault(nodeid.split("::")[0], [0.0, 0.0])
        spent[0], spent[1] = spent[0] + wall, spent[1] + cpu
    wall, cpu = sum(w for w, _ in files.values()), sum(c for _, c in files.values())
    terminalreporter.section("CPU account (the machine's, during each test)")
    terminalreporter.write_line(f"{len(_CPU_ACCOUNT)} tests: {wall:.0f} s of wall, {cpu:.0f} s of CPU, "
                                f"{cpu / max(wall * cores, 1e-9):.0%} of {cores} cores")
    for name, (w, c) in sorted(files.items(), key=lambda item: -item[1][0])[:25]:
        terminalreporter.write_line(f"{w:8.1f} s wall {c:8.1f} s CPU {c / max(w * cores, 1e-9):5.0%}  {name}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """When a test fails, attach the last lines of every swarm process it started (not just the one it waited
    on): a race between peers is only explained by reading all sides of it."""
    outcome = yield
    report = outcome.get_result()
    processes = getattr(item, "swarm_processes", None)
    if report.failed and processes:
        for process in processes:
            report.sections.append((f"swarm process {process.name} (pid {process.pid})",
                                    "".join(process.lines[-60:])))


@pytest.fixture
def swarm(request, tmp_path, cache_dir):
    """Start swarm processes; at the end of the test each main process is SIGKILLed, and the test fails if any
    process it started outlives it (see stop_all)."""
    started: list[SwarmProcess] = []
    request.node.swarm_processes = started

    class Launcher:
        workdir = tmp_path

        def bootstrap(self, *extra: str, recipe: Path | None = TINY_RECIPE, name: str = "bootstrap"):
            argv = ["bootstrap", *(["--recipe", str(recipe)] if recipe else []), *extra]
            process = SwarmProcess(argv, name, tmp_path, events=True)
            started.append(process)
            maddr = process.wait_event("listening", 60)["maddrs"][0]
            return process, maddr

        def peer(self, maddr: str, *extra: str, name: str):
            argv = ["join", "--initial-peers", maddr, "--device", "cpu", "--num-threads", "1",
                    "--cache-dir", str(cache_dir), *extra]
            process = SwarmProcess(argv, name, tmp_path, events=True)
            started.append(process)
            return process

        def run(self, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-m", "swarm", *argv], capture_output=True, text=True,
                                  timeout=timeout)

    yield Launcher()
    leaks = stop_all(started)
    if leaks:
        pytest.fail("processes outlived the main process that started them: " + "; ".join(leaks), pytrace=False)


LEAK_SECONDS = 10.0  # a main process's helpers must exit this soon after it (they take well under a second)


def session_members(session: int) -> list[str]:
    """The live (not zombie) processes of a session, as "name[pid]", read from /proc."""
    return [f"{name}[{pid}]" for pid, name in session_processes(session).items()]


def session_processes(session: int) -> dict[int, str]:
    """The live (not zombie) processes of a session, pid -> name, read from /proc."""
    return {pid: name for pid, name, state, _, in_session in _processes() if in_session == session
            and state not in "ZX"}


def reap_orphans(sessions: set[int]) -> None:
    """Reap the zombies re-parented to this process (a child subreaper once a peer was forked: zygote.py) from the
    sessions of processes the tests started: a killed peer's helpers that exited after it. Their leaders are left
    to their own wait()."""
    me = os.getpid()
    for pid, _, state, parent, session in _processes():
        if state == "Z" and parent == me and session in sessions and pid not in sessions:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass


def _processes():
    """(pid, name, state, parent pid, session) of every process, read from /proc."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        name, fields = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        yield int(entry), name, fields[0], int(fields[1]), int(fields[3])  # fields: state, ppid, pgrp, session, ...


def stop_all(processes: list[SwarmProcess]) -> list[str]:
    """End every process a test started as a crash would, SIGKILL of its main process alone, and check that
    nothing it started outlives it (its helpers follow it, swarm/dht/lifeline.py). Whatever is still running
    LEAK_SECONDS later is killed with its whole session and returned, so the test fails on a leak instead of the
    harness sweeping it away."""
    for process in processes:
        if process.process.poll() is None:
            try:
                os.kill(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    deadline, leaks = time.monotonic() + LEAK_SECONDS, []
    for process in processes:
        try:
            process.process.wait(max(deadline - time.monotonic(), 1.0))
        except subprocess.TimeoutExpired:
            pass
        while session_members(process.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = session_members(process.pid)
        if left:
            leaks.append(f"{process.name} (pid {process.pid}) left {', '.join(left)} running")
            process.kill()
            try:
                process.process.wait(10)
            except subprocess.TimeoutExpired:
                pass
    reap_orphans({process.pid for process in processes})
    return leaks


def pytest_sessionfinish(session, exitstatus):
    for template in TEMPLATES.values():
        template.close()
