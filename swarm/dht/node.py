"""Our handle on the hivemind DHT: start a node (loopback-safe defaults) whose RSA identity also signs its
records, store and read typed records under the swarm's validation rules, and open and serve peer-to-peer byte
streams (a bounded number at once per peer).
The rest of swarm never imports hivemind; it talks to `SwarmNode`.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Mapping, Optional, Sequence

import msgpack
from hivemind.p2p import P2P, PeerID
from hivemind.utils import ValueWithExpiration, get_dht_time

from swarm.dht.admission import INVITE_FIELD, Admission, AdmissionValidator, revocations_key
from swarm.dht.direct import HELLO_PROTOCOL, DirectStreams, listen_hosts
from swarm.dht.frames import FRAME_HEADER, MAX_FRAME_BYTES, recv_frame, send_frame  # noqa: F401 - re-exported
from swarm.dht.lifeline import identity_held_here
from swarm.dht.portmap import PortMapping
from swarm.dht.process import DHTProcess, rejoin_initial_peers
from swarm.dht.records import RECIPE_KEY, RECIPE_RULE
from swarm.dht.validation import Identity, IdentityError, KeyRule, SwarmValidator, make_validators, subkey_owner

logger = logging.getLogger(__name__)

REJOIN_SECONDS = 5.0  # how often a node checks that its initial peers are still in its routing table
# Streams one protocol's handler serves at once, from one peer and from all: more are closed at once, unread, so a
# peer cannot pile up tasks and sockets (a process has about a thousand descriptors). Honest peers open a few.
MAX_STREAMS_PER_PEER = 64
MAX_STREAMS = 512
HOLDER_EXIT_SECONDS = 3.0  # how long a start waits for a crashed peer's p2pd holding our identity to exit
ADMISSION_SECONDS = 10.0  # how long a stream of a private run may take to present its opener's invite
MAX_INVITE_FRAME = 4096


class NodeError(RuntimeError):
    """The DHT node could not start or reach the swarm; the message says what to check."""


@dataclass(frozen=True)
class NetworkOptions:
    """How this node listens and whether it uses NAT traversal. Defaults keep everything on loopback."""

    host_maddrs: tuple[str, ...] = ("/ip4/127.0.0.1/tcp/0",)
    announce_maddrs: tuple[str, ...] = ()
    identity_path: Optional[str] = None  # RSA key: fixes the peer id and signs this node's records
    port_mapping: str = "auto"  # on, off, or auto: on unless every host address is loopback (see maps_ports)
    nat_traversal: bool = False  # AutoNAT, relays: off for local swarms, on for real deployments
    relay_service: bool = False  # relay others' connections (p2pd would serve anyone whenever relays are on)
    client_mode: bool = False  # cannot accept inbound connections
    direct_streams: bool = True  # bulk streams over our own TLS connections, not through p2pd (libp2p fallback)
    direct_port: int = 0  # TCP port for direct streams (0: any free one; fix it to forward it through a NAT)

    @property
    def maps_ports(self) -> bool:
        """Whether this node asks its router to forward its ports (p2pd's -natPortMap, and join's NAT-PMP mappings,
        swarm/dht/portmap.py): `port_mapping` on, or auto with some host address not loopback (so local swarms never
        touch a router); never in client mode (nobody dials it) nor with addresses announced in the stead of the
        listening ones (they are what the swarm dials)."""
        if self.client_mode or self.announce_maddrs or self.port_mapping == "off":
            return False
        return self.port_mapping == "on" or not loopback_only(self.host_maddrs)

    def hivemind_kwargs(self) -> dict:
        kwargs: dict[str, Any] = dict(
            host_maddrs=list(self.host_maddrs),
            nat_port_map=self.maps_ports,
            auto_nat=self.nat_traversal,
            use_relay=self.nat_traversal or self.relay_service,
            use_auto_relay=self.nat_traversal,
            use_ipfs=False,  # never contact public IPFS bootstrap nodes
            client_mode=self.client_mode,
            relay_service=self.relay_service,  # (not hivemind's: the DHT process passes it to p2pd, see process.py)
        )
        if self.announce_maddrs:
            kwargs["announce_maddrs"] = list(self.announce_maddrs)
        return kwargs


def loopback_only(maddrs: Sequence[str]) -> bool:
    """Whether every one of `maddrs` names a loopback host (127.0.0.0/8, ::1, localhost): nothing outside this
    machine reaches them."""
    for maddr in maddrs:
        parts = maddr.strip("/").split("/")
        host = parts[1] if len(parts) >= 2 else ""
        try:
            if not ipaddress.ip_address(host.split("%", 1)[0]).is_loopback:
                return False
        except ValueError:
            if host != "localhost":
                return False
    return True


StreamHandler = Callable[[str, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class StreamGate:
    """Counts streams being served, per remote peer and in all; `admit` refuses one over either cap."""

    def __init__(self, per_peer: int, total: int):
        self.per_peer, self.total = per_peer, total
        self.serving: dict[str, int] = {}  # peer -> its streams being served (peers with none are left out)
        self.count = 0

    def admit(self, peer: str, over_total: bool = False) -> bool:
        """Count one more stream from `peer`, or return False if it is over a cap (`over_total`: only the
        per-peer one, for a peer we know we need)."""
        if self.serving.get(peer, 0) >= self.per_peer or (self.count >= self.total and not over_total):
            return False
        self.serving[peer] = self.serving.get(peer, 0) + 1
        self.count += 1
        return True

    def release(self, peer: str) -> None:
        left = self.serving.pop(peer) - 1
        if left:
            self.serving[peer] = left
        self.count -= 1


class SwarmNode:
    """A DHT node (our DHT process, see swarm/dht/process.py, plus its p2pd) and a P2P replica bound to the
    caller's loop."""

    def __init__(self, initial_peers: Sequence[str], options: NetworkOptions, startup_timeout: float = 30.0):
        for maddr in initial_peers:
            if "/p2p/" not in maddr:
                raise NodeError(f"initial peer {maddr!r} has no /p2p/<peer id> part: copy the full multiaddr "
                                "that `swarm-peer bootstrap` printed")
        # The peers we were told to trust, e.g. to pick the run owner's recipe (last /p2p/ part: through relays too).
        self.initial_peer_ids: tuple[str, ...] = tuple(m.rsplit("/p2p/", 1)[1].split("/")[0] for m in initial_peers)
        self._initial_peers = tuple(initial_peers)
        self._last_rejoin = time.monotonic()
        try:
            self.identity = Identity.load_or_create(options.identity_path) if options.identity_path \
                else Identity.ephemeral()
        except IdentityError as e:
            raise NodeError(str(e)) from None
        kwargs = options.hivemind_kwargs()
        kwargs["identity_path"] = self.identity.path
        if self.identity.ephemeral:
            kwargs["check_if_identity_free"] = False  # a key made a moment ago is free; the check costs a p2pd start
        else:
            holder = identity_held_here(self.identity.path, wait=HOLDER_EXIT_SECONDS)
            if holder:
                raise NodeError(f"identity {self.identity.path} is in use on this machine by {holder}, or give this "
                                "peer another --identity-path")
        try:
            self.dht = DHTProcess(initial_peers, make_validators(self.identity, {RECIPE_KEY: RECIPE_RULE}),
                                  startup_timeout=startup_timeout, **kwargs)
        except Exception as e:  # noqa: BLE001 - hivemind raises many types for "could not start / reach"
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            if "is already taken by another peer" in reason:  # hivemind dialled our peer id and someone answered
                raise NodeError(f"identity {self.identity.path} is in use by another peer of the swarm, not by a "
                                "process on this machine: a copy of this key runs elsewhere; give this peer its own "
                                "--identity-path (a missing file is created)") from None
            raise NodeError(f"could not start the DHT node or reach {', '.join(initial_peers) or 'the swarm'}: "
                            f"{reason}") from None
        finally:
            self.identity.discard_file()  # p2pd has read it; a temporary key must not outlive the node on disk
        self.peer_id: str = self.dht.peer_id
        if self.peer_id != self.identity.peer_id:
            self.dht.shutdown()
            raise NodeError(f"p2pd runs as {self.peer_id} but the identity key gives {self.identity.peer_id}: "
                            "records could not be signed")
        # Our entries under protected keys go here: hivemind signs them with our key, others cannot forge them.
        self.owned_subkey: str = self.identity.owned_subkey
        self._protected: set[str] = {RECIPE_KEY}
        self.admission: Optional[Admission] = None  # set once we know the run is private (see private_run)
        self.refused_streams = 0  # streams of peers not admitted to our private run, closed unread
        self._p2p: Optional[P2P] = None
        self._p2p_lock: Optional[asyncio.Lock] = None
        self.direct: Optional[DirectStreams] = None
        # Ports the router maps to this node (join's, swarm.doctor): renewed on the caller's loop, removed at shutdown.
        self.port_mappings: list[PortMapping] = []
        if options.direct_streams:
            self.direct = DirectStreams(self.identity, listen_hosts(options.host_maddrs),
                                        listen_hosts(options.announce_maddrs or options.host_maddrs),
                                        options.direct_port, listen=not options.client_mode)

    def visible_maddrs(self) -> list[str]:
        """Full multiaddrs (with /p2p/<id>) that other peers pass as --initial-peers."""
        return [str(m) for m in self.dht.get_visible_maddrs(latest=True)]

    # ---- records -------------------------------------------------------------------------------------------
    async def store(self, key: str, value: Any, ttl: float, subkey: Optional[str] = None) -> bool:
        """Store `value`; in a private run, our entries under our owned subkey carry our invite (a mapping gets
        it as INVITE_FIELD), without which no node accepts them."""
        admission = self.admission
        if admission is not None and admission.token and subkey == self.owned_subkey and isinstance(value, dict):
            value = {**value, INVITE_FIELD: admission.token}
        return bool(await self.dht.store(key, value, get_dht_time() + ttl, subkey=subkey))

    async def get(self, key: str) -> dict[str, Any]:
        """Subkey -> value of a dictionary record (empty if absent); a plain value is returned under key ''. In a
        private run, owned entries of peers not admitted are left out (a node that stored them before it knew the
        run was private may still hold them), and every REVOCATION_SECONDS a read first re-reads the owner's
        revocation list (see read_revocations)."""
        if self.admission is not None and self.admission.revocations_due():
            await self.read_revocations()
        found = await self.dht.get(key, latest=True)
        if found is None:
            return {}
        value = found.value
        if isinstance(value, dict) and value and all(isinstance(v, ValueWithExpiration) for v in value.values()):
            entries = {str(sub): item.value for sub, item in value.items()}  # a dictionary record (subkeys)
            admission = self.admission
            if admission is not None:
                entries = {sub: item for sub, item in entries.items()
                           if (writer := subkey_owner(sub)) is None or admission.entry_admitted(writer, item)}
            return entries
        return {"": value}

    def protect(self, rules: Mapping[str, KeyRule]) -> None:
        """From now on, accept only owned, signed entries under these keys (as every honest node does)."""
        new = {key: rule for key, rule in rules.items() if key not in self._protected}
        if new:
            self.dht.add_validators([SwarmValidator(new)])
            self._protected.update(new)

    def private_run(self, owner: str, owner_key: str, run_id: str) -> Admission:
        """From now on, take part in private run `run_id` of `owner` (public key `owner_key`, OpenSSH form): every
        entry and stream of a peer without its invite to that run, or revoked by the owner, is refused. Returns the
        admission, where the peer's own invite goes (Admission.join_with)."""
        if self.admission is None or (self.admission.owner, self.admission.run_id) != (owner, run_id):
            self.dht.add_validators([AdmissionValidator(owner, owner_key, run_id)])
            self.admission = Admission(owner, owner_key, run_id)
        return self.admission

    async def read_revocations(self) -> None:
        """Read the private run owner's revocation list and follow it (Admission.follow): from then on, entries and
        streams of the peers it revokes are refused, here and (the list passed its validator) in our DHT process.
        A failed read is retried REVOCATION_SECONDS later."""
        admission = self.admission
        if admission is None:
            return
        try:
            found = await self.dht.get(revocations_key(admission.run_id), latest=True)
        except Exception as e:  # noqa: BLE001 - the next read retries; the caller's own read goes on
            logger.debug("could not read the revocation list: %r", e)
            found = None
        value = found.value if found is not None else None
        entries = {str(sub): item.value for sub, item in value.items() if isinstance(item, ValueWithExpiration)} \
            if isinstance(value, dict) else {}
        if admission.follow_entries(entries):
            logger.info("the run owner revoked the invites of %d peers (list of %s)", len(admission.revocation.revoked),
                        time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(admission.revocation.issued / 1000)))

    async def rejoin(self) -> list[str]:
        """Reconnect to initial peers that dropped out of our routing table, e.g. a bootstrap that restarted: it
        comes back with an empty table, and nodes that removed it while it was down would never call it again.
        Does nothing if called again within REJOIN_SECONDS. Returns the peer ids reconnected."""
        if not self._initial_peers or time.monotonic() - self._last_rejoin < REJOIN_SECONDS:
            return []
        self._last_rejoin = time.monotonic()
        return await self.dht.run_coroutine(rejoin_initial_peers, self._initial_peers)

    @staticmethod
    def now() -> float:
        return get_dht_time()

    # ---- streams -------------------------------------------------------------------------------------------
    async def p2p(self) -> P2P:
        """The P2P replica on the caller's loop (made on first use, with our direct-stream server)."""
        if self._p2p is None:
            if self._p2p_lock is None:
                self._p2p_lock = asyncio.Lock()
            async with self._p2p_lock:
                if self._p2p is None:
                    p2p = await self.dht.replicate_p2p()
                    if self.direct is not None:
                        await self.direct.start()
                        if self.direct.port is not None:
                            await p2p.add_binary_stream_handler(HELLO_PROTOCOL, self._on_hello)
                    self._p2p = p2p
        return self._p2p

    async def add_stream_handler(self, name: str, handler: StreamHandler, admitted_only: bool = True) -> None:
        """Serve protocol `name`, over libp2p and direct streams alike; the handler gets (remote peer id, reader,
        writer), the remote authenticated either way. In a private run, a stream of an `admitted_only` protocol
        starts with its opener's invite, and one from a peer not admitted is closed before the handler sees it.
        Streams over MAX_STREAMS_PER_PEER or MAX_STREAMS being served are closed at once."""
        p2p = await self.p2p()
        gate = StreamGate(MAX_STREAMS_PER_PEER, MAX_STREAMS)

        async def _guarded(remote: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            if not gate.admit(remote):
                logger.debug("refused a %s stream from %s: too many being served", name, remote)
                writer.close()
                return
            try:
                if admitted_only and self.admission is not None and not await self._admitted(remote, reader):
                    logger.info("refused a %s stream from %s: not admitted to this private run", name, remote)
                    self.refused_streams += 1
                    return
                await handler(remote, reader, writer)
            except (asyncio.IncompleteReadError, ConnectionError) as e:
                logger.debug("stream %s from %s ended early: %r", name, remote, e)
            except Exception:  # noqa: BLE001 - a bad request must never take the peer down
                logger.exception("handler %s failed for a request from %s", name, remote)
            finally:
                gate.release(remote)
                writer.close()

        async def _on_stream(info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await _guarded(info.peer_id.to_base58(), reader, writer)

        await p2p.add_binary_stream_handler(name, _on_stream)
        if self.direct is not None:
            self.direct.handlers[name] = _guarded

    async def open_stream(self, peer_id: str, name: str,
                          admitted_only: bool = True) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A byte stream to `peer_id`'s handler of protocol `name`: direct when the peer can be reached so,
        through p2pd otherwise. In a private run, an `admitted_only` protocol's stream starts with our invite (the
        owner's, with none)."""
        p2p = await self.p2p()
        opened = None
        if self.direct is not None:
            opened = await self.direct.open(peer_id, name, self._ask_hello)
        if opened is None:
            _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), name)
            opened = reader, writer
        if admitted_only and self.admission is not None:
            await send_frame(opened[1], (self.admission.token or "").encode())  # no wait for an answer
        return opened

    async def _admitted(self, remote: str, reader: asyncio.StreamReader) -> bool:
        """Read the invite a stream of a private run starts with; whether it admits `remote`."""
        try:
            token = (await asyncio.wait_for(recv_frame(reader, MAX_INVITE_FRAME), ADMISSION_SECONDS)).decode()
        except (asyncio.TimeoutError, ValueError):  # a frame too long or not text: not an invite
            return False
        return self.admission.admits(remote, token or None)

    async def _on_hello(self, _info, _reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await send_frame(writer, msgpack.packb(self.direct.hello()))
        finally:
            writer.close()

    async def _ask_hello(self, peer_id: str) -> tuple[dict, list[str]]:
        """`peer_id`'s direct-stream hello, and the IP hosts of the addresses libp2p reaches it at."""
        p2p = await self.p2p()
        _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), HELLO_PROTOCOL)
        try:
            hello = msgpack.unpackb(await recv_frame(reader, 64 << 10))
        finally:
            writer.close()
        known = [str(a) for info in await p2p.list_peers() if info.peer_id.to_base58() == peer_id for a in info.addrs]
        return (hello if isinstance(hello, dict) else {}), listen_hosts(known)

    def shutdown(self) -> None:
        for mapping in self.port_mappings:  # (the router forwards nothing to a peer that is gone)
            mapping.release()
        self.port_mappings = []
        if self.direct is not None:
            self.direct.close()
        try:
            self.dht.shutdown()
        except Exception:  # noqa: BLE001 - best effort at exit
            logger.debug("DHT shutdown raised", exc_info=True)

