"""Ask the home router for a port mapping with NAT-PMP (RFC 6886), which miniupnpd and most routers that speak UPnP
also speak: the router's external IPv4 address, and a TCP mapping of one of our ports held for a lifetime we renew.
p2pd maps the libp2p port itself (-natPortMap); this maps the direct-stream port, which p2pd knows nothing of. What
the router grants is only a claim: the dial-back (dialback.py) checks that the mapped address answers before the
peer announces it.

The router is the default route's gateway (/proc/net/route); requests go to its UDP port 5351 and are retried with
the RFC's doubling timeout from 250 ms, a few times only: a router that does not answer NAT-PMP costs about 2 s."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

logger = logging.getLogger(__name__)

NATPMP_PORT = 5351
FIRST_WAIT = 0.25  # seconds before the first retransmission; doubled each time (RFC 6886 section 3.1)
TRIES = 4  # 0.25 + 0.5 + 1 + 2 s: the RFC's nine tries would take 64 s
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
    lifetime: int  # seconds the router holds it


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
        self.answers: asyncio.Queue[bytes] = asyncio.Queue()

    def datagram_received(self, data: bytes, addr) -> None:
        self.answers.put_nowait(data)


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
    the same one if the router grants it; lifetime 0 removes the mapping."""
    request = struct.pack("!BBHHHI", 0, 2, 0, internal_port,
                          internal_port if external_port is None else external_port, lifetime)
    ip = await external_ip(gateway, port)
    answer = await _ask(gateway, request, 2, 16, port)
    internal, external, granted = struct.unpack("!HHI", answer[8:16])
    if internal != internal_port:
        raise PortMapError(f"the router {gateway} answered for port {internal}, not {internal_port}")
    return Mapping(gateway, ip, internal_port, external, granted)


class PortMapping:
    """One TCP port mapped for as long as we run: asked for at `start`, renewed at half its lifetime, removed at
    `close`. `mapping` is None while the router grants none (`error` says why)."""

    def __init__(self, internal_port: int, gateway: Optional[str] = None, port: int = NATPMP_PORT) -> None:
        self.internal_port, self.gateway, self.port = internal_port, gateway, port
        self.mapping: Optional[Mapping] = None
        self.error = ""
        self._renewal: Optional[asyncio.Task] = None

    async def start(self) -> Optional[Mapping]:
        self.gateway = self.gateway or default_gateway()
        if self.gateway is None:
            self.error = "no default route: no router to ask"
            return None
        try:
            self.mapping = await map_tcp(self.gateway, self.internal_port, port=self.port)
        except PortMapError as e:
            self.error = str(e)
            return None
        self._renewal = asyncio.get_running_loop().create_task(self._renew())
        return self.mapping

    async def _renew(self) -> None:
        while self.mapping is not None:
            await asyncio.sleep(max(self.mapping.lifetime / 2, 30))
            try:
                self.mapping = await map_tcp(self.gateway, self.internal_port, external_port=self.mapping.external_port,
                                             port=self.port)
            except PortMapError as e:
                logger.warning("port mapping of TCP %d not renewed: %s", self.internal_port, e)

    async def close(self) -> None:
        if self._renewal is not None:
            self._renewal.cancel()
        if self.mapping is not None and self.gateway is not None:
            try:
                await map_tcp(self.gateway, self.internal_port, lifetime=0, port=self.port)
            except PortMapError:
                pass  # it lapses at its lifetime anyway
            self.mapping = None
