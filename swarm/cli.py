"""`swarm-peer`: join a swarm, host its bootstrap node, print its status, or run a local demo swarm."""

from __future__ import annotations

import argparse
import concurrent.futures
import faulthandler
import json
import logging
import os
import signal
import sys
from typing import Optional, Sequence

from swarm import __version__
from swarm.config import RecipeError
from swarm.dht.process import import_hivemind_without_torch
from swarm.settings import BootstrapSettings, PeerSettings
from swarm.settings_cli import FlagError, add_flags, settings_from_args
from swarm.words import counted

logger = logging.getLogger("swarm")


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S",
                        stream=sys.stdout, force=True)
    for noisy in ("hivemind", "asyncio", "httpx", "transformers", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING if not verbose else logging.INFO)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # `kill -USR1 PID` prints where every thread of a running peer or bootstrap is, on stderr, and it goes on: what
    # to look at when one seems stuck (the test harness does it to a peer that a wait timed out on). The process's
    # own stderr: a caller that replaced sys.stderr (main() called in-process, under pytest's capsys) has no fd.
    try:
        faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)
    except (AttributeError, ValueError, OSError):  # no stderr at all (io.UnsupportedOperation is an OSError)
        pass


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
    # A bootstrap serves no bulk streams and must accept inbound connections: those network flags are the peers'.
    add_flags(boot, BootstrapSettings,
              exclude=("network.client_mode", "network.direct_streams", "network.direct_port"))

    join = sub.add_parser("join", help="join a swarm and train",
                          description="Join the swarm behind --initial-peers, fetch its recipe, sync the model "
                                      "and train with DiLoCo until stopped (Ctrl-C stops cleanly).")
    add_flags(join, PeerSettings)

    doctor = sub.add_parser("doctor", help="check what joining needs and say what to fix",
                            description="Check, one line each with the cause and the fix: the bootstrap (name "
                                        "resolution, TCP, libp2p handshake, version, run), whether the swarm can "
                                        "dial this peer's addresses back, the clock, the identity, ports, disk and "
                                        "memory. Exits 1 if there is a problem. Give the flags you give join.")
    add_flags(doctor, PeerSettings)  # every join flag: the same command line checks (those it has no check for
    # change nothing: how long it trains, what it traces, where its data stream starts)
    doctor.add_argument("--json", action="store_true", help="print one JSON document for scripts")

    status = sub.add_parser("status", help="print the swarm's peers and totals",
                            description="Read the swarm's announcements from the DHT and print each peer (state, "
                                        "blocks, device, tokens/s, bandwidth, round, loss, last seen) and the "
                                        "totals: peers, compute, peers per block, blocks hosted by nobody, "
                                        "whether training peers agree on the state digest.")
    status.add_argument("--initial-peers", nargs="+", required=True, metavar="MADDR",
                        help="multiaddr(s) of any peer of the swarm")
    status.add_argument("--json", action="store_true", help="print JSON for scripts")

    invite = sub.add_parser("invite", help="sign an invite to your private run for one peer",
                            description="Print a one-line token that admits PEER_ID to private run --run-id of the "
                                        "bootstrap whose key is --identity-path; the peer joins with --invite TOKEN.")
    invite.add_argument("peer_id", metavar="PEER_ID", help="the peer's id (it prints it with `swarm-peer id`)")
    _owner_flags(invite)
    invite.add_argument("--days", type=float, default=30.0, metavar="N",
                        help="days until the invite expires (default 30)")

    revoke = sub.add_parser("revoke", help="take back the invites of peers to your private run",
                            description="Add PEER_IDs to the revocation list of private run --run-id, signed with "
                                        "--identity-path and kept beside it (FILE.RUN.revoked): the bootstrap running "
                                        "with that key publishes it within 5 s, and every node of the run refuses "
                                        "those peers' entries and streams within 30 s more. An invite signed later "
                                        "admits a peer again.")
    revoke.add_argument("peer_ids", nargs="+", metavar="PEER_ID", help="the peers whose invites to take back")
    _owner_flags(revoke)

    ident = sub.add_parser("id", help="print the peer id of an identity key",
                           description="Print the peer id of the key in --identity-path (created if missing): the "
                                       "id a private run's owner invites. Join with the same --identity-path.")
    ident.add_argument("--identity-path", "--identity", required=True, metavar="FILE",
                       help="private key file (the one you pass to join)")

    demo = sub.add_parser("demo", help="run a bootstrap and N peers on this machine",
                          description="Start a bootstrap and N peers on 127.0.0.1 that train the embedded demo "
                                      "run together, print their progress, and stop after R rounds.")
    demo.add_argument("--peers", type=int, metavar="N", help="number of peers (default 2, or 2 per stage)")
    demo.add_argument("--stages", type=int, default=1, metavar="S",
                      help="cut the model into S pipeline stages, peer i hosting stage i mod S (default 1: every "
                           "peer trains the whole model)")
    demo.add_argument("--rounds", type=int, default=3, metavar="R", help="outer rounds to train (default 3)")
    demo.add_argument("--recipe", metavar="FILE", help="run recipe (default: the embedded demo run)")
    demo.add_argument("--workdir", metavar="DIR",
                      help="checkpoints and logs of the demo peers (default: a new temporary directory)")
    demo.add_argument("--metrics-port", type=int, default=0, metavar="N",
                      help="first metrics port: bootstrap N, peers N+1.. (default 0: free ports)")
    return parser


