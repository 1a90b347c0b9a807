"""Ask the home router for port mappings with NAT-PMP (RFC 6886), which miniupnpd and many routers that speak UPnP
also speak: the router's external IPv4 address, and TCP mappings of our ports held for a lifetime we renew. p2pd maps
the libp2p port itself (-natPortMap, UPnP or NAT-PMP) but to a random external port, which it announces some seconds
after it started; join (swarm/doctor.py) maps the libp2p and direct-stream ports here, asking for the same external
ports, so that the dial-back (dialback.py), which tries our ports at the IP the swarm saw us at, finds them before
the peer announces them. What the router grants is only a claim until then. A router that does not answer NAT-PMP
is asked by UPnP IGD (upnp.py), found meanwhile by an SSDP search.

The router is the default route's gateway (/proc/net/route); requests go to its UDP port 5351 and are retried with
the RFC's doubling timeout from 250 ms, a few times only: a router that does not answer NAT-PMP costs under 2 s, one
that refuses the port (ICMP port unreachable) nothing."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from swarm.dht import upnp

logger = logging.getLogger(__name__)

NATPMP_PORT = 5351
FIRST_WAIT = 0.25  # seconds before the first retransmission; doubled each time (RFC 6886 section 3.1)
TRIES = 3  # 0.25 + 0.5 + 1 s: the RFC's nine tries would take 64 s; a router that answers does so in milliseconds
LIFETIME = 3600  # seconds a mapping is asked for; renewed at half of what the router granted
RESULTS = {1: "unsupported version", 2: "not authorized or refused", 3: "network failure",
           4: "out of resources", 5: "unsupported opcode"}


class PortMapError(Exception):
    """The router did not answer NAT-PMP, or refused; the message says which, in one line."""


@dataclass(frozen=True)
class Mapping:
    gateway: str
    external_ip: str
    internal_port: int
    external_port: int
    lifetime: int  # seconds the router holds it (0 by UPnP: until removed)
    via: str = "NAT-PMP"  # or "UPnP" (upnp.py: the router does not speak NAT-PMP)


def default_gateway(route_table: Path = Path("/proc/net/route")) -> Optional[str]:
    """The IPv4 gateway of the default route, or None (no default route, or not Linux)."""
    try:
        lines = route_table.read_text().splitlines()[1:]
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) >= 4 and fields[1] == "00000000" and int(fields[3], 16) & 0x2:  # RTF_GATEWAY
            return str(ipaddress.IPv4Address(struct.pack("<I", int(fields[2], 16))))
    return None


class _Exchange(asyncio.DatagramProtocol):
    def __init__(self) -> None:
        self.answers: asyncio.Queue[bytes | OSError] = asyncio.Queue()

    def datagram_received(self, data: bytes, addr) -> None:
        self.answers.put_nowait(data)

    def error_received(self, exc: OSError) -> None:  # an ICMP error for what we sent: nothing listens there
        self.answers.put_nowait(exc)


async def _ask(gateway: str, request: bytes, opcode: int, size: int, port: int = NATPMP_PORT) -> bytes:
    """Send `request` until an answer of opcode 128 + `opcode` and at least `size` bytes comes, with a result code of
    0; raises PortMapError otherwise."""
    loop = asyncio.get_running_loop()
    try:
        transport, protocol = await loop.create_datagram_endpoint(_Exchange, remote_addr=(gateway, port),
                                                                  family=socket.AF_INET)
    except OSError as e:
        raise PortMapError(f"cannot reach the router {gateway} ({e.strerror or e})") from None
    try:
        wait = FIRST_WAIT
        for _ in range(TRIES):
            transport.sendto(request)
            deadline = loop.time() + wait
            while (left := deadline - loop.time()) > 0:
                try:
                    answer = await asyncio.wait_for(protocol.answers.get(), left)
                except asyncio.TimeoutError:
                    break
                if isinstance(answer, OSError):
                    raise PortMapError(f"the router {gateway} does not answer NAT-PMP (UDP port {port}: "
                                       f"{answer.strerror or type(answer).__name__})")
                if len(answer) < size or answer[0] != 0 or answer[1] != 128 + opcode:
                    continue  # not an answer to this request: keep waiting
                (result,) = struct.unpack("!H", answer[2:4])
                if result:
                    raise PortMapError(f"the router {gateway} refused NAT-PMP: "
                                       f"{RESULTS.get(result, f'result code {result}')}")
                return answer
            wait *= 2
    finally:
        transport.close()
    raise PortMapError(f"the router {gateway} did not answer NAT-PMP (UDP port {port}) in "
                       f"{FIRST_WAIT * (2 ** TRIES - 1):.1f} s")


async def external_ip(gateway: str, port: int = NATPMP_PORT) -> str:
    answer = await _ask(gateway, struct.pack("!BB", 0, 0), 0, 12, port)
    return str(ipaddress.IPv4Address(answer[8:12]))


async def map_tcp(gateway: str, internal_port: int, lifetime: int = LIFETIME, external_port: Optional[int] = None,
                  port: int = NATPMP_PORT) -> Mapping:
    """Map TCP `internal_port` on this host (the router sees the request's source address) to an external port,
    the same one if the router grants it, with the router's external address."""
    ip = await external_ip(gateway, port)
    external, granted = await _map_request(gateway, internal_port,
                                           internal_port if external_port is None else external_port, lifetime, port)
    return Mapping(gateway, ip, internal_port, external, granted)


async def _map_request(gateway: str, internal_port: int, external_port: int, lifetime: int,
                       port: int = NATPMP_PORT) -> tuple[int, int]:
    """One mapping exchange (lifetime 0 removes the mapping): (the external port granted, its lifetime)."""
    answer = await _ask(gateway, struct.pack("!BBHHHI", 0, 2, 0, internal_port, external_port, lifetime), 2, 16, port)
    internal, external, granted = struct.unpack("!HHI", answer[8:16])
    if internal != internal_port:
        raise PortMapError(f"the router {gateway} answered for port {internal}, not {internal_port}")
    return external, granted


class PortMapping:
    """One TCP port mapped for as long as we run: asked for at `start`, renewed at half its lifetime, removed at
    `close`. `mapping` is None while the router grants none (`error` says why). Where the router does not answer
    NAT-PMP, the mapping is asked for by UPnP IGD at the gateway `igd` found (upnp.discover), if any."""

    def __init__(self, internal_port: int, gateway: Optional[str] = None, port: int = NATPMP_PORT,
                 igd: Optional[asyncio.Future] = None) -> None:
        self.internal_port, self.gateway, self.port, self.igd = internal_port, gateway, port, igd
        self._upnp: Optional[upnp.Gateway] = None
        self.mapping: Optional[Mapping] = None
        self.error = ""
        self._renewal: Optional[asyncio.Task] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None

    async def start(self) -> Optional[Mapping]:
        self._loop = asyncio.get_running_loop()
        self.gateway = self.gateway or default_gateway()
        if self.gateway is None:
            self.error = "no default route: no router to ask"
            return None
        try:
            self.mapping = await map_tcp(self.gateway, self.internal_port, port=self.port)
        except PortMapError as e:
            self.error = str(e)
            self.mapping = await self._by_upnp()
            if self.mapping is None:
                return None
        self._renewal = asyncio.get_running_loop().create_task(self._renew())
        return self.mapping

    async def _by_upnp(self) -> Optional[Mapping]:
        """The mapping by UPnP IGD, or None (`error` then says why NAT-PMP and UPnP gave none)."""
        if self.igd is None:
            return None
        try:
            self._upnp = gateway = await asyncio.shield(self.igd)
            ip = await upnp.external_ip(gateway)
            lease = await upnp.map_tcp(gateway, self.internal_port, LIFETIME)
        except upnp.UpnpError as e:
            self.error += f"; {e}"
            return None
        return Mapping(self.gateway, ip, self.internal_port, self.internal_port, lease, via="UPnP")

    async def _renew(self) -> None:
        while self.mapping is not None and self.mapping.lifetime > 0:
            await asyncio.sleep(max(self.mapping.lifetime / 2, 30))
            try:
                if self.mapping.via == "UPnP":
                    await upnp.map_tcp(self._upnp, self.internal_port, self.mapping.lifetime)
                    continue
                self.mapping = await map_tcp(self.gateway, self.internal_port, external_port=self.mapping.external_port,
                                             port=self.port)
            except (PortMapError, upnp.UpnpError) as e:
                logger.warning("port mapping of TCP %d not renewed: %s", self.internal_port, e)

    async def close(self) -> None:
        if self._renewal is not None:
            self._renewal.cancel()
        if self.mapping is not None and self.gateway is not None:
            try:  # (one exchange: a removal needs no external address)
                if self.mapping.via == "UPnP":
                    await upnp.unmap_tcp(self._upnp, self.internal_port)
                else:
                    await _map_request(self.gateway, self.internal_port, 0, 0, self.port)
            except (PortMapError, upnp.UpnpError):
                pass  # it lapses at its lifetime anyway
            self.mapping = None

    def release(self, timeout: float = 1.0) -> None:
        """`close`, from a thread other than the one whose loop started the mapping (a node's shutdown), waiting at
        most `timeout` s for the router: a mapping it did not remove lapses at the end of its lifetime. From that
        loop's own thread, the removal is only started."""
        loop = self._loop
        if loop is None or loop.is_closed() or not loop.is_running() or self.mapping is None and self._renewal is None:
            return
        try:
            if asyncio.get_running_loop() is loop:
                loop.create_task(self.close())
                return
        except RuntimeError:
            pass  # no loop runs in this thread: the usual case
        future = asyncio.run_coroutine_threadsafe(self.close(), loop)
        try:
            future.result(timeout)
        except Exception:  # noqa: BLE001 - a timeout, or a loop closing under us: the mapping lapses
            future.cancel()


async def map_ports(ports: dict[int, str], gateway: Optional[str] = None,
                    port: int = NATPMP_PORT) -> tuple[list[PortMapping], str]:
    """Map each TCP port of `ports` (port -> what it serves, e.g. "libp2p") to the same external port, all at once.
    Returns the mappings granted at the port asked for (renewed until closed) and one line that says what the router
    granted, or why it granted nothing. A mapping granted at another external port is removed again, and the line
    says so: the swarm tries our ports at the router's address, so it would go unused. The router is looked for by
    UPnP IGD meanwhile, for the ports it does not map by NAT-PMP."""
    gateway = gateway or default_gateway()
    igd = asyncio.ensure_future(upnp.discover(gateway)) if gateway is not None and ports else None
    held = [PortMapping(internal, gateway, port, igd) for internal in ports]
    try:
        await asyncio.gather(*(mapping.start() for mapping in held))
    finally:
        if igd is not None:
            igd.cancel()
            await asyncio.gather(igd, return_exceptions=True)  # (its error, if nobody needed it, is nobody's news)
    router = held[0].gateway if held else gateway
    said, granted = [], [m for m in held if m.mapping is not None and m.mapping.external_port == m.internal_port]
    if granted:
        said.append(f"the router {router} forwards " + ("by UPnP " if granted[0].mapping.via == "UPnP" else "")
                    + ", ".join(f"{m.mapping.external_ip}:{m.internal_port} ({ports[m.internal_port]})"
                                for m in granted)
                    + (f" to this machine's same ports for {granted[0].mapping.lifetime} s, renewed while the peer runs"
                       if granted[0].mapping.lifetime else " to this machine's same ports until the peer stops"))
    for mapping in held:
        if mapping.mapping is not None and mapping not in granted:
            offered = mapping.mapping.external_port
            await mapping.close()
            said.append(f"the router {router} offered external port {offered} for the {ports[mapping.internal_port]} "
                        f"port {mapping.internal_port}, not the same one: the swarm tries our ports at the router's "
                        "address (announcing another port is not supported), so that mapping was removed")
    if not said:
        said.append("none: " + ("; ".join(dict.fromkeys(m.error for m in held)) or "no port to map"))
    return granted, "; ".join(said)
