"""NAT-PMP port mapping (swarm/dht/portmap.py) against a router played on 127.0.0.1: the external address, a TCP
mapping and its removal, a refusal, a silent router and a closed port each ending in one line, stray datagrams
ignored, a node's ports mapped at once and released from another thread; and when port mapping is on by default.
(The real router, miniupnpd in a network namespace, is in tests/test_nat.py.)"""

from __future__ import annotations

import asyncio
import socket
import struct
import time

import pytest

from swarm.dht.node import NetworkOptions, loopback_only
from swarm.dht.portmap import PortMapError, PortMapping, default_gateway, external_ip, map_ports, map_tcp
from swarm.runtime import LoopThread
from swarm.settings import NetworkSettings, PeerSettings


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


def test_nothing_listening_at_the_router_s_port_ends_at_once():
    closed = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # (the kernel answers ICMP port unreachable)
    started = time.monotonic()
    with pytest.raises(PortMapError, match=r"does not answer NAT-PMP \(UDP port \d+: Connection refused\)"):
        asyncio.run(external_ip("127.0.0.1", port))
    assert time.monotonic() - started < 0.5


def test_a_node_s_ports_are_mapped_at_once_and_one_line_says_what_the_router_granted():
    async def main(**router):
        transport, fake, port = await _router(**router)
        try:
            mappings, line = await map_ports({40400: "libp2p", 40401: "direct-stream"}, "127.0.0.1", port)
            return mappings, line, dict(fake.mappings)
        finally:
            transport.close()

    mappings, line, held = asyncio.run(main())
    assert [m.internal_port for m in mappings] == [40400, 40401] and set(held) == {40400, 40401}
    assert line == ("the router 127.0.0.1 forwards 203.0.113.7:40400 (libp2p), 203.0.113.7:40401 (direct-stream) "
                    "to this machine's same ports for 3600 s, renewed while the peer runs")
    # another external port: the swarm would try ours at the router's address and find nothing, so it goes
    mappings, line, held = asyncio.run(main(external_port_offset=5))
    assert mappings == [] and held == {}, "a mapping at another port is removed again"
    assert line.startswith("the router 127.0.0.1 offered external port 40405 for the libp2p port 40400, not the "
                           "same one: ") and "offered external port 40406 for the direct-stream port 40401" in line
    mappings, line, _ = asyncio.run(main(result=2))
    assert mappings == [] and line == ("none: the router 127.0.0.1 refused NAT-PMP: not authorized or refused; no UPnP "
                                       "gateway answered at 127.0.0.1 in 1.5 s")  # (nothing answers SSDP there)


def test_a_mapping_is_released_from_another_thread_than_its_loop():
    """As a node's shutdown does (the peer's main thread, the mapping renewed on its loop thread)."""
    loop = LoopThread()
    try:
        transport, router, port = loop.run(_router())
        held = PortMapping(40500, gateway="127.0.0.1", port=port)
        assert loop.run(held.start()) is not None and 40500 in router.mappings
        held.release()
        assert 40500 not in router.mappings and held.mapping is None and held._renewal.cancelled()
        held.release()  # (nothing left to do)
        loop.run(asyncio.sleep(0))
        transport.close()
    finally:
        loop.close()


def test_port_mapping_is_on_by_default_except_on_loopback_in_client_mode_or_with_announced_addresses():
    """So local swarms and tests (loopback) never touch a router, and a peer on a real interface maps its ports
    without a flag."""
    assert NetworkSettings().port_mapping == "auto"
    for hosts, on in ((("/ip4/127.0.0.1/tcp/0",), False), (("/ip6/::1/tcp/0", "/dns/localhost/tcp/1"), False),
                      (("/ip4/0.0.0.0/tcp/0",), True), (("/ip4/127.0.0.1/tcp/0", "/ip4/192.168.1.5/tcp/0"), True),
                      (("/dns4/example.org/tcp/1",), True)):
        assert loopback_only(hosts) is not on, hosts
        options = NetworkOptions(**PeerSettings(initial_peers=("/ip4/1.2.3.4/tcp/1/p2p/QmX",), network=NetworkSettings(
            host_maddrs=hosts)).network.model_dump())
        assert options.maps_ports is on and options.hivemind_kwargs()["nat_port_map"] is on, hosts
    assert NetworkOptions().maps_ports is False, "the defaults stay on loopback"
    lan = ("/ip4/192.168.1.5/tcp/0",)
    assert not NetworkOptions(host_maddrs=lan, port_mapping="off").maps_ports
    assert NetworkOptions(host_maddrs=("/ip4/127.0.0.1/tcp/0",), port_mapping="on").maps_ports
    assert not NetworkOptions(host_maddrs=lan, client_mode=True).maps_ports, "nobody dials a client"
    assert not NetworkOptions(host_maddrs=lan, announce_maddrs=("/ip4/8.8.8.8/tcp/4000",)).maps_ports
    assert not NetworkOptions(nat_traversal=True).hivemind_kwargs()["nat_port_map"], "relays and AutoNAT only"

