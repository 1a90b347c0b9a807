"""A malicious participant, for attack tests and scripts/attack_bench.py: one key, one process, following the
protocol wherever that helps it and lying wherever it can. Each scenario is a coroutine run against a real swarm:

  forged-reference   announce the swarm's round + 1 with a state of our own making (perturbed params), and serve
                     that state to whoever asks: without a quorum, every peer re-synced to it
  dribbling-holder   announce the swarm's current state as if we held it, and answer every state request with the
                     right header and then one byte every half second, never silent for a whole stall
  uninvited          in a private swarm, without an invite: write a peer record and matchmaking entries with our
                     own key (carrying an invite we forged, signed by us in the owner's name), and open all-reduce
                     streams to every peer presenting it; our own node keeps no rules of the run
  sybils             make --sybils keys and write a valid signed peer record for each (~7 kB; nodes accept up to
                     8 KiB) under the run's peers key, from one plain hivemind node that keeps all of them
  wipe               every second, from a plain hivemind node without our validators, write plain values living an
                     hour under the run's peers key and the matchmaking keys of the swarm's round and the next
                     (attempts 0-3): a node that took them would drop every entry under those keys
  idle-streams       hold --streams all-reduce streams open to the honest peers (spread over them), sending
                     nothing, reopening each one a peer closes
  oversized-frames   keep opening all-reduce streams to every honest peer that name the swarm's round and claim a
                     chunk of 1 GiB, then feed it; as a non-member of any group, not a byte of it should be read
  future-record      keep a signed peer record at the swarm's top round that claims 2^40 tokens in the round at
                     1e12 tokens/s and is dated an hour ahead (live for its whole lifetime, were it believed)
  handshake-flood    ask every honest peer for its direct-stream hello over libp2p, then hold --connections idle
                     TCP connections to its direct port from FLOOD_SOURCE (another address than the honest peers'),
                     sending nothing, reopening each one the peer closes

Two attackers of the same scenario collude: a forged state is drawn from the swarm's own digest, so both announce
and serve the same one.

Run as a process: python scripts/attackers.py --initial-peers MADDR --scenario NAME --cache-dir DIR [--events-file F]
It writes `ready` once it can attack and `attacking` events (scenario, round, digest) to --events-file while it
lies, and stops after --seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from dataclasses import astuple, replace
from pathlib import Path

import msgpack
import torch
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.dht.node import DHTNode
from hivemind.dht.validation import CompositeValidator, DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer, get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from swarm import __version__
from swarm.config import Recipe
from swarm.dht import view
from swarm.dht.admission import Admission, Invite
from swarm.dht.frames import FRAME_HEADER, recv_frame, send_frame
from swarm.dht.node import NetworkOptions, SwarmNode
from swarm.dht.recipes import fetch_recipe
from swarm import combinations
from swarm.dht.records import RECIPE_KEY, PeerRecord, group_key, parse_peer_records, parse_recipes, peers_key
from swarm.dht.validation import owned_subkey, peer_id_of, subkey_owner_key
from swarm.events import EventLog
from swarm.data.prepare import prepare_run_data
from swarm.peer.diloco import DiLoCo
from swarm.model.build import build_model
from swarm.peer.state.serve import StateServer
from swarm.peer.state.wire import protocol
from swarm.runtime import LoopThread

logger = logging.getLogger("attacker")
SCENARIOS = ("forged-reference", "dribbling-holder", "uninvited", "sybils", "wipe", "idle-streams", "oversized-frames",
             "future-record", "handshake-flood")
KNOCKING = ("idle-streams", "oversized-frames")
FLOOD_SOURCE = "127.0.0.2"  # handshake-flood connects from here: on loopback, one address apart from the honest peers'
# (which all connect from 127.0.0.1), as an attacker on the internet has its own
FUTURE_SECONDS = 3600.0  # how far ahead future-record dates its record
SYBIL_BATCH = 50  # records per store request (one request must stay under hivemind's 2 MiB message limit)


class DribblingServer(StateServer):
    """The honest holders' header (copied from one of them), then one byte every half second: alive for any stall
    timeout, useless to the joiner. Asked for a replay, it lists nothing, so joiners download."""

    header: dict | None = None

    async def handle(self, remote, reader, writer):
        request = msgpack.unpackb(await recv_frame(reader, 1024))
        if not isinstance(request, dict) or "replay_from" in request or self.header is None:
            return
        await send_frame(writer, msgpack.packb(self.header))
        for _ in range(min(request.get("length", 0), self.header["size"])):
            await send_frame(writer, b"\0")
            await asyncio.sleep(0.5)


class SybilSigner(RecordValidatorBase):
    """Signs each record with the key its subkey names, of the many we hold (hivemind signs with one key only)."""

    def __init__(self, keys: list[RSAPrivateKey]):
        self.keys = {key.get_public_key().to_bytes(): key for key in keys}

    def validate(self, record: DHTRecord) -> bool:
        return True  # our own node keeps whatever it is given

    def sign_value(self, record: DHTRecord) -> bytes:
        for public, key in self.keys.items():
            if public in record.subkey:
                return record.value + b"[signature:" + key.sign(MSGPackSerializer.dumps(astuple(record))) + b"]"
        return record.value

    @property
    def priority(self) -> int:
        return 10


def sybil_key() -> RSAPrivateKey:
    """A fresh 1024-bit RSA key (what nodes check is the signature, not the key's size; a small key is cheap)."""
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key._private_key = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    return key


class Attacker:
    def __init__(self, initial_peers: list[str], scenario: str, cache_dir: str, events: EventLog, sybils: int = 0,
                 streams: int = 500, vouchers: int = 2, connections: int = 64):
        self.scenario, self.events, self.streams, self.vouchers = scenario, events, streams, vouchers
        self.connections = connections
        self.loop = LoopThread()
        # (streams held open go over direct TLS connections, as a peer's would)
        self.node = SwarmNode(initial_peers, NetworkOptions(direct_streams=scenario in KNOCKING))
        self._streamed: set[str] = set()  # peers we opened an all-reduce stream to
        if scenario in ("wipe", "future-record", "handshake-flood", *KNOCKING):  # it needs the run's id only
            self.recipe = self.loop.run(fetch_recipe(self.node, timeout=30), timeout=60)
            self.key, self.initial_peers = peers_key(self.recipe.run_id), initial_peers
            return
        if scenario == "sybils":
            self.recipe = self.loop.run(fetch_recipe(self.node, timeout=30), timeout=60)
            self.key, self.initial_peers = peers_key(self.recipe.run_id), initial_peers
            self.sybil_keys = [sybil_key() for _ in range(sybils)]
            return
        if scenario == "uninvited":  # read the recipe without taking on the run's rules: we keep what we write
            self.recipe = self.loop.run(self.recipe_without_rules(), timeout=60)
            self.key = peers_key(self.recipe.run_id)
            return  # it needs no data, model or state server: it only writes and knocks
        self.recipe = r = self.loop.run(fetch_recipe(self.node, timeout=30), timeout=60)
        data = prepare_run_data(r.data.source, r.data.tokenizer, r.data.vocab_size, r.data.val_fraction,
                                r.data.seq_len, r.data.batch_size, r.data.seed, cache_dir)
        self.diloco = DiLoCo(build_model(r.model, data.vocab_size), r.outer)
        self.key = peers_key(r.run_id)
        self.server = DribblingServer(self.diloco) if scenario == "dribbling-holder" else StateServer(self.diloco)
        self.loop.run(self.node.add_stream_handler(protocol(r.run_id), self.server.handle), timeout=30)

    async def recipe_without_rules(self) -> Recipe:
        """Our --initial-peers' recipe; for a private run, `node.admission` with an invite we forged (signed by us
        in the owner's name), which our node then adds to every entry and presents on every stream."""
        while True:
            for subkey, value in (await self.node.get(RECIPE_KEY)).items():
                owned = subkey_owner_key(subkey)
                recipes, _ = parse_recipes({subkey: value})
                if owned is not None and owned[0] in self.node.initial_peer_ids and owned[0] in recipes:
                    run_id = recipes[owned[0]].run_id
                    self.node.admission = Admission(*owned, run_id)
                    forged = Invite.sign(self.node.identity, run_id, self.node.peer_id, 1.0)
                    self.node.admission.token = replace(forged, owner=owned[0]).token()
                    return recipes[owned[0]]
            await asyncio.sleep(0.5)

    async def intrude(self) -> None:
        """Announce ourselves as a training peer at the swarm's round, enter its next attempts' matchmaking, and
        open an all-reduce stream to every peer; say what became of each stream."""
        honest = await self.swarm()
        reference = view.reference(honest, self.node.now(), quorum=1)
        if not reference.holders:
            return
        await self.announce(reference.round, reference.digest)
        # A well-formed entry (every field, as an honest peer writes it): what refuses it is admission alone.
        a = self.recipe.averaging
        verified = combinations.reducers_verified(a.codec, a.aggregator, a.verify_reducers)
        entry = {"digest": reference.digest, "bandwidth": 1e9, "client": False, "excluded": [], "phase_timeout": None,
                 "weight": float(self.recipe.tokens_per_round), "commitment": "0" * 32 if verified else ""}
        for round_no in (reference.round, reference.round + 1):
            for attempt in range(3):
                await self.node.store(group_key(self.recipe.run_id, round_no, attempt), entry, ttl=60.0,
                                      subkey=self.node.owned_subkey)
        self.events.emit("attacking", scenario=self.scenario, round=reference.round, digest=reference.digest)
        for peer in honest:
            if peer.peer_id in self._streamed:
                continue
            self._streamed.add(peer.peer_id)
            try:
                reader, writer = await asyncio.wait_for(
                    self.node.open_stream(peer.peer_id, f"swarm.{self.recipe.run_id}.allreduce"), 10)
                try:
                    await send_frame(writer, msgpack.packb({"round": reference.round, "attempt": 0}))
                    await asyncio.wait_for(recv_frame(reader, 1 << 16), 10)
                    outcome = "answered"
                finally:
                    writer.close()
            except (asyncio.IncompleteReadError, ConnectionError):
                outcome = "closed"
            except Exception as e:  # noqa: BLE001 - whatever else, the test reads it
                outcome = f"failed: {e!r}"
            self.events.emit("stream", peer_id=peer.peer_id, outcome=outcome)

    async def write_sybils(self) -> None:
        """A record for each of our keys, from a plain hivemind node of ours: we keep them all, honest nodes what
        they accept. The records say `joining` (they claim no state) and carry 7 kB of an unknown field."""
        signer = SybilSigner(self.sybil_keys)
        self.sybil_node = await DHTNode.create(initial_peers=list(self.initial_peers),
                                               record_validator=CompositeValidator([signer]),
                                               host_maddrs=["/ip4/127.0.0.1/tcp/0"], use_ipfs=False,
                                               use_relay=False, use_auto_relay=False, auto_nat=False,
                                               nat_port_map=False)
        expiration, entries = get_dht_time() + 500, []
        for key in self.sybil_keys:
            public = key.get_public_key().to_bytes().decode()
            record = PeerRecord(peer_id=peer_id_of(public), state="joining", version=__version__,
                                run_id=self.recipe.run_id, round=0, tokens_in_round=0, block_start=0,
                                block_end=self.recipe.model.num_layers, updated=self.node.now())
            entries.append((owned_subkey(record.peer_id, public), {**record.to_wire(), "pad": "p" * 7000}))
        accepted = 0
        for start in range(0, len(entries), SYBIL_BATCH):
            batch = entries[start:start + SYBIL_BATCH]
            stored = await self.sybil_node.store_many([self.key] * len(batch), [v for _, v in batch],
                                                      [expiration] * len(batch), subkeys=[s for s, _ in batch])
            accepted += sum(bool(ok) for ok in stored.values())  # (stored by some node)
        self.events.emit("attacking", scenario=self.scenario, written=len(entries), accepted=accepted)

    async def wipe(self, deadline: float) -> None:
        """Plain values under the run's keys, from a hivemind node of ours that keeps anything."""
        plain = await DHTNode.create(initial_peers=list(self.initial_peers), host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                                     use_ipfs=False, use_relay=False, use_auto_relay=False, auto_nat=False,
                                     nat_port_map=False)
        try:
            while time.monotonic() < deadline:
                honest = await self.swarm()
                top = max((p.round for p in honest), default=0)
                keys = [self.key] + [group_key(self.recipe.run_id, r, a) for r in (top, top + 1) for a in range(4)]
                stored = await plain.store_many(keys, ["wiped"] * len(keys), [get_dht_time() + 3600] * len(keys))
                self.events.emit("attacking", scenario=self.scenario, round=top,
                                 stored=sum(bool(ok) for ok in stored.values()))
                await asyncio.sleep(1.0)
        finally:
            await plain.shutdown()

    async def knock(self, deadline: float) -> None:
        """Hold `streams` all-reduce streams to the honest peers (idle-streams), or keep feeding ones that claim a
        1 GiB chunk (oversized-frames); report how many are open and how many a peer closed."""
        protocol_name = f"swarm.{self.recipe.run_id}.allreduce"
        counts = {"open": 0, "closed": 0, "refused": 0, "fed_bytes": 0}

        async def hold(peer: str) -> None:
            while time.monotonic() < deadline:
                try:
                    reader, writer = await asyncio.wait_for(self.node.open_stream(peer, protocol_name), 10)
                except Exception:  # noqa: BLE001 - refused, or the peer is busy: try again
                    counts["refused"] += 1
                    await asyncio.sleep(1.0)
                    continue
                counts["open"] += 1
                try:
                    if self.scenario == "oversized-frames":
                        top = max((p.round for p in await self.swarm()), default=0)
                        header = {"group_id": "f" * 64, "round": top, "attempt": 0, "phase": "part",
                                  "weight": 1.0, "chunks": 1}
                        await send_frame(writer, msgpack.packb(header))
                        await send_frame(writer, msgpack.packb({}))
                        writer.write(FRAME_HEADER.pack(1 << 30))  # a payload frame of 1 GiB, it says
                        while time.monotonic() < deadline:
                            writer.write(bytes(1 << 16))
                            await writer.drain()
                            counts["fed_bytes"] += 1 << 16
                            await asyncio.sleep(0.05)
                    else:
                        await reader.read()  # until the peer closes it
                except Exception:  # noqa: BLE001 - the peer closed it
                    pass
                finally:
                    counts["open"] -= 1
                    counts["closed"] += 1
                    writer.close()
                await asyncio.sleep(0.5)

        honest = [p.peer_id for p in await self.swarm()]
        while not honest and time.monotonic() < deadline:
            await asyncio.sleep(1.0)
            honest = [p.peer_id for p in await self.swarm()]
        holders = [asyncio.ensure_future(hold(honest[i % len(honest)])) for i in range(self.streams)] if honest else []
        try:
            while time.monotonic() < deadline:
                self.events.emit("attacking", scenario=self.scenario, peers=len(honest), **counts)
                await asyncio.sleep(2.0)
        finally:
            for task in holders:
                task.cancel()
            await asyncio.gather(*holders, return_exceptions=True)

    async def future_record(self, deadline: float) -> None:
        """Every second, a record of ours at the swarm's top round (its majority digest), dated FUTURE_SECONDS
        ahead and claiming the round's tokens many times over: believed, it would stay live without a heartbeat
        (honest peers would wait for it in every matchmaking) and make every round due at once."""
        while time.monotonic() < deadline:
            honest = await self.swarm()
            top = max((p.round for p in honest), default=0)
            record = PeerRecord(peer_id=self.node.peer_id, state="training", version=__version__,
                                run_id=self.recipe.run_id, round=top, tokens_in_round=1 << 40, block_start=0,
                                block_end=self.recipe.model.num_layers,
                                digest=view.majority_digest([p for p in honest if p.round == top]),
                                tokens_per_s=1e12, updated=self.node.now() + FUTURE_SECONDS)
            stored = await self.node.store(self.key, record.to_wire(), ttl=600.0, subkey=self.node.owned_subkey)
            self.events.emit("attacking", scenario=self.scenario, round=top, tokens_in_round=record.tokens_in_round,
                             ahead_s=FUTURE_SECONDS, stored=bool(stored))
            await asyncio.sleep(1.0)

    async def flood(self, deadline: float) -> None:
        """Hold `connections` idle TCP connections to each honest peer's direct-stream port (from its hello, asked
        over libp2p as an opener would), from FLOOD_SOURCE; report how many are open, how many the peers cut."""
        counts = {"open": 0, "cut": 0, "failed": 0}
        routes: dict[str, tuple[str, int]] = {}

        async def hold(address: tuple[str, int]) -> None:
            while time.monotonic() < deadline:
                try:
                    reader, writer = await asyncio.wait_for(
                        asyncio.open_connection(*address, local_addr=(FLOOD_SOURCE, 0)), 3)
                except Exception:  # noqa: BLE001 - refused or unreachable: try again
                    counts["failed"] += 1
                    await asyncio.sleep(1.0)
                    continue
                counts["open"] += 1
                try:
                    await reader.read()  # nothing sent: until the peer cuts it
                except Exception:  # noqa: BLE001 - cut
                    pass
                finally:
                    counts["open"] -= 1
                    counts["cut"] += 1
                    writer.close()
                await asyncio.sleep(0.1)

        holders: list[asyncio.Future] = []
        try:
            while time.monotonic() < deadline:
                for peer in await self.swarm():
                    if peer.peer_id in routes:
                        continue
                    try:
                        hello, known = await asyncio.wait_for(self.node._ask_hello(peer.peer_id), 10)
                    except Exception as e:  # noqa: BLE001 - not up yet: ask again
                        logger.info("no hello from %s: %r", peer.peer_id[-8:], e)
                        continue
                    host = next((h for h in [*(hello.get("hosts") or []), *known] if h not in ("0.0.0.0", "::")),
                                None)
                    if not isinstance(hello.get("port"), int) or host is None:
                        continue
                    routes[peer.peer_id] = (host, hello["port"])
                    holders += [asyncio.ensure_future(hold(routes[peer.peer_id])) for _ in range(self.connections)]
                self.events.emit("attacking", scenario=self.scenario, peers=len(routes),
                                 ports=sorted(port for _, port in routes.values()), **counts)
                await asyncio.sleep(2.0)
        finally:
            for task in holders:
                task.cancel()
            await asyncio.gather(*holders, return_exceptions=True)

    async def swarm(self) -> list[PeerRecord]:
        records, _ = parse_peer_records(await self.node.get(self.key))
        return [p for p in records if p.peer_id != self.node.peer_id]

    async def announce(self, round_no: int, digest: str) -> None:
        record = PeerRecord(peer_id=self.node.peer_id, state="training", version=__version__,
                            run_id=self.recipe.run_id, round=round_no, tokens_in_round=0, block_start=0,
                            block_end=self.recipe.model.num_layers, digest=digest, tokens_per_s=1000.0,
                            updated=self.node.now())
        await self.node.store(self.key, record.to_wire(), ttl=45.0, subkey=self.node.owned_subkey)

    async def header_of(self, holder: str) -> dict:
        reader, writer = await self.node.open_stream(holder, protocol(self.recipe.run_id))
        try:
            await send_frame(writer, msgpack.packb({"offset": 0, "length": 0}))
            return msgpack.unpackb(await recv_frame(reader, 1 << 16))
        finally:
            writer.close()

    def become(self, tensors: dict[str, torch.Tensor], round_no: int) -> str:
        self.diloco.load_state_tensors(tensors, round_no, 0)
        return self.diloco.digest()

    async def run(self, seconds: float) -> None:
        deadline, forged_round, digest = time.monotonic() + seconds, -1, ""
        if self.scenario == "sybils":
            await self.write_sybils()
            await asyncio.sleep(max(deadline - time.monotonic(), 0))  # our node serves what it keeps meanwhile
            await self.sybil_node.shutdown()
            return
        if self.scenario == "wipe":
            return await self.wipe(deadline)
        if self.scenario in KNOCKING:
            return await self.knock(deadline)
        if self.scenario == "future-record":
            return await self.future_record(deadline)
        if self.scenario == "handshake-flood":
            return await self.flood(deadline)
        while time.monotonic() < deadline:
            if self.scenario == "uninvited":
                await self.intrude()
                await asyncio.sleep(1.0)
                continue
            reference = view.reference(await self.swarm(), self.node.now(), quorum=self.vouchers)
            if reference.holders and self.scenario == "forged-reference" and reference.round + 1 != forged_round:
                # A state of our making one round ahead of the swarm's: random params (drawn from the swarm's digest,
                # so that colluding attackers forge the same one), no momentum.
                forged_round = reference.round + 1
                draw = torch.Generator().manual_seed(int(reference.digest, 16) % (1 << 63))
                tensors = {k: torch.randn(v.shape, generator=draw) for k, v in sorted(self.diloco.state_tensors().items())
                           if k.startswith("params.")}
                digest = self.become(tensors, forged_round)
            elif reference.holders and self.scenario == "dribbling-holder" and reference.digest != digest:
                # Claim the swarm's own state with an honest holder's header: joiners count us among its holders
                # and ask us for ranges, which never come.
                try:
                    self.server.header = await self.header_of(reference.holders[0])
                    digest, forged_round = reference.digest, reference.round
                except Exception as e:  # noqa: BLE001 - try another time
                    logger.info("could not copy a header: %r", e)
            if digest:
                await self.announce(forged_round, digest)
                self.events.emit("attacking", scenario=self.scenario, round=forged_round, digest=digest)
            await asyncio.sleep(1.0)

    def close(self) -> None:
        self.node.shutdown()
        self.loop.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--initial-peers", nargs="+", required=True)
    parser.add_argument("--scenario", choices=SCENARIOS, required=True)
    parser.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "swarm"))
    parser.add_argument("--events-file")
    parser.add_argument("--seconds", type=float, default=120.0, help="stop attacking after this long")
    parser.add_argument("--sybils", type=int, default=1000, help="keys (and records) of the sybils scenario")
    parser.add_argument("--streams", type=int, default=500, help="streams of the idle-streams and oversized-frames "
                                                                 "scenarios, spread over the honest peers")
    parser.add_argument("--connections", type=int, default=64, help="handshake-flood: idle connections held to "
                                                                    "each honest peer's direct-stream port")
    parser.add_argument("--vouchers", type=int, default=2, help="forged-reference and dribbling-holder: lie about "
                                                                "the state at least this many peers announce")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s attacker: %(message)s", stream=sys.stdout)
    torch.set_num_threads(1)
    events = EventLog(args.events_file)
    attacker = Attacker(args.initial_peers, args.scenario, args.cache_dir, events, args.sybils, args.streams,
                        args.vouchers, args.connections)
    logger.info("attacking as %s: %s", attacker.node.peer_id, args.scenario)
    events.emit("ready", peer_id=attacker.node.peer_id, scenario=args.scenario)
    try:
        attacker.loop.run(attacker.run(args.seconds))
    finally:
        attacker.close()
        events.emit("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
