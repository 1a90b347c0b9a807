"""Home routers in network namespaces: a hub bridge plays the internet (10.232.0.0/24), public hosts sit on it, and
each home router is a namespace with one leg on the hub and one on its own LAN (192.168.7K.0/24), doing what a home
router does: MASQUERADE out, nothing in but the replies (and the ports it is told to forward), and silence (no
refusal) to a connection attempt on its own ports. A host behind it gets the router as its default route. Needs
root, `ip` and `iptables`; `nat_unavailable()` says why not, for a skip.

    with Internet() as net:
        boot = net.public("boot")              # 10.232.0.2, on the hub
        home = net.home("home1")               # 192.168.71.2 behind router 10.232.0.11
        net.process(home, ["join", ...], ...)  # a `python -m swarm` child inside that namespace

A router may also run miniupnpd (`net.home(name, upnp=True)`): it maps ports for its LAN host on request, by UPnP
IGD and NAT-PMP, as most home routers offer; `upnp_unavailable()` says why it cannot run. miniupnpd maps nothing
while its WAN address is private (it takes the router for one behind a carrier's NAT), so such a harness needs a hub
of public addresses: `Internet(subnet=PUBLIC_SUBNET)`.

Addresses and names stay inside the namespaces this object makes; `__exit__` stops the daemons it started and
deletes the namespaces (which also ends their links and rules).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from conftest import SwarmProcess

HUB_SUBNET = "10.232.0"  # the internet (scripts/allreduce_bench.py's harness uses 10.231.0.0/24)
# A globally routed range (no RFC 1918, shared, test or benchmark range), for miniupnpd's WAN: nothing leaves the
# namespaces, so whose range it is outside does not matter here.
PUBLIC_SUBNET = "11.232.0"
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
    upnp_log: Optional[Path] = None  # miniupnpd's output, where it runs

    def redirects(self) -> list[str]:
        """The port mappings miniupnpd holds, as the nftables rules it wrote (`... dport P dnat ip to HOST:P`)."""
        rules = _run("ip", "netns", "exec", self.name, "nft", "list", "chain", "inet", "filter",
                     "prerouting_miniupnpd")
        return [line.strip() for line in rules.splitlines() if " dnat " in line]


class Internet:
    """The hub and everything attached to it; a context manager that removes every namespace it made."""

    def __init__(self, tag: Optional[str] = None, subnet: str = HUB_SUBNET, workdir: Optional[Path] = None):
        self.tag = tag or str(os.getpid() % 100000)
        self.subnet = subnet  # the hub's /24, as "A.B.C"
        self.workdir = workdir  # miniupnpd's files (a temporary directory if None)
        self.hub = f"{PREFIX}{self.tag}-hub"
        self.created: list[str] = []
        self.hosts: list[Host] = []
        self.routers: list[Router] = []
        self.daemons: list[subprocess.Popen] = []
        self._links = 0
        self._tmp: Optional[str] = None

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
        for daemon in self.daemons:  # (SIGTERM: miniupnpd removes its rules as it exits)
            daemon.terminate()
        for daemon in self.daemons:
            try:
                daemon.wait(5)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        self.daemons.clear()
        for name in reversed(self.created):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self.created.clear()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def public(self, name: str) -> Host:
        """A host on the hub with a public address of its own (10.232.0.2, .3, ...)."""
        try:
            namespace = self._netns(name)
            address = f"{self.subnet}.{2 + sum(h.router is None for h in self.hosts)}"
            self._plug(namespace, "eth0", address)
        except HarnessError:
            self.__exit__(None, None, None)
            raise
        self.hosts.append(Host(namespace, address))
        return self.hosts[-1]

    def home(self, name: str, forwarded: tuple[int, ...] = (), upnp: bool = False, natpmp: bool = True) -> Host:
        """A host behind its own home router (router K's WAN address .(10+K) on the hub, LAN 192.168.(70+K).0/24),
        which masquerades what leaves and lets in only replies and the TCP ports in `forwarded`, and with `upnp`
        also those miniupnpd maps on its host's request (see _start_miniupnpd), by UPnP IGD and, unless not
        `natpmp`, NAT-PMP."""
        index = len(self.routers) + 1
        lan = LAN_SUBNET.format(70 + index)
        try:
            router = Router(self._netns(f"{name}-gw"), f"{self.subnet}.{10 + index}", f"{lan}.1", tuple(forwarded))
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
            if upnp:  # what miniupnpd's rules let in (it redirects them: DNAT)
                _run(*in_router, "iptables", "-A", "FORWARD", "-i", "wan", "-o", "lan", "-m", "conntrack",
                     "--ctstate", "DNAT", "-j", "ACCEPT")
            _run(*in_router, "iptables", "-A", "FORWARD", "-i", "wan", "-o", "lan", "-j", "DROP")
            # and, as home routers do, no answer at all to a connection attempt on its own closed ports (a dial
            # there times out rather than being refused)
            _run(*in_router, "iptables", "-A", "INPUT", "-i", "wan", "-p", "tcp", "--syn", "-j", "DROP")
            if upnp:
                self._start_miniupnpd(router, f"{lan}.0/24", natpmp)
        except HarnessError:
            self.__exit__(None, None, None)
            raise
        host = Host(namespace, address, router)
        router.host = host
        self.routers.append(router)
        self.hosts.append(host)
        return host

    def _start_miniupnpd(self, router: Router, lan: str, natpmp: bool = True) -> None:
        """miniupnpd in `router`'s namespace, in the foreground (-d), WAN `wan`, LAN `lan`, answering UPnP IGD (SSDP
        on the LAN) and NAT-PMP, mapping ports 1024-65535 for the LAN only, each to the address that asks (secure
        mode). Its nftables backend adds rules to chains it expects to exist (what the package's nft_init.sh was
        meant to create): they are made here, in table inet filter, hooked at forward, prerouting and postrouting."""
        if self.workdir is None:
            self._tmp = self._tmp or tempfile.mkdtemp(prefix="nat-harness-")
        workdir = Path(self.workdir or self._tmp) / router.name
        workdir.mkdir(parents=True, exist_ok=True)
        in_router = ["ip", "netns", "exec", router.name]
        (workdir / "init.nft").write_text(
            "table inet filter {\n"
            "  chain miniupnpd { }\n"
            "  chain prerouting_miniupnpd { }\n"
            "  chain postrouting_miniupnpd { }\n"
            "  chain forward { type filter hook forward priority 0; policy accept; jump miniupnpd; }\n"
            "  chain prerouting { type nat hook prerouting priority -100; policy accept;\n"
            "    jump prerouting_miniupnpd; }\n"
            "  chain postrouting { type nat hook postrouting priority 100; policy accept;\n"
            "    jump postrouting_miniupnpd; }\n"
            "}\n")
        _run(*in_router, "nft", "-f", str(workdir / "init.nft"))
        (workdir / "miniupnpd.conf").write_text("\n".join([
            "ext_ifname=wan", "listening_ip=lan", "http_port=0", f"enable_natpmp={'yes' if natpmp else 'no'}",
            "enable_upnp=yes",
            "secure_mode=yes", "ipv6_disable=yes", "system_uptime=yes", f"lease_file={workdir / 'leases'}",
            "uuid=5a1f0c8e-7558-488b-b0de-d460201fe868", f"allow 1024-65535 {lan} 1024-65535",
            "deny 0-65535 0.0.0.0/0 0-65535", ""]))
        router.upnp_log = workdir / "miniupnpd.log"
        with open(router.upnp_log, "w") as log:
            self.daemons.append(subprocess.Popen(
                [*in_router, "miniupnpd", "-f", str(workdir / "miniupnpd.conf"), "-P", str(workdir / "miniupnpd.pid"),
                 "-d"], stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 10
        while ("Listening for NAT-PMP" if natpmp else "HTTP listening on port") not in router.upnp_log.read_text():
            if self.daemons[-1].poll() is not None or time.monotonic() > deadline:
                raise HarnessError(f"miniupnpd did not start: {router.upnp_log.read_text()[-600:]}")
            time.sleep(0.05)

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


def upnp_unavailable() -> Optional[str]:
    """None if this machine can run a router with miniupnpd (see nat_unavailable, and the nftables build of
    miniupnpd with `nft`), else why not: the reason a test skips with."""
    reason = nat_unavailable()
    if reason is not None:
        return reason
    missing = [tool for tool in ("miniupnpd", "nft") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not installed (apt-get install -y miniupnpd-nftables nftables)"
    version = subprocess.run(["miniupnpd", "--version"], capture_output=True, text=True).stdout
    if "nftables" not in version:
        return f"this miniupnpd is not the nftables build ({version.strip()}): apt-get install -y miniupnpd-nftables"
    try:
        with Internet(tag=f"{os.getpid() % 100000}u", subnet=PUBLIC_SUBNET) as net:
            net.home("probe", upnp=True)
    except HarnessError as e:
        return f"cannot run miniupnpd in a router namespace here: {e}"
    return None

