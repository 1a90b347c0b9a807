"""What a stranger can make a node spend through its transport, with real nodes (a DHT process and p2pd each):
hundreds of idle all-reduce streams opened to a peer that keeps averaging, and p2pd's circuit relay service, which
is off unless `--relay-service` asks for it."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import torch

from swarm.averaging.allreduce import MAX_STREAMS_PER_PEER, GroupAllReduce
from swarm.averaging.deadlines import AdaptiveDeadlines
from swarm.averaging.matchmaking import Group
from swarm.cli import build_parser
from swarm.config import BootstrapSettings, NetworkSettings
from swarm.dht import node as dht_node
from swarm.dht.node import NetworkOptions, SwarmNode
from swarm.dht.process import daemon_with_relay_service
from swarm.settings_cli import settings_from_args

IDLE_STREAMS = 200
NUMEL = 1 << 20


def _rss_bytes() -> int:
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return int(fields["VmRSS"].split()[0]) * 1024


def _p2pd_args(node: SwarmNode) -> list[str]:
    """The command line of the p2pd that `node`'s DHT process started."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            args = (stat.parent / "cmdline").read_bytes().decode().split("\0")
        except (OSError, IndexError, ValueError):
            continue  # it exited meanwhile
        if parent == node.dht.pid and args[0].endswith("p2pd"):
            return args
    raise AssertionError(f"no p2pd child of the DHT process {node.dht.pid}")


def test_relay_service_follows_the_flag_and_relays_stay_on_for_it():
    assert NetworkSettings().relay_service is False
    boot = settings_from_args(BootstrapSettings, build_parser().parse_args(["bootstrap", "--relay-service"]))
    assert NetworkOptions(**boot.network.model_dump()).relay_service is True
    traversal = NetworkOptions(nat_traversal=True).hivemind_kwargs()
    assert traversal["use_relay"] and traversal["relay_service"] is False, "relays to reach others, serving none"
    serving = NetworkOptions(relay_service=True).hivemind_kwargs()
    assert serving["use_relay"] and serving["relay_service"] is True, "a relay service needs relays on"
    args = daemon_with_relay_service(False)._make_process_args("p2pd", relay=True)
    assert args[0] == "p2pd" and sorted(args[1:]) == ["-relay=1", "-relayService=0"]


def test_p2pd_serves_as_a_relay_only_with_relay_service():
    """p2pd's own default is to relay for anyone whenever relays are on (-relay=1 -relayService absent)."""
    for options, service in ((NetworkOptions(nat_traversal=True), "0"), (NetworkOptions(relay_service=True), "1")):
        node = SwarmNode([], options)
        try:
            args = _p2pd_args(node)
            assert "-relay=1" in args and f"-relayService={service}" in args, args
        finally:
            node.shutdown()


def test_idle_streams_from_one_peer_are_closed_and_do_not_stop_the_round():
    """An attacker opens IDLE_STREAMS all-reduce streams to a peer and sends nothing; the peer closes all but
    MAX_STREAMS_PER_PEER at once and those at the header deadline, while it averages with an honest peer."""

    async def scenario():
        honest = SwarmNode([], NetworkOptions())
        others = [SwarmNode(honest.visible_maddrs(), NetworkOptions()) for _ in range(2)]
        partner, attacker = others
        try:
            servers = [GroupAllReduce(node, "t", "none", NUMEL, AdaptiveDeadlines(5.0, 30.0))
                       for node in (honest, partner)]
            for server in servers:
                await server.start()
            servers[0].header_timeout = 2.0
            vectors = [torch.randn(NUMEL, generator=torch.Generator().manual_seed(i)) for i in range(2)]
            await asyncio.gather(*(s.run(Group.of(0, 0, sorted([honest.peer_id, partner.peer_id]), [0.5, 0.5]), v,
                                         1.0) for s, v in zip(servers, vectors)))  # warm: connections, buffers
            rss_before = _rss_bytes()

            opened_at = time.monotonic()
            idle = [await attacker.open_stream(honest.peer_id, servers[0].protocol) for _ in range(IDLE_STREAMS)]

            async def closed(reader: asyncio.StreamReader) -> float:
                try:
                    await reader.read()  # EOF: the peer closed it (it never answers an idle stream)
                except OSError:  # (a TLS stream may end in an SSL error rather than EOF)
                    pass
                return time.monotonic() - opened_at

            closing = asyncio.ensure_future(asyncio.gather(*(closed(reader) for reader, _ in idle)))
            for round_no in range(1, 4):  # the attack lasts longer than these rounds: they go on regardless
                group = Group.of(round_no, 0, sorted([honest.peer_id, partner.peer_id]), [0.5, 0.5])
                results = await asyncio.wait_for(asyncio.gather(*(s.run(group, v, 1.0)
                                                                  for s, v in zip(servers, vectors))), 20)
                assert torch.equal(results[0].average, results[1].average)
            seconds = await asyncio.wait_for(closing, 15)
            assert max(seconds) < servers[0].header_timeout + 8, f"idle streams lasted up to {max(seconds):.1f} s"
            refused = servers[0].refused
            # Those past the server's cap are refused unread (a few may meet the node's own cap first); the others
            # are dropped at their header deadline.
            assert refused["busy"] >= IDLE_STREAMS - dht_node.MAX_STREAMS_PER_PEER - MAX_STREAMS_PER_PEER, refused
            assert 1 <= refused["slow"] <= MAX_STREAMS_PER_PEER, refused
            assert _rss_bytes() - rss_before < 64 << 20, "the attack must not grow the peer's memory"
            for _, writer in idle:
                writer.close()

            # Any protocol's handler: streams past the node's per-peer cap are closed at once, the others served.
            async def hold(remote, reader, writer):
                await reader.read()

            await honest.add_stream_handler("swarm.t.hold", hold)
            held = [await attacker.open_stream(honest.peer_id, "swarm.t.hold")
                    for _ in range(dht_node.MAX_STREAMS_PER_PEER + 6)]
            ended = await asyncio.gather(*(asyncio.wait_for(reader.read(), 2) for reader, _ in held),
                                         return_exceptions=True)
            closed = [not isinstance(result, asyncio.TimeoutError) for result in ended]
            assert sum(closed) == 6, "only the streams over the cap are closed"
            for _, writer in held:
                writer.close()
        finally:
            for node in (attacker, partner, honest):
                node.shutdown()

    asyncio.run(scenario())
