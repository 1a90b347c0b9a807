"""Handshake slots of the direct-stream server (issue 37, class 7): idle connections from one address, however many,
leave honest openers on other addresses served directly; strangers on many addresses cannot push out the peers we
expect; and a stream the receiver cuts right after connecting is opened over libp2p, so the exchange completes.
The first tests run an in-process server on 127.0.0.1 and attackers bound to other loopback addresses (Linux
routes all of 127/8 to lo); the last one runs two real nodes."""

from __future__ import annotations

import asyncio
import hashlib
import os
import ssl
import time

import pytest
from conftest import ask_echo

from swarm.dht import direct
from swarm.dht.direct import DirectStreams, HandshakeSlots, source_of
from swarm.dht.node import NetworkOptions, SwarmNode, recv_frame, send_frame
from swarm.dht.validation import Identity
from swarm.runtime import LoopThread

ECHO = "test.echo"


def _identity() -> Identity:
    identity = Identity.ephemeral()
    identity.discard_file()
    return identity


async def _echo_handler(remote: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    data = await recv_frame(reader)
    await send_frame(writer, hashlib.sha256(data).digest())
    writer.close()


@pytest.fixture
def server():
    """A receiver listening on 127.0.0.1 with an echo handler, an opener, and a list for the attackers' writers."""
    loop = LoopThread()
    receiver = DirectStreams(_identity(), ["127.0.0.1"], ["127.0.0.1"], 0, listen=True)
    opener = DirectStreams(_identity(), [], [], 0, listen=False)
    loop.run(receiver.start(), timeout=30)
    loop.run(opener.start(), timeout=30)
    receiver.handlers[ECHO] = _echo_handler
    attackers: list[asyncio.StreamWriter] = []
    yield loop, receiver, opener, attackers
    for writer in attackers:
        loop.loop.call_soon_threadsafe(writer.transport.abort)
    receiver.close()
    loop.close()


async def _exchange(opener: DirectStreams, receiver: DirectStreams, data: bytes):
    """Open a direct stream to `receiver` and echo `data`: the answer, or None if open() said 'use libp2p'."""

    async def ask_hello(_peer: str):
        return receiver.hello(), []

    opened = await opener.open(receiver.identity.peer_id, ECHO, ask_hello)
    if opened is None:
        return None
    reader, writer = opened
    try:
        await send_frame(writer, data)
        return await asyncio.wait_for(recv_frame(reader, 64), 5)
    finally:
        writer.close()


async def _idle_tls(port: int, sources: list[str], per_source: int, attackers: list) -> int:
    """`per_source` connections from each of `sources` that do the TLS handshake if let, then send nothing (no
    key, no signature). Returns how many got through TLS; their writers go to `attackers`."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE

    async def connect(source: str):
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(
                "127.0.0.1", port, ssl=context, server_hostname="", local_addr=(source, 0)), 5)
        except (OSError, asyncio.TimeoutError):
            return None
        attackers.append(writer)
        return writer

    connected = await asyncio.gather(*(connect(source) for source in sources for _ in range(per_source)))
    return sum(writer is not None for writer in connected)


def test_idle_connections_from_one_address_leave_an_opener_on_another_served_directly(server):
    loop, receiver, opener, attackers = server
    through = loop.run(_idle_tls(receiver.port, ["127.0.0.2"], 80, attackers), timeout=30)
    data = os.urandom(1 << 16)
    assert loop.run(_exchange(opener, receiver, data), timeout=30) == hashlib.sha256(data).digest()
    assert opener.opened == {"direct": 1, "fallback": 0}
    # The attacker's address got its share of TLS handshakes and no more; the rest were closed before TLS.
    assert through == direct.HANDSHAKES_PER_SOURCE, through
    assert receiver.slots.pending == {"127.0.0.2": direct.HANDSHAKES_PER_SOURCE}


def test_many_addresses_fill_the_table_but_expected_peers_keep_slots(server):
    """Strangers on enough addresses fill MAX_HANDSHAKES: a new opener is refused before TLS and open() says
    'use libp2p' at once (not after a timeout); the source of an expected peer that authenticated before still
    gets a direct stream."""
    loop, receiver, opener, attackers = server
    data = os.urandom(1 << 10)
    assert loop.run(_exchange(opener, receiver, data), timeout=30) == hashlib.sha256(data).digest()  # seen once
    sources = [f"127.0.0.{i}" for i in range(2, 2 + direct.MAX_HANDSHAKES // direct.HANDSHAKES_PER_SOURCE + 1)]
    loop.run(_idle_tls(receiver.port, sources, direct.HANDSHAKES_PER_SOURCE, attackers), timeout=30)
    assert receiver.slots.count == direct.MAX_HANDSHAKES

    start = time.monotonic()
    assert loop.run(_exchange(opener, receiver, data), timeout=30) is None
    assert time.monotonic() - start < direct.CONNECT_SECONDS  # refused, not timed out
    assert opener.opened == {"direct": 1, "fallback": 1}

    receiver.expect([opener.identity.peer_id])
    opener._unreachable.clear()  # (busy peers are tried directly again after BUSY_SECONDS)
    assert loop.run(_exchange(opener, receiver, data), timeout=30) == hashlib.sha256(data).digest()
    assert opener.opened == {"direct": 2, "fallback": 1}


def test_a_receiver_that_cuts_the_connection_before_accepting_makes_open_fall_back(server):
    """The receiver authenticates the opener, then closes (here: it does not serve the protocol directly): open()
    returns None, as for an unreachable peer, and tries directly again after BUSY_SECONDS, not RETRY_SECONDS."""
    loop, receiver, opener, _ = server
    del receiver.handlers[ECHO]
    assert loop.run(_exchange(opener, receiver, b"lost?"), timeout=30) is None
    assert opener.opened == {"direct": 0, "fallback": 1}
    retry_in = opener._unreachable[receiver.identity.peer_id] - time.monotonic()
    assert 0 < retry_in <= direct.BUSY_SECONDS


@pytest.fixture(scope="module")
def nodes():
    loop = LoopThread()

    async def echo(remote: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await send_frame(writer, hashlib.sha256(await recv_frame(reader)).digest())

    first = SwarmNode([], NetworkOptions())
    second = SwarmNode(first.visible_maddrs(), NetworkOptions())
    for node in (first, second):
        loop.run(node.add_stream_handler(ECHO, echo), timeout=30)
    yield loop, first, second
    for node in (first, second):
        node.shutdown()
    loop.close()


def test_a_stream_cut_right_after_connecting_goes_over_libp2p_and_the_exchange_completes(nodes):
    """The receiver's direct server takes the connection and closes it after TLS, before the stream reaches a
    handler: the opener must not hand its caller that stream (the request would be lost) but a libp2p one."""
    loop, a, b = nodes
    data = os.urandom(1 << 16)
    assert loop.run(ask_echo(b, a.peer_id, ECHO, data), timeout=30) == hashlib.sha256(data).digest()
    assert b.direct.opened == {"direct": 1, "fallback": 0}  # so the cut below is what makes the difference

    handler = a.direct.handlers.pop(ECHO)  # served over libp2p only, as while add_stream_handler is under way
    try:
        assert loop.run(ask_echo(b, a.peer_id, ECHO, data), timeout=30) == hashlib.sha256(data).digest()
        assert b.direct.opened == {"direct": 1, "fallback": 1}
    finally:
        a.direct.handlers[ECHO] = handler
        b.direct._unreachable.clear()
    assert loop.run(ask_echo(b, a.peer_id, ECHO, data), timeout=30) == hashlib.sha256(data).digest()
    assert b.direct.opened == {"direct": 2, "fallback": 1}


def test_sources_are_ipv4_addresses_and_ipv6_slash_64s():
    assert source_of(("10.1.2.3", 5)) == "10.1.2.3"
    assert source_of(("::ffff:10.1.2.3", 5, 0, 0)) == "10.1.2.3"
    assert source_of(("2001:db8::1", 5, 0, 0)) == source_of(("2001:db8::ffff:2", 7, 0, 0)) == "2001:db8::/64"
    assert source_of(("2001:db8:0:1::1", 5, 0, 0)) != source_of(("2001:db8::1", 5, 0, 0))


def test_slots_cap_each_source_and_the_total_and_keep_a_reserve_for_expected_sources():
    slots = HandshakeSlots(per_source=2, total=3, reserved=2)
    assert [slots.take("a") for _ in range(3)] == [True, True, False]
    assert slots.take("b") and not slots.take("c")  # the total is full
    assert slots.take("c", expected=True) and slots.take("c", expected=True)
    assert not slots.take("c", expected=True)  # its own per-source cap
    assert not slots.take("d", expected=True)  # and the reserve is full
    for source in ("a", "a", "b", "c", "c"):
        slots.release(source)
    assert slots.pending == {} and slots.count == 0
