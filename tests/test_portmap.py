"""NAT-PMP port mapping (swarm/dht/portmap.py) against a router played on 127.0.0.1: the external address, a TCP
mapping and its removal, a refusal and a silent router each ending in one line, and stray datagrams ignored. (The
real router, miniupnpd in a network namespace, is in tests/test_nat.py.)"""

from __future__ import annotations

import asyncio
import socket
import struct
import time

import pytest

from swarm.dht.portmap import PortMapError, PortMapping, default_gateway, external_ip, map_tcp


class FakeRouter(asyncio.DatagramProtocol):
    """Answers NAT-PMP as RFC 6886 says, with `result` as its result code; `noise` first sends a datagram that
    answers nothing asked."""

    def __init__(self, result: int = 0, external_port_offset: int = 0, noise: bool = False) -> None:
        self.result, self.offset, self.noise = result, external_port_offset, noise
        self.requests: list[bytes] = []
        self.mappings: dict[int, tuple[int, int]] = {}

    def connection_made(self, transport) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr) -> None:
        self.requests.append(data)
        if self.noise:
            self.transport.sendto(b"\x00\x81\x00\x00", addr)  # too short, another opcode
        if data[:2] == b"\x00\x00":
            self.transport.sendto(struct.pack("!BBHI4s", 0, 128, self.result, 1, socket.inet_aton("203.0.113.7")),
                                  addr)
        elif len(data) == 12 and data[1] in (1, 2):
            _, op, _, internal, suggested, lifetime = struct.unpack("!BBHHHI", data)
            if lifetime:
                self.mappings[internal] = (suggested + self.offset, lifetime)
            else:
                self.mappings.pop(internal, None)
            self.transport.sendto(struct.pack("!BBHIHHI", 0, 128 + op, self.result, 1, internal,
                                              suggested + self.offset, lifetime), addr)


async def _router(**kwargs) -> tuple[asyncio.DatagramTransport, FakeRouter, int]:
    transport, router = await asyncio.get_running_loop().create_datagram_endpoint(
        lambda: FakeRouter(**kwargs), local_addr=("127.0.0.1", 0))
    return transport, router, transport.get_extra_info("sockname")[1]


def test_the_router_s_external_address_and_a_mapping_granted_renewed_and_removed():
    async def main():
        transport, router, port = await _router(noise=True)
        try:
            assert await external_ip("127.0.0.1", port) == "203.0.113.7"
            mapping = await map_tcp("127.0.0.1", 40123, port=port)
            assert (mapping.external_ip, mapping.internal_port, mapping.external_port) == ("203.0.113.7", 40123, 40123)
            assert router.mappings == {40123: (40123, 3600)}
            held = PortMapping(40124, gateway="127.0.0.1", port=port)
            assert (await held.start()).external_port == 40124 and 40124 in router.mappings
            await held.close()
            assert 40124 not in router.mappings and held.mapping is None
        finally:
            transport.close()

    asyncio.run(main())


def test_another_external_port_is_reported_as_granted():
    async def main():
        transport, _, port = await _router(external_port_offset=7)
        try:
            return await map_tcp("127.0.0.1", 40200, port=port)
        finally:
            transport.close()

    assert asyncio.run(main()).external_port == 40207


def test_a_refusing_router_and_a_silent_one_each_end_in_one_line():
    async def refused():
        transport, _, port = await _router(result=2)
        try:
            await map_tcp("127.0.0.1", 40300, port=port)
        finally:
            transport.close()

    with pytest.raises(PortMapError, match="refused NAT-PMP: not authorized or refused"):
        asyncio.run(refused())

    silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # bound, never answers
    silent.bind(("127.0.0.1", 0))
    started = time.monotonic()
    try:
        held = PortMapping(40301, gateway="127.0.0.1", port=silent.getsockname()[1])
        assert asyncio.run(held.start()) is None
    finally:
        silent.close()
    assert "did not answer NAT-PMP" in held.error and "\n" not in held.error
    assert time.monotonic() - started < 6


def test_the_default_gateway_is_read_from_the_route_table(tmp_path):
    table = tmp_path / "route"
    table.write_text("Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\n"
                     "eth0\t0000A8C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\n"
                     "eth0\t00000000\t0100A8C0\t0003\t0\t0\t0\t00000000\n")
    assert default_gateway(table) == "192.168.0.1"
    table.write_text("Iface\tDestination\tGateway \tFlags\n")
    assert default_gateway(table) is None
    assert default_gateway(tmp_path / "missing") is None