def _owner_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--identity-path", "--identity", required=True, metavar="FILE",
                        help="the run owner's key: the file the bootstrap runs with as --identity-path")
    parser.add_argument("--run-id", required=True, metavar="RUN",
                        help="the private run: its recipe's run_id, which the bootstrap prints")


def _positive(name: str, value: Optional[int]) -> None:
    if value is not None and value <= 0:
        raise SystemExit(f"swarm-peer: error: {name} must be a positive integer, got {value}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    # Before torch loads: its CPU allocations of 2 MB and more go on transparent huge pages (where the kernel's THP
    # mode is "always" or "madvise"): a 92M step's peak resident memory is 2.4 bytes a parameter lower, at the same
    # speed. Memory taken afresh after a while costs more (the kernel compacts to find huge pages), which is why a
    # round's buffers are kept (DiLoCo.recycle). docs/measured.md#scale
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    # hivemind's __init__ imports all of hivemind, torch and scipy among it: load only the parts used, when used.
    # A bootstrap, `status` and `doctor` then never load torch (3 s a process here); a peer skips scipy and
    # hivemind's averager and MoE code.
    import_hivemind_without_torch()
    args = build_parser().parse_args(argv)
    _setup_logging(args.verbose)
    try:
        if args.command == "bootstrap":
            from swarm.bootstrap import run_bootstrap

            return run_bootstrap(settings_from_args(BootstrapSettings, args))
        if args.command == "join":
            return _join(args)
        if args.command == "status":
            return _status(args)
        if args.command == "doctor":
            return _doctor(args)
        if args.command in ("invite", "revoke", "id"):
            return _identity_command(args)
        if args.command == "demo":
            from swarm.demo import run_demo

            _positive("--stages", args.stages)
            if args.peers is None:
                args.peers = 2 * args.stages
            _positive("--peers", args.peers)
            if args.peers < args.stages:
                raise SystemExit(f"swarm-peer: error: --peers {args.peers} cannot host --stages {args.stages}: "
                                 f"give at least one peer per stage")
            _positive("--rounds", args.rounds)
            return run_demo(args)
    except (RecipeError, FlagError) as e:
        logger.error("%s", e)
        return 2
    except KeyboardInterrupt:
        logger.info("interrupted")
        return 130
    return 2


def _join(args: argparse.Namespace) -> int:
    settings = settings_from_args(PeerSettings, args)  # before the slow imports: a bad flag fails at once
    from swarm.dht.node import NodeError
    from swarm.data.prepare import CorpusError
    from swarm.peer.peer import Peer

    move_to = None
    while True:  # a peer that moves to a weaker pipeline stage (rebalancing) leaves the swarm and joins it again
        try:
            peer = Peer(settings, move_to)
        except ValueError as e:
            logger.error("%s", e)
            return 2
        peer.stop.install()
        try:
            peer.start()
            rounds = peer.run()
            move_to = peer.part.move_to if not peer.stop.event.is_set() else None
            if move_to is None:
                logger.info("done: %s averaged, round %d, digest %s", counted(rounds, "round"), peer.diloco.round,
                            peer.diloco.digest())
                return 0
        except concurrent.futures.CancelledError:
            if not peer.stop.event.is_set():
                raise
            logger.info("stopped during start-up")
            return 0
        except (NodeError, CorpusError, RuntimeError) as e:
            logger.error("%s", e)
            return 1
        finally:
            peer.shutdown()
        logger.info("moving to pipeline stage %d: joining again", move_to)


def _identity_command(args: argparse.Namespace) -> int:
    """`id` prints the peer id of a key (made if missing); `invite` prints an invite signed with an existing one;
    `revoke` adds peers to the run's revocation list beside that key (see admission.revocation_file)."""
    from swarm.dht.admission import Invite, InviteError, Revocation, load_revocation, revocation_file, \
        save_revocation
    from swarm.dht.validation import Identity, IdentityError

    if args.command != "id" and not os.path.exists(args.identity_path):
        logger.error("no identity file %s: pass the key your bootstrap runs with (its --identity-path)",
                     args.identity_path)
        return 2
    try:
        identity = Identity.load_or_create(args.identity_path)
        if args.command == "id":
            print(identity.peer_id)
        elif args.command == "invite":
            print(Invite.sign(identity, args.run_id, args.peer_id, args.days).token())
        else:
            path = revocation_file(args.identity_path, args.run_id)
            revocation = Revocation.sign(identity, args.run_id, args.peer_ids,
                                         load_revocation(path, identity, args.run_id))
            save_revocation(path, revocation)
            print(f"revoked the invites of {counted(len(set(args.peer_ids)), 'peer')} to run {args.run_id} "
                  f"({len(revocation.revoked)} in all, list {path}): the bootstrap running with {args.identity_path} "
                  f"publishes it within 5 s; an invite signed from now on admits a peer again")
    except (IdentityError, InviteError) as e:
        logger.error("%s", e)
        return 2
    except OSError as e:
        logger.error("cannot write the revocation list: %s", e)
        return 2
    return 0


def _doctor(args: argparse.Namespace) -> int:
    settings = settings_from_args(PeerSettings, args)
    if not args.verbose:  # its report is the check lines: the node's own progress would only bury them
        logging.getLogger().setLevel(logging.WARNING)
    if args.json:  # stdout is the JSON document alone
        logging.getLogger().handlers[0].setStream(sys.stderr)
    from swarm.doctor import diagnose

    checks = diagnose(settings)
    if args.json:
        print(json.dumps({"ok": all(c.ok for c in checks), "checks": [c.to_json() for c in checks]}, indent=1))
    else:
        print("\n".join(check.line() for check in checks))
    return 0 if all(check.ok for check in checks) else 1


def _status(args: argparse.Namespace) -> int:
    from swarm.dht.node import NetworkOptions, NodeError, SwarmNode
    from swarm.dht.recipes import fetch_recipe
    from swarm.monitoring.status_page import status_json
    from swarm.monitoring.swarm_status import read_swarm, render_status
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
        summary = loop.run(read_swarm(node, recipe), timeout=30)
    except (NodeError, TimeoutError) as e:
        logger.error("%s", e)
        return 1
    finally:
        if node is not None:
            node.shutdown()
        loop.close()
    if args.json:
        print(json.dumps(status_json(summary, recipe.run_id, recipe.digest()), indent=1))
    else:
        print(render_status(summary, recipe.run_id, recipe.digest()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
