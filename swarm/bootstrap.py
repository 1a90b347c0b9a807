"""`swarm-peer bootstrap`: a long-lived DHT entry point that publishes the run recipe and exports the swarm's
metrics as it sees them in the DHT."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import threading

from prometheus_client import CollectorRegistry, start_http_server

from swarm.config import Recipe, load_recipe
from swarm.dht.node import NetworkOptions, NodeError, SwarmNode
from swarm.monitoring.swarm_view import SwarmExporter, read_swarm
from swarm.peer.announcer import publish_recipe
from swarm.runtime import LoopThread

logger = logging.getLogger("swarm.bootstrap")
RECIPE_TTL = 600.0
REPUBLISH_SECONDS = 60.0
VIEW_SECONDS = 5.0


def run_bootstrap(args: argparse.Namespace) -> int:
    recipe = load_recipe(args.recipe) if args.recipe else Recipe()
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    loop = LoopThread()
    try:
        node = SwarmNode([], NetworkOptions(host_maddrs=tuple(args.host_maddrs),
                                            announce_maddrs=tuple(args.announce_maddrs),
                                            identity_path=args.identity_path, nat_traversal=args.nat_traversal))
    except NodeError as e:
        logger.error("%s", e)
        loop.close()
        return 1
    try:
        loop.run(publish_recipe(node, recipe, RECIPE_TTL), timeout=30)
        registry = CollectorRegistry()
        exporter = SwarmExporter(registry)
        if args.metrics_port is not None:
            server, _ = start_http_server(args.metrics_port, addr=args.metrics_host, registry=registry)
            logger.info("metrics at http://%s:%d/metrics", args.metrics_host, server.server_address[1])
        maddrs = node.visible_maddrs()
        logger.info("bootstrap of run %s (recipe %s) is up as %s", recipe.run_id, recipe.digest()[:12],
                    node.peer_id)
        print("Peers join this swarm with:", flush=True)
        for maddr in maddrs:
            print(f"  swarm-peer join --initial-peers {maddr}", flush=True)
        loop.submit(_maintain(node, recipe, exporter))
        stop.wait()
        logger.info("stopping")
        return 0
    finally:
        node.shutdown()
        loop.close()


async def _maintain(node: SwarmNode, recipe: Recipe, exporter: SwarmExporter) -> None:
    since_publish = 0.0
    while True:
        try:
            if since_publish >= REPUBLISH_SECONDS:
                await publish_recipe(node, recipe, RECIPE_TTL)
                since_publish = 0.0
            exporter.update(await read_swarm(node, recipe.run_id))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a transient DHT error must not stop the bootstrap
            logger.warning("could not refresh the swarm view: %s", e)
        await asyncio.sleep(VIEW_SECONDS)
        since_publish += VIEW_SECONDS
