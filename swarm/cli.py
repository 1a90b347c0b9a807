"""`swarm-peer`: join a swarm, host its bootstrap node, print its status, or run a local demo swarm."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Optional, Sequence

from swarm import __version__

logger = logging.getLogger("swarm")
DEFAULT_HOST = "/ip4/127.0.0.1/tcp/0"


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S",
                        stream=sys.stdout, force=True)
    for noisy in ("hivemind", "asyncio", "httpx", "transformers", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING if not verbose else logging.INFO)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _network_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("network")
    group.add_argument("--host-maddrs", nargs="+", default=[DEFAULT_HOST], metavar="MADDR",
                       help=f"multiaddrs to listen on (default {DEFAULT_HOST}: loopback only; use "
                            "/ip4/0.0.0.0/tcp/PORT to accept peers from other machines)")
    group.add_argument("--announce-maddrs", nargs="+", default=[], metavar="MADDR",
                       help="public multiaddrs to announce instead of the listening ones (e.g. behind port "
                            "forwarding)")
    group.add_argument("--identity-path", metavar="FILE",
                       help="private key file: keeps the same peer id (and multiaddr) across restarts; created if "
                            "missing")
    group.add_argument("--nat-traversal", action="store_true",
                       help="enable UPnP port mapping, AutoNAT and circuit relays (off by default; local swarms and "
                            "tests do not need them)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="swarm-peer",
        description="Train one language model together with volunteers' machines (DiLoCo over a P2P swarm).")
    parser.add_argument("--version", action="version", version=f"swarm-peer {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging, including hivemind's")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    boot = sub.add_parser("bootstrap", help="host a stable DHT entry point that publishes the run recipe",
                          description="Start a DHT node that publishes the run recipe and prints the "
                                      "--initial-peers value other peers pass to `swarm-peer join`.")
    _network_args(boot)
    boot.add_argument("--recipe", metavar="FILE",
                      help="run recipe (.yaml/.json); default: the embedded demo run (small Llama on the bundled "
                           "Shakespeare corpus)")
    boot.add_argument("--metrics-port", type=int, metavar="N",
                      help="serve swarm-wide Prometheus metrics on this port (0 picks a free port)")
    boot.add_argument("--metrics-host", default="127.0.0.1", metavar="ADDR",
                      help="address the metrics server binds to (default 127.0.0.1; 0.0.0.0 for remote scraping)")

    join = sub.add_parser("join", help="join a swarm and train",
                          description="Join the swarm behind --initial-peers, fetch its recipe, sync the model "
                                      "and train with DiLoCo until stopped (Ctrl-C stops cleanly).")
    join.add_argument("--initial-peers", nargs="+", required=True, metavar="MADDR",
                      help="multiaddr(s) printed by `swarm-peer bootstrap` (/ip4/.../tcp/.../p2p/<id>)")
    _network_args(join)
    join.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                      help="where to train: auto uses CUDA with bf16 autocast when available (default auto)")
    join.add_argument("--num-threads", type=int, metavar="N",
                      help="torch CPU threads (default: all cores; set it when several peers share a machine)")
    join.add_argument("--metrics-port", type=int, metavar="N",
                      help="serve this peer's Prometheus metrics on this port (0 picks a free port)")
    join.add_argument("--metrics-host", default="127.0.0.1", metavar="ADDR",
                      help="address the metrics server binds to (default 127.0.0.1)")
    join.add_argument("--checkpoint-dir", metavar="DIR",
                      help="write checkpoints here and resume from the newest one on restart")
    join.add_argument("--keep-checkpoints", type=int, default=3, metavar="N",
                      help="how many recent checkpoints to keep (default 3)")
    join.add_argument("--checkpoint-series", type=int, default=100, metavar="N",
                      help="also keep a series of intermediate checkpoints, as Pythia publishes them: rounds 1, 2, "
                           "4, 8, ... and every N-th round (default 100; 0 keeps only the recent ones)")
    join.add_argument("--replay-log-mb", type=float, metavar="MB",
                      help="memory for the latest outer steps, which peers a few rounds behind replay instead of "
                           "downloading the state (default: one state's size, 8 bytes a param; 0 keeps none)")
    join.add_argument("--max-rounds", type=int, metavar="N", help="stop after averaging this many outer rounds")
    join.add_argument("--until-round", type=int, metavar="N",
                      help="stop once the global round reaches N (all peers of a swarm stop at the same round)")
    join.add_argument("--recipe", metavar="FILE",
                      help="refuse to start unless the swarm's recipe equals this file's (names the differences)")
    join.add_argument("--cache-dir", metavar="DIR",
                      help="tokenizer and tokenized-corpus cache (default ~/.cache/swarm)")
    join.add_argument("--data-shard", type=int, metavar="K",
                      help="start the data stream at shard K (default: where no live peer reads)")
    join.add_argument("--trace-dir", metavar="DIR",
                      help="write every round's pseudo-gradient, average and global params as safetensors, to "
                           "audit the averaging")
    join.add_argument("--client-mode", action="store_true",
                      help="for peers that cannot accept inbound connections (behind NAT, no port forwarding): open "
                           "every stream yourself; the peer still contributes to every average but reduces no part "
                           "of it, serves no state and answers no DHT requests")
    join.add_argument("--direct-port", type=int, default=0, metavar="PORT",
                      help="TCP port for direct streams, the all-reduce's and state download's bytes over TLS "
                           "between peers instead of through the libp2p daemons (default: any free port; fix it to "
                           "forward it through a NAT or open it in a firewall)")
    join.add_argument("--no-direct-streams", action="store_true",
                      help="send every stream through libp2p (slower; for networks where only the libp2p port is "
                           "reachable and a failed direct attempt per peer every 30 s costs too much)")
    join.add_argument("--inject-fault", metavar="PHASE@ROUND",
                      help="for tests and drills: SIGKILL this peer at a phase (matchmaking, send, reduce, commit; "
                           "ring: while sending along a ring) of the first round >= ROUND it averages in, send bad "
                           "data (garbage, nan, short; ring-garbage: garbage along rings only) from that round on, "
                           "or break its own training once (diverge: NaN params; explode: an absurd pseudo-gradient)")

    status = sub.add_parser("status", help="print the swarm's peers and totals",
                            description="Read the swarm's announcements from the DHT and print each peer (state, "
                                        "blocks, device, tokens/s, bandwidth, round, loss, last seen) and the "
                                        "totals: peers, compute, peers per block, blocks hosted by nobody, "
                                        "whether training peers agree on the state digest.")
    status.add_argument("--initial-peers", nargs="+", required=True, metavar="MADDR",
                        help="multiaddr(s) of any peer of the swarm")
    status.add_argument("--json", action="store_true", help="print JSON for scripts")

    demo = sub.add_parser("demo", help="run a bootstrap and N peers on this machine",
                          description="Start a bootstrap and N peers on 127.0.0.1 that train the embedded demo "
                                      "run together, print their progress, and stop after R rounds.")
    demo.add_argument("--peers", type=int, default=2, metavar="N", help="number of peers (default 2)")
    demo.add_argument("--rounds", type=int, default=3, metavar="R", help="outer rounds to train (default 3)")
    demo.add_argument("--recipe", metavar="FILE", help="run recipe (default: the embedded demo run)")
    demo.add_argument("--workdir", metavar="DIR",
                      help="checkpoints and logs of the demo peers (default: a new temporary directory)")
    demo.add_argument("--metrics-port", type=int, default=0, metavar="N",
                      help="first metrics port: bootstrap N, peers N+1.. (default 0: free ports)")
    return parser


def _positive(name: str, value: Optional[int]) -> None:
    if value is not None and value <= 0:
        raise SystemExit(f"swarm-peer: error: {name} must be a positive integer, got {value}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    _setup_logging(args.verbose)
    from swarm.config import RecipeError

    try:
        if args.command == "bootstrap":
            from swarm.bootstrap import run_bootstrap

            return run_bootstrap(args)
        if args.command == "join":
            return _join(args)
        if args.command == "status":
            return _status(args)
        if args.command == "demo":
            from swarm.demo import run_demo

            _positive("--peers", args.peers)
            _positive("--rounds", args.rounds)
            return run_demo(args)
    except RecipeError as e:
        logger.error("%s", e)
        return 2
    except KeyboardInterrupt:
        logger.info("interrupted")
        return 130
    return 2


def _join(args: argparse.Namespace) -> int:
    import pydantic

    from swarm.config import PeerSettings
    from swarm.dht.node import NodeError
    from swarm.peer.data import CorpusError
    from swarm.peer.peer import Peer

    _positive("--max-rounds", args.max_rounds)
    _positive("--until-round", args.until_round)
    _positive("--num-threads", args.num_threads)
    try:
        settings = PeerSettings(
            initial_peers=tuple(args.initial_peers), device=args.device, num_threads=args.num_threads,
            metrics_port=args.metrics_port, metrics_host=args.metrics_host, checkpoint_dir=args.checkpoint_dir,
            keep_checkpoints=args.keep_checkpoints, checkpoint_series=args.checkpoint_series,
            replay_log_mb=args.replay_log_mb,
            max_rounds=args.max_rounds,
            until_round=args.until_round, recipe_file=args.recipe,
            data_shard=args.data_shard, trace_dir=args.trace_dir, host_maddrs=tuple(args.host_maddrs),
            announce_maddrs=tuple(args.announce_maddrs), identity_path=args.identity_path,
            nat_traversal=args.nat_traversal, client_mode=args.client_mode, inject_fault=args.inject_fault,
            direct_streams=not args.no_direct_streams, direct_port=args.direct_port,
            **({"cache_dir": args.cache_dir} if args.cache_dir else {}))
    except pydantic.ValidationError as e:
        err = e.errors()[0]
        logger.error("bad flag --%s: %s", str(err["loc"][0]).replace("_", "-"), err["msg"])
        return 2
    try:
        peer = Peer(settings)
    except ValueError as e:
        logger.error("%s", e)
        return 2
    peer.install_signal_handlers()
    try:
        peer.start()
        rounds = peer.run()
        logger.info("done: %d rounds averaged, round %d, digest %s", rounds, peer.diloco.round,
                    peer.diloco.digest())
        return 0
    except (NodeError, CorpusError, RuntimeError) as e:
        logger.error("%s", e)
        return 1
    finally:
        peer.shutdown()


def _status(args: argparse.Namespace) -> int:
    from swarm.dht.node import NetworkOptions, NodeError, SwarmNode
    from swarm.dht.recipes import fetch_recipe
    from swarm.monitoring.swarm_status import read_swarm, recipe_blocks, render_status
    from swarm.runtime import LoopThread

    if args.json:  # scripts parse stdout: keep log lines off it
        for handler in logging.getLogger().handlers:
            if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
                handler.setStream(sys.stderr)
    loop = LoopThread()
    node = None
    try:
        # A client-mode node on loopback only reads: it never stores others' records or accepts connections.
        node = SwarmNode(args.initial_peers, NetworkOptions(client_mode=True, direct_streams=False))
        recipe = loop.run(fetch_recipe(node, timeout=15), timeout=30)
        summary = loop.run(read_swarm(node, recipe.run_id, recipe_blocks(recipe)), timeout=30)
    except (NodeError, TimeoutError) as e:
        logger.error("%s", e)
        return 1
    finally:
        if node is not None:
            node.shutdown()
        loop.close()
    if args.json:
        print(json.dumps({"run_id": recipe.run_id, "recipe_digest": recipe.digest(), **summary.to_json()},
                         indent=1))
    else:
        print(render_status(summary, recipe.run_id, recipe.digest()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
