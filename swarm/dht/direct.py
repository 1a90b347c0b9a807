"""Direct streams: the bulk bytes of a stream go over a TLS connection between the two peers' own processes
instead of through both p2pd daemons.

Through p2pd every byte is copied by two daemons (yamux, noise) and two unix sockets: on the mixed-link benchmark a
round took 11.6 s that way and 9.8 s direct (plain TCP: 9.6 s), and on loopback it kept both cores busy. A direct stream
is one TCP connection per stream, TLS 1.3 with an ephemeral certificate that we never check against a CA: the opener
pins the certificate's SHA-256 fingerprint, which it got from the receiver over a libp2p stream (authenticated by the
receiver's peer id). The opener then proves its own peer id by signing the fingerprint with its RSA identity key, the
key its libp2p peer id is the hash of. So both ends know who the other is, as over libp2p, and a signature seen on one
connection is worth nothing on any other (another receiver has another certificate).

Any failure to reach a peer this way (it listens on no address we can reach, e.g. behind NAT or a firewall, or it
restarted with a new certificate) falls back to a libp2p stream; the next stream tries directly again (a first
failure may pass), and after a second failure in a row the peer is not tried directly again for RETRY_SECONDS. A
connection the receiver cuts before it accepted the stream (one byte, ACCEPTED, after it checked our signature)
falls back too: then the peer is busy, not unreachable, and is tried directly again after BUSY_SECONDS.

Anyone can connect to the port, so connections not yet authenticated are counted before any TLS work: at most
HANDSHAKES_PER_SOURCE from one source (an IPv4 address, an IPv6 /64) and MAX_HANDSHAKES in all; more are closed at
once. One address cannot fill the table. An attacker with MAX_HANDSHAKES / HANDSHAKES_PER_SOURCE addresses or more
can: then streams to us from new sources fall back to libp2p (slower, not lost), except from the sources of the
peers named by `expect` (seen authenticated before), which have RESERVED_HANDSHAKES slots beyond the total. Peers
behind the attacker's own address (one NAT) share its per-source limit.
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import ipaddress
import logging
import os
import ssl
import tempfile
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Optional, Sequence

import msgpack
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from hivemind.utils.crypto import RSAPublicKey

from swarm.dht.frames import FRAME_HEADER, recv_frame
from swarm.dht.validation import Identity, peer_id_of
from swarm.words import shown

logger = logging.getLogger(__name__)

HELLO_PROTOCOL = "swarm.direct.hello"  # libp2p protocol: "where and under which certificate do you listen?"
DOMAIN = b"swarm direct stream v1\x00"  # what an opener's signature is about, so it signs nothing else
# An opener that waits for ACCEPTED signs under this domain instead (and says "ack": True), so that a receiver too
# old to send ACCEPTED finds the signature bad and hangs up at once rather than leaving the opener waiting.
ACK_DOMAIN = b"swarm direct stream v2\x00"
ACCEPTED = b"\x01"
MAX_AUTH_BYTES = 16 << 10
HANDSHAKE_SECONDS = 10.0  # TLS handshake + the opener's signed frame, or the connection is dropped
CONNECT_SECONDS = 3.0
HELLO_SECONDS = 5.0
RETRY_SECONDS = 30.0  # after a second failed direct attempt in a row, libp2p streams only for this long
BUSY_SECONDS = 5.0  # after a connection the receiver cut before accepting it (e.g. its slots were full)
# Connections not yet authenticated (TCP accepted, TLS and signature pending), counted before any TLS work: more
# are closed at once. An honest peer has a few at once, each for about two round trips.
HANDSHAKES_PER_SOURCE = 8
MAX_HANDSHAKES = 64
RESERVED_HANDSHAKES = 64  # beyond MAX_HANDSHAKES, for the sources of expected peers only
MAX_KNOWN_SOURCES = 4096  # peer id -> the source it last authenticated from, for `expect`
STREAM_LIMIT = 4 << 20  # StreamReader buffer: big reads, fewer wake-ups (asyncio's default is 64 KiB)

Handler = Callable[[str, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
Opened = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class DirectError(ConnectionError):
    """A direct stream could not be opened (the caller falls back to libp2p)."""


class DirectBusy(DirectError):
    """The receiver took the connection and cut it before accepting the stream (its slots were full, or it does
    not serve the protocol directly): fall back for now, try directly again soon."""


# What a connection cut by the other end looks like, during the TLS handshake or before ACCEPTED.
_CUT = (ConnectionResetError, ConnectionAbortedError, BrokenPipeError, ssl.SSLEOFError, asyncio.IncompleteReadError)


@dataclass(frozen=True)
class Route:
    """How to reach a peer directly: addresses to try in order, and the certificate fingerprint to expect."""

    hosts: tuple[str, ...]
    port: int
    fingerprint: bytes


def listen_hosts(maddrs: Sequence[str]) -> list[str]:
    """The IP hosts of /ip4/... and /ip6/... multiaddrs (unspecified ones included, as 0.0.0.0 or ::)."""
    hosts = []
    for maddr in maddrs:
        parts = maddr.strip("/").split("/")
        if len(parts) >= 2 and parts[0] in ("ip4", "ip6") and parts[1] not in hosts:
            hosts.append(parts[1])
    return hosts


def source_of(peername) -> str:
    """The source a connection counts against: its IPv4 address, or the /64 of its IPv6 address (one host can
    have a whole /64)."""
    host = peername[0] if isinstance(peername, tuple) and peername else str(peername)
    try:
        address = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.ip_network(f"{address}/64", strict=False))
    return str(address)


class HandshakeSlots:
    """Counts connections not yet authenticated, per source and in all; `take` refuses one over either cap."""

    def __init__(self, per_source: int, total: int, reserved: int):
        self.per_source, self.total, self.reserved = per_source, total, reserved
        self.pending: dict[str, int] = {}  # source -> its connections not yet authenticated (none: left out)
        self.count = 0

    def take(self, source: str, expected: bool = False) -> bool:
        """Count one more connection from `source`, or return False if it is over a cap (`expected`: the source
        of a peer we expect, which may also use the `reserved` slots beyond the total)."""
        if self.pending.get(source, 0) >= self.per_source or \
                self.count >= self.total + (self.reserved if expected else 0):
            return False
        self.pending[source] = self.pending.get(source, 0) + 1
        self.count += 1
        return True

    def release(self, source: str) -> None:
        left = self.pending.pop(source) - 1
        if left:
            self.pending[source] = left
        self.count -= 1


def _specified(host: str) -> bool:
    try:
        return not ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def _certificate() -> tuple[bytes, bytes]:
    """A fresh self-signed certificate (EC P-256: cheap handshakes) and its key, both PEM. Nobody checks it
    against a CA: peers pin its fingerprint."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "swarm peer")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=3650)).sign(key, hashes.SHA256()))
    return (cert.public_bytes(serialization.Encoding.PEM),
            key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()))


