"""What a stranger can make a node spend through its transport, with real nodes (a DHT process and p2pd each):
hundreds of idle all-reduce streams opened to a peer that keeps averaging, and p2pd's circuit relay service, which
is off unless `--relay-service` asks for it."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from swarm.averaging.allreduce import MAX_STREAMS_PER_PEER, GroupAllReduce
from swarm.averaging.deadlines import AdaptiveDeadlines
from swarm.averaging.matchmaking import Group
from swarm.cli import build_parser
from swarm.settings import BootstrapSettings, NetworkSettings
from swarm.dht import node as dht_node
from swarm.dht.node import NetworkOptions, SwarmNode
from swarm.dht.node_server import daemon_with_relay_service
from swarm.settings_cli import settings_from_args

ROOT = Path(__file__).resolve().parent.parent
HOLD_PROTOCOL = "swarm.t.hold"
IDLE_STREAMS = 200
NUMEL = 1 << 18
ROUNDS = 3  # rounds averaged before the attack (the honest pair then averages until the attacker is done)


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


@pytest.mark.slow  # starts two real nodes (the quick subset runs none)
def test_p2pd_serves_as_a_relay_only_with_relay_service():
    """p2pd's own default is to relay for anyone whenever relays are on (-relay=1 -relayService absent)."""
    for options, service in ((NetworkOptions(nat_traversal=True), "0"), (NetworkOptions(relay_service=True), "1")):
        node = SwarmNode([], options)
        try:
            args = _p2pd_args(node)
            assert "-relay=1" in args and f"-relayService={service}" in args, args
        finally:
            node.shutdown()


@pytest.mark.slow  # an attacker process and two averaging nodes: about a minute on 2 cores
def test_idle_streams_from_one_peer_are_closed_and_do_not_stop_the_round():
    """An attacker process opens IDLE_STREAMS all-reduce streams to a peer and sends nothing; the peer closes those
    over MAX_STREAMS_PER_PEER at once and the others at the header deadline, while it averages with an honest peer,
    and its memory stays flat. Then the same against any protocol's handler, at the node's cap."""

    async def scenario():
        honest = SwarmNode([], NetworkOptions())
        partner = SwarmNode(honest.visible_maddrs(), NetworkOptions())
        attacker = None
        try:
            servers = [GroupAllReduce(node, "t", "none", NUMEL, AdaptiveDeadlines(5.0, 30.0))
                       for node in (honest, partner)]
            for server in servers:
                await server.start()
            servers[0].header_timeout = 2.0
            await honest.add_stream_handler(HOLD_PROTOCOL, _hold)
            vectors = [torch.randn(NUMEL, generator=torch.Generator().manual_seed(i)) for i in range(2)]

            async def average(round_no: int) -> None:
                group = Group.of(round_no, 0, sorted([honest.peer_id, partner.peer_id]), [0.5, 0.5])
                results = await asyncio.wait_for(asyncio.gather(*(s.run(group, v, 1.0)
                                                                  for s, v in zip(servers, vectors))), 20)
                assert torch.equal(results[0].average, results[1].average)

            for round_no in range(ROUNDS):  # without the attack: connections, buffers and the allocator settle
                await average(round_no)
            rss_before = _rss_bytes()
            attacker = subprocess.Popen([sys.executable, __file__, honest.visible_maddrs()[0], servers[0].protocol],
                                        stdout=subprocess.PIPE, text=True, env=_env())
            lines = asyncio.ensure_future(asyncio.to_thread(attacker.communicate, timeout=60))
            round_no = ROUNDS
            while not lines.done():  # the honest pair averages all along the attack
                await average(round_no)
                round_no += 1
                await asyncio.sleep(0.5)  # (as peers train between rounds: the attacker's process needs the CPU too)
            report = json.loads((await lines)[0].splitlines()[-1])
            assert round_no > ROUNDS and report["opened"] == IDLE_STREAMS, report
            assert max(report["open_for"]) < servers[0].header_timeout + 5, report["open_for"]
            refused = servers[0].refused
            # Those over the server's cap are refused unread (a few may meet the node's own cap first); the others
            # are dropped at their header deadline, freeing their places for later ones while the attacker opens.
            assert refused["busy"] >= 1 and refused["slow"] >= MAX_STREAMS_PER_PEER, refused
            assert IDLE_STREAMS - dht_node.MAX_STREAMS_PER_PEER <= refused["busy"] + refused["slow"] <= IDLE_STREAMS
            assert report["held_closed"] == 6, "only the streams over the node's cap are closed, at once"
            grown = _rss_bytes() - rss_before
            assert grown < 32 << 20, f"the peers grew by {grown / 2**20:.0f} MiB under the attack"
        finally:
            if attacker is not None and attacker.poll() is None:
                attacker.kill()
            for node in (partner, honest):
                node.shutdown()

    asyncio.run(scenario())


async def _hold(remote, reader, writer) -> None:
    await reader.read()


def _env() -> dict:
    """Ours, with this checkout first on the path: the attacker runs the same code."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


async def _attack(maddr: str, protocol: str) -> None:
    """The attacker process: IDLE_STREAMS idle streams of `protocol` to the peer at `maddr`, each open until the
    peer closes it; then the node's cap plus 6 streams of HOLD_PROTOCOL, which the peer holds open. Prints one JSON
    line: how many were opened, how long each stayed open (s), and how many held streams the peer closed."""
    node = SwarmNode([maddr], NetworkOptions())
    victim = node.initial_peer_ids[0]
    try:
        async def open_for(reader: asyncio.StreamReader, since: float) -> float:
            try:
                await reader.read()  # EOF: the peer closed it (it never answers an idle stream)
            except OSError:  # (a TLS stream may end in an SSL error rather than EOF)
                pass
            return time.monotonic() - since

        idle, waits = [], []  # (the writers are kept: a writer collected as garbage closes its stream)
        for _ in range(IDLE_STREAMS):
            idle.append(await node.open_stream(victim, protocol))
            waits.append(asyncio.ensure_future(open_for(idle[-1][0], time.monotonic())))
        seconds = await asyncio.wait_for(asyncio.gather(*waits), 30)
        held = [await node.open_stream(victim, HOLD_PROTOCOL) for _ in range(dht_node.MAX_STREAMS_PER_PEER + 6)]
        ended = await asyncio.gather(*(asyncio.wait_for(reader.read(), 2) for reader, _ in held),
                                     return_exceptions=True)
        held_closed = sum(not isinstance(result, asyncio.TimeoutError) for result in ended)
        print(json.dumps({"opened": len(seconds), "open_for": seconds, "held_closed": held_closed}), flush=True)
    finally:
        node.shutdown()


if __name__ == "__main__":
    asyncio.run(_attack(*sys.argv[1:]))
