"""Direct streams between real nodes on 127.0.0.1 (each with its own p2pd): a stream between two peers skips the
daemons and still tells the receiver who opened it; a peer that cannot be reached directly is reached over libp2p;
nobody can open a stream under another peer's id, nor reuse a signature meant for another receiver; an opener
never talks to a listener whose certificate differs from the one the peer announced."""

from __future__ import annotations

import asyncio
import hashlib
import os
import ssl

import msgpack
import pytest

from swarm.dht import direct
from swarm.dht.direct import Route
from swarm.dht.node import NetworkOptions, SwarmNode, recv_frame, send_frame
from swarm.dht.validation import Identity
from swarm.runtime import LoopThread

ECHO = "test.echo"


@pytest.fixture(scope="module")
def swarm():
    loop = LoopThread()
    seen: list[str] = []  # remote peer ids, as the echo handler was told them

    async def echo(remote: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(remote)
        data = await recv_frame(reader)
        await send_frame(writer, hashlib.sha256(data).digest())

    first = SwarmNode([], NetworkOptions())
    nodes = [first] + [SwarmNode(first.visible_maddrs(), NetworkOptions(direct_streams=direct_on))
                       for direct_on in (True, False)]
    for node in nodes:
        loop.run(node.add_stream_handler(ECHO, echo), timeout=30)
    yield loop, nodes, seen
    for node in nodes:
        node.shutdown()
    loop.close()


async def _echo(node: SwarmNode, peer: str, data: bytes) -> bytes:
    reader, writer = await node.open_stream(peer, ECHO)
    try:
        await send_frame(writer, data)
        return await asyncio.wait_for(recv_frame(reader, 64), 30)
    finally:
        writer.close()


def test_a_stream_between_two_peers_goes_direct_and_names_its_opener(swarm):
    loop, (a, b, _), seen = swarm
    data = os.urandom(8 << 20)
    before = dict(b.direct.opened)
    assert loop.run(_echo(b, a.peer_id, data), timeout=60) == hashlib.sha256(data).digest()
    assert b.direct.opened["direct"] == before["direct"] + 1, b.direct.opened
    assert b.direct.opened["fallback"] == before["fallback"]
    assert seen[-1] == b.peer_id


def test_a_peer_without_direct_streams_is_reached_over_libp2p_both_ways(swarm):
    loop, (a, b, c), seen = swarm
    data = os.urandom(1 << 20)
    fallback = a.direct.opened["fallback"]
    assert loop.run(_echo(a, c.peer_id, data), timeout=60) == hashlib.sha256(data).digest()
    assert a.direct.opened["fallback"] == fallback + 1  # c answers no hello: libp2p it is
    assert seen[-1] == a.peer_id
    assert loop.run(_echo(c, a.peer_id, data), timeout=60) == hashlib.sha256(data).digest()
    assert seen[-1] == c.peer_id


def test_a_listener_with_another_certificate_is_never_sent_anything(swarm):
    """A stale or forged route (the fingerprint the peer announced does not match what answers at that address):
    the opener hangs up before its signed handshake and opens the stream over libp2p instead."""
    loop, (a, b, _), seen = swarm
    b.direct._routes[a.peer_id] = Route(("127.0.0.1",), a.direct.port, b"\x00" * 32)
    b.direct._unreachable.pop(a.peer_id, None)
    before = dict(b.direct.opened)
    data = os.urandom(1 << 16)
    assert loop.run(_echo(b, a.peer_id, data), timeout=60) == hashlib.sha256(data).digest()
    assert b.direct.opened["fallback"] == before["fallback"] + 1
    assert b.direct.opened["direct"] == before["direct"]
    assert seen[-1] == b.peer_id
    b.direct._unreachable.pop(a.peer_id, None)  # the other tests expect direct streams again


async def _handshake(port: int, auth: dict) -> bytes:
    """Open a raw TLS connection to a direct-stream listener, send `auth` and an echo request; what comes back."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context, server_hostname="")
    try:
        packed = msgpack.packb(auth)
        writer.write(len(packed).to_bytes(8, "big") + packed)
        await send_frame(writer, b"hello")
        return await asyncio.wait_for(reader.read(), 30)
    finally:
        writer.close()


@pytest.mark.parametrize("forgery", ["another key's signature", "signature for another receiver",
                                     "key of another peer id", "garbage"])
def test_nobody_opens_a_direct_stream_in_another_peers_name(swarm, forgery):
    loop, (a, b, _), seen = swarm
    mallory = Identity.ephemeral()
    mallory.discard_file()
    victim = b.direct.identity
    message = direct.DOMAIN + a.direct.fingerprint + ECHO.encode()
    auth = {"peer": victim.peer_id, "key": victim.public_key.decode(), "protocol": ECHO}
    if forgery == "another key's signature":
        auth["signature"] = mallory.private_key.sign(message)
    elif forgery == "signature for another receiver":  # what b signed for a listener with another certificate
        auth["signature"] = victim.private_key.sign(direct.DOMAIN + b"\x01" * 32 + ECHO.encode())
    elif forgery == "key of another peer id":  # mallory's valid signature, under the victim's peer id
        auth.update(key=mallory.public_key.decode(), signature=mallory.private_key.sign(message))
    else:
        auth = {"peer": 7, "protocol": ["x"]}
    count = len(seen)
    assert loop.run(_handshake(a.direct.port, auth), timeout=60) == b""  # dropped, nothing answered
    assert len(seen) == count  # the handler never ran


def test_the_genuine_handshake_is_accepted(swarm):
    """The same raw client as the forgeries, with the real signature: so the forgery tests fail for the forgery."""
    loop, (a, b, _), seen = swarm
    me = b.direct.identity
    auth = {"peer": me.peer_id, "key": me.public_key.decode(), "protocol": ECHO,
            "signature": me.private_key.sign(direct.DOMAIN + a.direct.fingerprint + ECHO.encode())}
    answer = loop.run(_handshake(a.direct.port, auth), timeout=60)
    assert answer[8:] == hashlib.sha256(b"hello").digest()
    assert seen[-1] == me.peer_id


def test_listen_hosts_reads_ip_multiaddrs():
    assert direct.listen_hosts(["/ip4/10.0.0.2/tcp/5", "/ip6/::1/tcp/7", "/dns4/example.org/tcp/1",
                                "/ip4/0.0.0.0/tcp/31337"]) == ["10.0.0.2", "::1", "0.0.0.0"]


def test_every_listening_host_gets_the_one_announced_port():
    """A node listening on several addresses announces one port: all of them must listen on it."""
    identity = Identity.ephemeral()
    identity.discard_file()
    streams = direct.DirectStreams(identity, ["127.0.0.1", "127.0.0.2"], [], 0, listen=True)
    loop = LoopThread()
    try:
        loop.run(streams.start(), timeout=30)
        ports = {server.sockets[0].getsockname()[1] for server in streams._servers}
        assert len(streams._servers) == 2 and ports == {streams.port}, ports
    finally:
        streams.close()
        loop.close()
