"""Home routers in network namespaces: a hub bridge plays the internet (10.232.0.0/24), public hosts sit on it, and
each home router is a namespace with one leg on the hub and one on its own LAN (192.168.7K.0/24), doing what a home
router does: MASQUERADE out, nothing in but the replies (and the ports it is told to forward), and silence (no
refusal) to a connection attempt on its own ports. A host behind it gets the router as its default route. Needs
root, `ip` and `iptables`; `nat_unavailable()` says why not, for a skip.

    with Internet() as net:
        boot = net.public("boot")              # 10.232.0.2, on the hub
        home = net.home("home1")               # 192.168.71.2 behind router 10.232.0.11
        net.process(home, ["join", ...], ...)  # a `python -m swarm` child inside that namespace

Addresses and names stay inside the namespaces this object makes; `__exit__` deletes them all (which also ends
their links and rules).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from conftest import SwarmProcess

HUB_SUBNET = "10.232.0"  # the internet (scripts/allreduce_bench.py's harness uses 10.231.0.0/24)
LAN_SUBNET = "192.168.{}"  # home K's LAN: 192.168.(70+K).0/24, its router .1 on it, its host .2
PREFIX = "swn"  # namespace names: swn<pid>-<name>; test_netns.py looks for its own "swh" ones


class HarnessError(RuntimeError):
    """The namespaces could not be built; the message carries the failing command's error."""


def _run(*argv: str) -> str:
    try:
        return subprocess.run(argv, check=True, capture_output=True, text=True, timeout=30).stdout
    except subprocess.CalledProcessError as e:
        raise HarnessError(f"{' '.join(argv)}: {e.stderr.strip() or e.returncode}") from None
    except (FileNotFoundError, subprocess.TimeoutExpired) as e:
        raise HarnessError(f"{' '.join(argv)}: {e}") from None


@dataclass
class Host:
    """A namespace with an address: on the hub (public) or behind a router (`router` set)."""

    name: str  # the namespace
    address: str  # its IP: on the hub, or on its LAN
    router: Optional["Router"] = None

    def prefix(self) -> list[str]:
        """The command prefix that runs a program inside this host's namespace."""
        return ["ip", "netns", "exec", self.name]

    def maddr(self, port: int = 0) -> str:
        return f"/ip4/{self.address}/tcp/{port}"


@dataclass
class Router:
    """A home router: `wan` on the hub, `lan` the gateway address of its LAN, `forwarded` the TCP ports it
    forwards (DNAT) to its host."""

    name: str
    wan: str
    lan: str
    forwarded: tuple[int, ...] = ()
    host: Optional[Host] = field(default=None, repr=False)