def _signed_message(fingerprint: bytes, protocol: str, ack: bool = True) -> bytes:
    return (ACK_DOMAIN if ack else DOMAIN) + fingerprint + protocol.encode()


class _HeldStreamProtocol(asyncio.StreamReaderProtocol):
    """asyncio's stream protocol, except that it reads nothing until _serve starts TLS (start_tls resumes
    reading): the opener's TLS hello must reach the TLS layer, not sit in the plain StreamReader."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.pause_reading()
        super().connection_made(transport)


class DirectStreams:
    """This node's direct-stream server (unless it cannot accept connections) and its routes to other peers."""

    def __init__(self, identity: Identity, bind_hosts: Sequence[str], announce_hosts: Sequence[str], port: int,
                 listen: bool):
        self.identity = identity
        self.bind_hosts = list(bind_hosts) or ["127.0.0.1"]
        self.announce_hosts = [h for h in announce_hosts if _specified(h)]
        self.requested_port, self.listen = port, listen
        self.port: Optional[int] = None
        self.fingerprint = b""
        self.handlers: dict[str, Handler] = {}
        self.opened = {"direct": 0, "fallback": 0}  # streams we opened, by how
        self._routes: dict[str, Route] = {}
        self._unreachable: dict[str, float] = {}  # peer id -> monotonic time until which we do not try it
        self._served: set[str] = set()  # peers a direct stream reached since they last failed one (see open)
        self._failures: dict[str, int] = {}  # peer id -> direct attempts to it that failed in a row (see open)
        self._told: set[str] = set()  # peers whose fallback to libp2p the log has mentioned once
        self._servers: list[asyncio.base_events.Server] = []
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._server_context: Optional[ssl.SSLContext] = None
        self.slots = HandshakeSlots(HANDSHAKES_PER_SOURCE, MAX_HANDSHAKES, RESERVED_HANDSHAKES)
        self._sources: dict[str, str] = {}  # peer id -> the source it last authenticated from
        self._expected: frozenset[str] = frozenset()
        self._expected_sources: set[str] = set()
        self._signatures: dict[tuple[bytes, str], bytes] = {}
        self._client_context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        self._client_context.minimum_version = ssl.TLSVersion.TLSv1_3
        self._client_context.check_hostname = False
        self._client_context.verify_mode = ssl.CERT_NONE  # we check the pinned fingerprint ourselves

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if not self.listen:
            return
        cert, key = _certificate()
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        with tempfile.TemporaryDirectory(prefix="swarm-direct-") as directory:  # ssl loads chains from files only
            paths = [os.path.join(directory, name) for name in ("cert.pem", "key.pem")]
            for path, data in zip(paths, (cert, key)):
                with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
                    f.write(data)
            context.load_cert_chain(*paths)
        self.fingerprint = hashlib.sha256(ssl.PEM_cert_to_DER_cert(cert.decode())).digest()
        self._server_context = context
        # Plain TCP: _serve counts a connection against its source before it starts TLS (asyncio's ssl= server
        # does the handshake first, for anyone, however many). One port on every host we listen on (we announce
        # one): the first host picks it, the others follow.
        port = self.requested_port
        for host in self.bind_hosts:
            try:
                server = await self._loop.create_server(self._held_protocol, host=host, port=port)
            except OSError as e:
                logger.warning("direct streams: cannot listen on %s port %d (%s); peers reach us there over libp2p "
                               "only", host, port, e.strerror or e)
                continue
            self._servers.append(server)
            port = self.port = server.sockets[0].getsockname()[1]
        logger.debug("direct streams on %s port %s", ",".join(self.bind_hosts), self.port)

    def _held_protocol(self) -> asyncio.StreamReaderProtocol:
        return _HeldStreamProtocol(asyncio.StreamReader(limit=STREAM_LIMIT, loop=self._loop), self._serve,
                                   loop=self._loop)

    def hello(self) -> dict:
        """What a peer that asks over libp2p gets: where we listen (no port: we do not) and our fingerprint."""
        return {"port": self.port, "hosts": self.announce_hosts, "fingerprint": self.fingerprint}

    def expect(self, peer_ids) -> None:
        """The peers we expect streams from now (e.g. our averaging group): connections from the sources they last
        authenticated from may use RESERVED_HANDSHAKES slots beyond the total. Replaces the previous set."""
        self._expected = frozenset(peer_ids)
        self._expected_sources = {self._sources[p] for p in self._expected if p in self._sources}

    def close(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            for server in self._servers:
                self._loop.call_soon_threadsafe(server.close)

    # ---- receiving ----------------------------------------------------------------------------------------
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        source = source_of(writer.get_extra_info("peername"))
        if not self.slots.take(source, expected=source in self._expected_sources):
            writer.transport.abort()  # no TLS work for a source over its share: the opener falls back at once
            return
        try:
            remote, handler = await asyncio.wait_for(self._accept(reader, writer), HANDSHAKE_SECONDS)
        except Exception as e:  # noqa: BLE001 - whatever a stranger sends, we only drop the connection
            # A connection that ends before it says anything (a port check, a scanner, an opener giving up) is no
            # news; a handshake that says something we refuse is.
            level = logging.DEBUG if isinstance(e, (*_CUT, ssl.SSLError, asyncio.TimeoutError)) else logging.INFO
            logger.log(level, "direct stream from %s refused: %s", source, str(e) or type(e).__name__)
            writer.close()
            return
        finally:
            self.slots.release(source)
        self._learn_source(remote, source)
        await handler(remote, reader, writer)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> tuple[str, Handler]:
        """TLS, then the opener's signed frame; ACCEPTED if the opener waits for it. The remote and its handler."""
        await writer.start_tls(self._server_context, ssl_handshake_timeout=HANDSHAKE_SECONDS)
        remote, handler, ack = await self._authenticate(reader)
        if ack:
            writer.write(ACCEPTED)
        return remote, handler

    def _learn_source(self, peer_id: str, source: str) -> None:
        self._sources.pop(peer_id, None)
        if len(self._sources) >= MAX_KNOWN_SOURCES:
            self._sources.pop(next(iter(self._sources)))  # the one that authenticated longest ago
        self._sources[peer_id] = source
        if peer_id in self._expected:
            self._expected_sources = {self._sources[p] for p in self._expected if p in self._sources}

    async def _authenticate(self, reader: asyncio.StreamReader) -> tuple[str, Handler, bool]:
        auth = msgpack.unpackb(await recv_frame(reader, MAX_AUTH_BYTES))
        if not isinstance(auth, dict) or not all(isinstance(auth.get(k), t) for k, t in (
                ("peer", str), ("key", str), ("protocol", str), ("signature", bytes))):
            raise DirectError("malformed handshake")
        ack = auth.get("ack") is True  # an opener that does not ask (older ones) gets no ACCEPTED
        if peer_id_of(auth["key"]) != auth["peer"]:
            raise DirectError(f"the key sent does not give peer id {auth['peer']}")
        if not RSAPublicKey.from_bytes(auth["key"].encode()).verify(
                _signed_message(self.fingerprint, auth["protocol"], ack), auth["signature"]):
            raise DirectError(f"bad signature from {auth['peer']}")
        handler = self.handlers.get(auth["protocol"])
        if handler is None:
            raise DirectError(f"{auth['peer']} asked for protocol {shown(auth['protocol'])}, which we do not serve")
        return auth["peer"], handler, ack

    # ---- opening ------------------------------------------------------------------------------------------
    async def open(self, peer_id: str, protocol: str,
                   ask_hello: Callable[[str], Awaitable[tuple[dict, list[str]]]]) -> Optional[Opened]:
        """A direct stream to `peer_id` for `protocol` that the peer accepted, or None: then open it over libp2p
        (and we will not try this peer directly again for RETRY_SECONDS, or BUSY_SECONDS if it cut the connection
        before accepting it; the first failure in a row, which may pass, only for this stream). `ask_hello(peer)`
        returns the peer's hello and the hosts libp2p knows for it (used when the peer announces none, e.g. it
        listens on 0.0.0.0)."""
        if time.monotonic() < self._unreachable.get(peer_id, 0.0):
            self.opened["fallback"] += 1
            return None
        try:
            route = self._routes.get(peer_id)
            if route is None:
                route = await asyncio.wait_for(self._route(peer_id, ask_hello), HELLO_SECONDS)
            opened = await self._connect(route, protocol)
        except DirectBusy as e:
            # It listens and its certificate is the one announced, but it cut us before accepting: its slots were
            # full (perhaps strangers fill them) or it does not serve the protocol directly. This stream goes over
            # libp2p; the next ones try directly again soon.
            logger.debug("%s cut a direct stream before accepting it (%s); using libp2p for %.0f s", peer_id[-8:],
                         e, BUSY_SECONDS)
            self._routes[peer_id] = route
            self._unreachable[peer_id] = time.monotonic() + BUSY_SECONDS
            self.opened["fallback"] += 1
            return None
        except Exception as e:  # noqa: BLE001 - any failure here only means: use libp2p
            # The normal case for a peer behind NAT, one without the port forwarded, or a bootstrap: said once, at
            # DEBUG. A peer that served direct streams and stopped is news (its port closed, it restarted).
            if peer_id in self._served:
                logger.info("direct streams to %s stopped working (%s); using libp2p for %.0f s", peer_id[-8:],
                            e or type(e).__name__, RETRY_SECONDS)
            elif peer_id not in self._told:
                logger.debug("%s takes streams over libp2p, not direct ones (%s)", peer_id[-8:],
                             e or type(e).__name__)
            self._served.discard(peer_id)
            self._told.add(peer_id)
            self._routes.pop(peer_id, None)
            # A first failure may pass (a peer still starting its server, a connection timed out on a busy host):
            # the next stream tries again. Once the peer fell back for RETRY_SECONDS, a two-second run (a test's)
            # never used a direct stream to it. From the second failure in a row on, libp2p for RETRY_SECONDS.
            failures = self._failures[peer_id] = self._failures.get(peer_id, 0) + 1
            self._unreachable[peer_id] = time.monotonic() + (RETRY_SECONDS if failures > 1 else 0.0)
            self.opened["fallback"] += 1
            return None
        self._failures.pop(peer_id, None)
        self._routes[peer_id] = route
        self._served.add(peer_id)
        self.opened["direct"] += 1
        return opened

    async def _route(self, peer_id: str, ask_hello) -> Route:
        hello, known_hosts = await ask_hello(peer_id)
        port, hosts, fingerprint = hello.get("port"), hello.get("hosts"), hello.get("fingerprint")
        if not isinstance(port, int) or not 0 < port < 65536:
            raise DirectError("it accepts no direct streams")
        if not isinstance(hosts, list) or not isinstance(fingerprint, bytes) or len(fingerprint) != 32:
            raise DirectError("malformed hello")
        hosts = [h for h in hosts if isinstance(h, str) and _specified(h)] or \
            [h for h in known_hosts if _specified(h)]
        if not hosts:
            raise DirectError("no address to reach it at")
        return Route(tuple(hosts[:4]), port, fingerprint)

    def _signature(self, fingerprint: bytes, protocol: str) -> bytes:
        """Our signature for streams of `protocol` to the receiver with this certificate, made once (a few ms of
        RSA): it is worth nothing to anyone else, whose certificate differs."""
        key = (fingerprint, protocol)
        if key not in self._signatures:
            if len(self._signatures) >= 1024:
                self._signatures.clear()
            self._signatures[key] = self.identity.private_key.sign(_signed_message(fingerprint, protocol))
        return self._signatures[key]

    async def _connect(self, route: Route, protocol: str) -> Opened:
        """A stream the receiver accepted (it sent ACCEPTED), so that nothing the caller writes is lost to a
        connection cut after it opened. Raises DirectBusy if the receiver cut it first, DirectError otherwise."""
        errors, cut = [], False
        for host in route.hosts:
            try:
                reader, writer = await asyncio.wait_for(asyncio.open_connection(
                    host, route.port, ssl=self._client_context, server_hostname="", limit=STREAM_LIMIT),
                    CONNECT_SECONDS)
            except _CUT as e:  # it took the TCP connection and dropped it (e.g. its slots for our source were full)
                errors.append(f"{host}:{route.port}: cut during the TLS handshake ({e or type(e).__name__})")
                cut = True
                continue
            except (OSError, ssl.SSLError, asyncio.TimeoutError) as e:
                errors.append(f"{host}:{route.port}: {e or type(e).__name__}")
                continue
            try:
                certificate = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
                if hashlib.sha256(certificate or b"").digest() != route.fingerprint:
                    raise DirectError(f"{host}:{route.port} presented another certificate than the peer announced")
                auth = msgpack.packb({"peer": self.identity.peer_id, "key": self.identity.public_key.decode(),
                                      "protocol": protocol, "ack": True,
                                      "signature": self._signature(route.fingerprint, protocol)})
                writer.write(FRAME_HEADER.pack(len(auth)) + auth)
                try:
                    answer = await asyncio.wait_for(reader.readexactly(len(ACCEPTED)), CONNECT_SECONDS)
                except _CUT as e:
                    raise DirectBusy(f"{host}:{route.port}: cut before accepting ({e or type(e).__name__})") from None
                except asyncio.TimeoutError:
                    raise DirectError(f"{host}:{route.port} did not accept the stream in {CONNECT_SECONDS:.0f} s") \
                        from None
                if answer != ACCEPTED:
                    raise DirectError(f"{host}:{route.port} answered {shown(answer)}, not ACCEPTED")
            except BaseException:
                writer.close()
                raise
            return reader, writer
        raise (DirectBusy if cut else DirectError)("; ".join(errors))
