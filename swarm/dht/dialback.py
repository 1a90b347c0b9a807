"""Dial-back, as libp2p's AutoNAT: a peer asks a node that accepts connections (the bootstrap, any non-client peer)
to open a plain TCP connection to each address it will announce, and learns which answered. The answer also carries
the server's clock (both when the request came and when the answer left, as NTP does) and its package version.

When an address is at another IP than the one the request came from (a peer behind a home router announces its LAN
address), the server tries the port of that address at the IP it saw instead: a forwarded port or the router's
mapping answers there, and the peer then announces that address; if nothing answers, the swarm cannot dial it.

Safe to serve to anyone: the server dials only the IP the request came from (loopback counts as one), never a host
name and never a third party, so it cannot be used to scan others; a few addresses per request, short timeouts, a
rate limit per requesting IP and a cap on requests in flight bound what it spends.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Optional, Sequence

import msgpack

from swarm.dht.direct import listen_hosts
from swarm.dht.frames import recv_frame, send_frame

if TYPE_CHECKING:  # the server and client take any node with SwarmNode's stream calls (tests pass fakes)
    from swarm.dht.node import SwarmNode

logger = logging.getLogger(__name__)

DIALBACK_PROTOCOL = "swarm.dialback"
MAX_TARGETS = 8  # addresses dialled per request (libp2p's few plus the direct-stream port)
CONNECT_SECONDS = 2.0  # per address; the addresses are dialled together
REQUEST_SECONDS = 5.0  # to read a request
MAX_FRAME = 16 << 10
BURST, REFILL_SECONDS = 10, 6.0  # per requesting IP (a machine may run several peers): 10 at once, then one per 6 s
MAX_IN_FLIGHT = 16
ATTEMPTS, RETRY_SECONDS = 3, 1.0  # per server, where the stream was cut (DialBackCut)
DIAL_BACK_BUDGET = 40.0  # seconds for asking all servers (join waits a minute at most)
OPEN = "open"  # the outcome of an address that accepted the connection

Clock = Callable[[], float]


class DialBackError(RuntimeError):
    """The server could not be asked (it does not offer dial-back, is busy, or answered nonsense)."""


class DialBackCut(DialBackError):
    """The stream to the server could not be opened or ended before the answer: worth another try (a node restarted
    on the same ports dials from the same address as the one it replaced, and its first connection can meet what is
    left of the old one's at a router or at the server)."""


@dataclass(frozen=True)
class DialBack:
    """What a server answered: each address's outcome (`open`, `refused`, `timeout`, `not dialled: ...`), the IPs
    it saw the request come from, and its clock against ours."""

    server: str  # peer id
    outcomes: dict[str, str]
    observed: tuple[str, ...]
    offset: float  # server clock minus ours, seconds
    round_trip: float  # seconds, less the server's own time
    version: str

    def opened(self, maddrs: Sequence[str]) -> list[str]:
        return [m for m in maddrs if self.outcomes.get(m) == OPEN]

    def dialled(self, maddrs: Sequence[str]) -> list[str]:
        return [m for m in maddrs if not self.outcomes.get(m, "not dialled").startswith("not dialled")]

    def seen(self, maddrs: Sequence[str]) -> list[str]:
        """The ports of those of `maddrs` at another IP than the server saw us at, at the IP it saw (see
        `seen_forms`): where a forwarded port or a router's mapping answers. A server of an older version dials none
        of them."""
        return seen_forms(maddrs, self.observed)


def tcp_target(maddr: str) -> Optional[tuple[str, int]]:
    """(IP, port) of an /ip4/H/tcp/P or /ip6/H/tcp/P multiaddr (any /p2p/ tail ignored); None for anything else."""
    parts = maddr.strip("/").split("/")
    if len(parts) < 4 or parts[0] not in ("ip4", "ip6") or parts[2] != "tcp":
        return None
    try:
        ipaddress.ip_address(parts[1])
        port = int(parts[3])
    except ValueError:
        return None
    return (parts[1], port) if 0 < port < 65536 else None


def same_host(target: str, requester: str) -> bool:
    """Whether dialling `target` reaches the requester's own machine as far as we can tell: its IP, or loopback when
    the request came over loopback."""
    a, b = ip_of(target), ip_of(requester)
    return a is not None and b is not None and (a == b or (a.is_loopback and b.is_loopback))


def seen_forms(maddrs: Sequence[str], hosts: Sequence[str]) -> list[str]:
    """For each TCP address of `maddrs` at none of `hosts` (the IPs a request came from), its port at each of those
    hosts of its family, in order and without repeats: what the server dials in its stead. Nothing at a loopback
    host (a request over loopback comes from the server's own machine: no router stands between them)."""
    seen: dict[str, None] = {}
    for target in map(tcp_target, maddrs):
        if target is None or any(same_host(target[0], host) for host in hosts):
            continue
        family = ip_of(target[0]).version
        for ip in map(ip_of, hosts):
            if ip is not None and ip.version == family and not ip.is_loopback:
                seen[f"/ip{family}/{ip}/tcp/{target[1]}"] = None
    return list(seen)


def ip_of(host: str) -> Optional[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """The IP `host` names (an IPv4-mapped IPv6 one as IPv4; a zone dropped), None for a name."""
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return None
    mapped = getattr(ip, "ipv4_mapped", None)
    return mapped or ip


async def tcp_connect(host: str, port: int, timeout: float) -> str:
    """`open` if a TCP connection to host:port succeeds within `timeout` (it is closed at once), else why not."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except asyncio.TimeoutError:
        return "timeout"
    except ConnectionRefusedError:
        return "refused"
    except OSError as e:
        return f"unreachable ({e.strerror or type(e).__name__})"
    writer.close()
    return OPEN


class DialBackServer:
    """Answers dial-back requests on a node; see the module docstring for what it refuses."""

    def __init__(self, node: SwarmNode, version: str, clock: Clock = time.time,
                 connect: Callable[[str, int, float], Awaitable[str]] = tcp_connect,
                 requester_hosts: Optional[Callable[[str, asyncio.StreamWriter], Awaitable[list[str]]]] = None):
        self.node, self.version, self.clock, self.connect = node, version, clock, connect
        self.requester_hosts = requester_hosts or self._hosts_of
        self._buckets: dict[str, tuple[float, float]] = {}  # requesting IP -> (tokens, monotonic time of refill)
        self._in_flight = 0

    async def start(self) -> None:
        # Open to peers not (yet) admitted to a private run: a joiner asks before it knows the run is private.
        await self.node.add_stream_handler(DIALBACK_PROTOCOL, self._on_stream, admitted_only=False)

    async def _on_stream(self, remote: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = msgpack.unpackb(await asyncio.wait_for(recv_frame(reader, MAX_FRAME), REQUEST_SECONDS))
        received = self.clock()
        answer = await self.answer(request, await self.requester_hosts(remote, writer))
        await send_frame(writer, msgpack.packb({**answer, "received": received, "sent": self.clock()}))

    async def answer(self, request: Any, hosts: Sequence[str]) -> dict:
        """The answer to `request` ({"maddrs": [...]}) from a requester seen at `hosts` (its connections' IPs)."""
        base = {"version": self.version, "observed": list(hosts)}
        maddrs = request.get("maddrs") if isinstance(request, dict) else None
        if not isinstance(maddrs, list) or not all(isinstance(m, str) and len(m) < 256 for m in maddrs):
            return {**base, "error": "malformed request: expected {'maddrs': [multiaddr, ...]}"}
        if not hosts:
            return {**base, "error": "cannot tell which IP this request came from (a relayed connection?)"}
        if not self._take_token(hosts[0]):
            return {**base, "error": f"rate limited: ask again in {REFILL_SECONDS:.0f} s"}
        if self._in_flight >= MAX_IN_FLIGHT:
            return {**base, "error": "busy: ask again in a few seconds"}
        self._in_flight += 1
        try:
            outcomes = dict.fromkeys(maddrs[MAX_TARGETS:], f"not dialled: over {MAX_TARGETS} addresses")
            dials = {}
            for maddr in maddrs[:MAX_TARGETS]:
                target = tcp_target(maddr)
                if target is None:
                    outcomes[maddr] = "not dialled: only /ip4/ and /ip6/ TCP addresses are"
                elif not any(same_host(target[0], host) for host in hosts):
                    outcomes[maddr] = "not dialled: not the IP this request came from"
                else:
                    dials[maddr] = target
            # In their stead, their ports at the IP the request came from (still only that IP, and MAX_TARGETS
            # dials in all): a forwarded port or a mapping answers there.
            for seen in seen_forms(maddrs[:MAX_TARGETS], hosts):
                if seen not in dials and seen not in outcomes and len(dials) < MAX_TARGETS:
                    dials[seen] = tcp_target(seen)
            dialled = [self.connect(host, port, CONNECT_SECONDS) for host, port in dials.values()]
            outcomes.update(zip(dials, await asyncio.gather(*dialled)))
        finally:
            self._in_flight -= 1
        return {**base, "outcomes": outcomes}

    def _take_token(self, host: str) -> bool:
        now = time.monotonic()
        tokens, since = self._buckets.get(host, (float(BURST), now))
        tokens = min(float(BURST), tokens + (now - since) / REFILL_SECONDS)
        if len(self._buckets) > 4096:  # forget full buckets rather than grow without bound
            self._buckets = {h: b for h, b in self._buckets.items() if b[0] < BURST - 1}
        self._buckets[host] = (tokens - 1, now) if tokens >= 1 else (tokens, now)
        return tokens >= 1

    async def _hosts_of(self, remote: str, writer: asyncio.StreamWriter) -> list[str]:
        """The IPs `remote`'s request came from: the TCP peer of a direct stream, else the remote addresses of
        p2pd's connections to that (authenticated) peer id."""
        peername = writer.get_extra_info("peername")
        if isinstance(peername, tuple) and peername:
            return [str(ip_of(peername[0]) or peername[0])]
        p2p = await self.node.p2p()
        known = [str(a) for info in await p2p.list_peers() if info.peer_id.to_base58() == remote for a in info.addrs]
        return [str(ip_of(host)) for host in listen_hosts(known) if ip_of(host) is not None]


async def serve_dialback(node: SwarmNode, version: str) -> DialBackServer:
    """Start answering dial-back requests on `node`."""
    server = DialBackServer(node, version)
    await server.start()
    return server


async def request_dialback(node: SwarmNode, server: str, maddrs: Sequence[str], clock: Clock = time.time,
                           timeout: float = CONNECT_SECONDS + REQUEST_SECONDS) -> DialBack:
    """Ask peer `server` to dial `maddrs` back. Raises DialBackError if it cannot answer (see DialBackError)."""
    try:
        reader, writer = await asyncio.wait_for(node.open_stream(server, DIALBACK_PROTOCOL, admitted_only=False),
                                                timeout)
    except Exception as e:  # noqa: BLE001 - libp2p says "protocol not supported" in several ways
        raise DialBackCut(f"peer {server} does not answer dial-back requests ({str(e)[:120] or type(e).__name__};"
                            " an older swarm-peer?)") from None
    try:
        sent = clock()
        await send_frame(writer, msgpack.packb({"maddrs": list(maddrs)}))
        answer = msgpack.unpackb(await asyncio.wait_for(recv_frame(reader, MAX_FRAME), timeout))
        received = clock()
    except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError) as e:
        raise DialBackCut(f"peer {server} did not answer the dial-back request ({e or type(e).__name__})") from None
    finally:
        writer.close()
    return _parse(server, answer, sent, received)


def _parse(server: str, answer: Any, sent: float, received: float) -> DialBack:
    if not isinstance(answer, dict):
        raise DialBackError(f"peer {server} answered the dial-back request with {type(answer).__name__}")
    if isinstance(answer.get("error"), str):
        raise DialBackError(f"peer {server} refused the dial-back request: {answer['error']}")
    outcomes, observed = answer.get("outcomes"), answer.get("observed")
    stamps = answer.get("received"), answer.get("sent")
    if not isinstance(outcomes, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in
                                                 outcomes.items()) \
            or not isinstance(observed, list) or not all(isinstance(t, (int, float)) for t in stamps):
        raise DialBackError(f"peer {server} sent a malformed dial-back answer")
    # NTP's offset and delay: the server's time between receiving and answering counts in neither.
    offset = ((stamps[0] - sent) + (stamps[1] - received)) / 2
    round_trip = max((received - sent) - (stamps[1] - stamps[0]), 0.0)
    return DialBack(server, outcomes, tuple(str(h) for h in observed), offset, round_trip,
                    str(answer.get("version", "")))


async def dial_back(node: SwarmNode, servers: Sequence[str], announce: bool = True, attempts: int = ATTEMPTS,
                    pause: float = RETRY_SECONDS) -> tuple[DialBack | DialBackError, list[str], list[str]]:
    """Ask the first of `servers` that answers to dial back our announced addresses (none unless `announce`: the
    answer still carries the clock and version): (answer or the last error, libp2p addresses, direct ones). A
    server whose stream was cut is asked up to `attempts` times, `pause` seconds apart; one that refused, once; no
    new request starts after DIAL_BACK_BUDGET seconds."""
    await node.p2p()  # starts the direct-stream server, so its port is known
    libp2p = [m.rsplit("/p2p/", 1)[0] for m in node.visible_maddrs()] if announce else []
    direct = []
    if announce and node.direct is not None and node.direct.port:
        hosts = node.direct.announce_hosts or [t[0] for t in map(tcp_target, libp2p) if t is not None]
        direct = [f"/{'ip6' if ':' in h else 'ip4'}/{h}/tcp/{node.direct.port}" for h in dict.fromkeys(hosts)]
    answer: DialBack | DialBackError = DialBackError("no initial peer to ask")
    deadline = time.monotonic() + DIAL_BACK_BUDGET
    for server in servers:
        for attempt in range(attempts):
            if time.monotonic() > deadline:
                return answer, libp2p, direct
            try:
                return await request_dialback(node, server, libp2p + direct), libp2p, direct
            except DialBackCut as e:
                answer = e
                if attempt + 1 < attempts:
                    await asyncio.sleep(pause)
            except DialBackError as e:
                answer = e
                break
    return answer, libp2p, direct


def reachable(answer: DialBack, libp2p: Sequence[str]) -> Optional[bool]:
    """Whether the swarm can dial our libp2p addresses: True if one answered, or its port at the IP the server saw
    us at did (a forwarded port or a mapping: announce `forwarded`'s addresses); False if those dialled did not, or,
    from a server that dials no such port, if we announce only private addresses and it saw a public one (behind
    NAT); None when the server could not tell."""
    seen = answer.seen(libp2p)
    if answer.opened(libp2p) or answer.opened(seen):
        return True
    if answer.dialled(libp2p) or answer.dialled(seen):
        return False
    announced = [ipaddress.ip_address(t[0]) for t in map(tcp_target, libp2p) if t is not None]
    observed = [ip for ip in map(ip_of, answer.observed) if ip is not None]
    if announced and all(not ip.is_global for ip in announced) and any(ip.is_global for ip in observed):
        return False
    return None


def forwarded(answer: DialBack, maddrs: Sequence[str]) -> list[str]:
    """The addresses at the IP the server saw us at that answered in the stead of `maddrs` (none if one of `maddrs`
    answered itself): the ones to announce."""
    return [] if answer.opened(maddrs) else answer.opened(answer.seen(maddrs))