class Internet:
    """The hub and everything attached to it; a context manager that removes every namespace it made."""

    def __init__(self, tag: Optional[str] = None):
        self.tag = tag or str(os.getpid() % 100000)
        self.hub = f"{PREFIX}{self.tag}-hub"
        self.created: list[str] = []
        self.hosts: list[Host] = []
        self.routers: list[Router] = []
        self._links = 0

    def _netns(self, name: str) -> str:
        full = f"{PREFIX}{self.tag}-{name}"
        _run("ip", "netns", "add", full)
        self.created.append(full)
        _run("ip", "-n", full, "link", "set", "lo", "up")
        return full

    def _plug(self, namespace: str, device: str, address: str) -> None:
        """A veth from the hub's bridge into `namespace`, named `device` there, with `address`/24 on it."""
        self._links += 1
        outer = f"v{self._links}"
        _run("ip", "-n", self.hub, "link", "add", outer, "type", "veth", "peer", "name", device, "netns", namespace)
        _run("ip", "-n", self.hub, "link", "set", outer, "master", "br0")
        _run("ip", "-n", self.hub, "link", "set", outer, "up")
        _run("ip", "-n", namespace, "addr", "add", f"{address}/24", "dev", device)
        _run("ip", "-n", namespace, "link", "set", device, "up")

    def __enter__(self) -> "Internet":
        try:
            self._netns("hub")
            _run("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", self.hub, "link", "set", "br0", "up")
        except HarnessError:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        for name in reversed(self.created):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self.created.clear()

    def public(self, name: str) -> Host:
        """A host on the hub with a public address of its own (10.232.0.2, .3, ...)."""
        try:
            namespace = self._netns(name)
            address = f"{HUB_SUBNET}.{2 + sum(h.router is None for h in self.hosts)}"
            self._plug(namespace, "eth0", address)
        except HarnessError:
            self.__exit__(None, None, None)
            raise
        self.hosts.append(Host(namespace, address))
        return self.hosts[-1]

    def home(self, name: str, forwarded: tuple[int, ...] = ()) -> Host:
        """A host behind its own home router (router K's WAN address 10.232.0.(10+K), LAN 192.168.(70+K).0/24),
        which masquerades what leaves and lets in only replies and the TCP ports in `forwarded`."""
        index = len(self.routers) + 1
        lan = LAN_SUBNET.format(70 + index)
        try:
            router = Router(self._netns(f"{name}-gw"), f"{HUB_SUBNET}.{10 + index}", f"{lan}.1", tuple(forwarded))
            self._plug(router.name, "wan", router.wan)
            namespace = self._netns(name)
            _run("ip", "-n", router.name, "link", "add", "lan", "type", "veth", "peer", "name", "eth0", "netns",
                 namespace)
            _run("ip", "-n", router.name, "addr", "add", f"{router.lan}/24", "dev", "lan")
            _run("ip", "-n", router.name, "link", "set", "lan", "up")
            address = f"{lan}.2"
            _run("ip", "-n", namespace, "addr", "add", f"{address}/24", "dev", "eth0")
            _run("ip", "-n", namespace, "link", "set", "eth0", "up")
            _run("ip", "-n", namespace, "route", "add", "default", "via", router.lan)
            in_router = ["ip", "netns", "exec", router.name]
            _run(*in_router, "sysctl", "-w", "net.ipv4.ip_forward=1")
            _run(*in_router, "iptables", "-t", "nat", "-A", "POSTROUTING", "-o", "wan", "-j", "MASQUERADE")
            for port in forwarded:
                _run(*in_router, "iptables", "-t", "nat", "-A", "PREROUTING", "-i", "wan", "-p", "tcp", "--dport",
                     str(port), "-j", "DNAT", "--to-destination", f"{address}:{port}")
                _run(*in_router, "iptables", "-A", "FORWARD", "-i", "wan", "-o", "lan", "-p", "tcp", "-d", address,
                     "--dport", str(port), "-j", "ACCEPT")
            _run(*in_router, "iptables", "-A", "FORWARD", "-i", "wan", "-o", "lan", "-m", "conntrack", "--ctstate",
                 "ESTABLISHED,RELATED", "-j", "ACCEPT")
            _run(*in_router, "iptables", "-A", "FORWARD", "-i", "wan", "-o", "lan", "-j", "DROP")
            # and, as home routers do, no answer at all to a connection attempt on its own closed ports (a dial
            # there times out rather than being refused)
            _run(*in_router, "iptables", "-A", "INPUT", "-i", "wan", "-p", "tcp", "--syn", "-j", "DROP")
        except HarnessError:
            self.__exit__(None, None, None)
            raise
        host = Host(namespace, address, router)
        router.host = host
        self.routers.append(router)
        self.hosts.append(host)
        return host

    def process(self, host: Host, argv: list[str], name: str, log_dir: Path) -> "NamespacedProcess":
        """`python -m swarm *argv` inside `host`'s namespace, with an events file (see conftest.SwarmProcess)."""
        return NamespacedProcess(host.prefix(), argv, name, log_dir)


class NamespacedProcess(SwarmProcess):
    """conftest.SwarmProcess, started inside a namespace: `ip netns exec` execs the command, so the child's pid
    and session are the peer's own, and conftest.stop_all ends it and checks for leaks as it does on loopback."""

    def __init__(self, prefix: list[str], argv: list[str], name: str, log_dir: Path):
        import threading

        self.name = name
        self.lines: list[str] = []
        self.log_path = log_dir / f"{name}.log"
        self.events_path = log_dir / f"{name}.events.jsonl"
        self.process = subprocess.Popen([*prefix, sys.executable, "-m", "swarm", *argv, "--events-file",
                                         str(self.events_path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()


def nat_unavailable() -> Optional[str]:
    """None if this machine can build the harness (root, `ip`, `iptables`, namespaces with NAT rules), else why
    not: the reason a test skips with."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces and NAT rules"
    missing = [tool for tool in ("ip", "iptables") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not installed (apt-get install -y iproute2 iptables)"
    try:
        with Internet(tag=f"{os.getpid() % 100000}c") as net:
            net.home("probe")
    except HarnessError as e:
        return f"cannot build NAT namespaces here: {e}"
    return None
