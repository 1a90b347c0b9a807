#!/usr/bin/env python3
"""Benchmark and check harness for the group all-reduce: N worker processes (optionally each in its own network
namespace with shaped bandwidth) average seeded random vectors through our GroupAllReduce, or through hivemind's
DecentralizedAverager for comparison, or (--engine tcp) just the bytes a butterfly moves over plain TCP sockets:
the floor these links allow a butterfly; (--engine tcp-ring) the same for a ring. Prints a table, then one JSON
line.

    python scripts/allreduce_bench.py --peers 4 --size-mb 100                 # loopback
    python scripts/allreduce_bench.py --peers 4 --size-mb 25 --netns --mbit 25,50,100,200 --engine both
    python scripts/allreduce_bench.py --peers 4 --size-mb 25 --netns --mbit 100 --engine all   # + TCP floors
    python scripts/allreduce_bench.py --peers 3 --numel 1000000 --codec int8 --save DIR   # used by the tests

With --save, every worker writes its input vectors, weights and results to DIR so a test can check them against
the exact weighted mean computed independently.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
ATTEMPTS = 4  # per round


def _vector(index: int, round_no: int, numel: int):
    import torch

    generator = torch.Generator().manual_seed(1000 * index + round_no)
    return torch.randn(numel, generator=generator)


def _vectors(args: argparse.Namespace) -> list:
    """Every round's vector, made before the first round, as a peer has its pseudo-gradient ready when its round
    comes. Drawn between rounds (34 ms for 25 MB on an idle core, but four workers on two cores draw at once), they
    made the workers enter each group formation up to 240 ms apart instead of 50 ms, and the others' round times
    counted the wait."""
    return [_vector(args.index, round_no, args.numel) for round_no in range(args.rounds)]


def _weight(index: int) -> float:
    return float(index + 1)  # unequal weights, so a test can tell weighted from plain means


# ---------------------------------------------------------------- worker: one peer ---------------------------
def worker(args: argparse.Namespace) -> None:
    import logging

    import torch

    torch.set_num_threads(1)
    # Our all-reduce's own account of failed streams goes to stderr, so a failed round can be explained.
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format=f"peer {args.index} %(asctime)s %(name)s: %(message)s")
    logging.getLogger("swarm.averaging").setLevel(logging.INFO)
    logging.getLogger("swarm.dht.direct").setLevel(logging.INFO)
    if args.engine == "hivemind":
        return _hivemind_worker(args)
    if args.engine in ("tcp", "tcp-ring"):
        return _tcp_worker(args)
    from swarm.averaging.allreduce import AllReduceError, GroupAllReduce
    from swarm.averaging.deadlines import AdaptiveDeadlines
    from swarm.averaging.group_push import GroupPush
    from swarm.averaging.matchmaking import Candidate, form_group
    from swarm.dht.node import NetworkOptions, SwarmNode
    from swarm.runtime import LoopThread

    loop = LoopThread()
    node = SwarmNode([args.initial_peers], NetworkOptions(host_maddrs=(args.host_maddr,),
                                                          direct_streams=not args.libp2p_only))
    codecs = args.codec.split(",")  # round r uses codecs[r % len(codecs)]
    allreduces = {name: GroupAllReduce(node, f"bench-{name}", name, args.numel, AdaptiveDeadlines(30.0, 300.0),
                                       ring=args.ring, aggregator_name=args.aggregator,
                                       verify_reducers=not args.no_verify)
                  for name in codecs}
    for allreduce in allreduces.values():
        loop.run(allreduce.start())
    push = GroupPush(node, "bench")
    loop.run(push.start())
    bandwidth = args.bandwidth_hint or 12.5e6
    vectors = _vectors(args)
    for round_no in range(args.rounds):
        codec = codecs[round_no % len(codecs)]
        allreduce = allreduces[codec]
        vector = vectors[round_no]
        # A failed attempt (nothing applied anywhere) is redone at once under the next attempt number, as peers
        # do; every failure is still reported (and counted in the summary's errors).
        for attempt in range(ATTEMPTS):
            started, cpu = time.monotonic(), time.process_time()
            # (weight and nonce commitment in the entry, as peers give them: centered_clip's reducers are verified)
            push.verified = allreduce.verifiable  # (each round's codec decides whether its reducers are checked)
            me_as = Candidate("0" * 16, bandwidth, False, weight=_weight(args.index),
                              commitment=allreduce.commitment(round_no, attempt))
            group, _ = loop.run(form_group(node, "bench", round_no, attempt, me_as, set(), args.peers, args.peers,
                                           timeout=120.0, push=push, verified=allreduce.verifiable))
            matched = time.monotonic()
            if group is None:
                print(json.dumps({"index": args.index, "round": round_no, "attempt": attempt, "error": "no group"}),
                      flush=True)
                print(f"peer {args.index} round {round_no}: no group", file=sys.stderr, flush=True)
                break
            try:
                result = loop.run(allreduce.run(group, vector, _weight(args.index)))
            except AllReduceError as e:
                print(json.dumps({"index": args.index, "round": round_no, "attempt": attempt, "error": str(e)}),
                      flush=True)
                print(f"peer {args.index} round {round_no} attempt {attempt}: {e}", file=sys.stderr, flush=True)
                continue
            done = time.monotonic()
            if args.save:
                torch.save({"codec": codec, "ring": allreduce.uses_ring(group), "vector": vector,
                            "weight": _weight(args.index),
                            "average": result.average, "members": list(group.members), "shares": list(group.shares),
                            "peer_id": node.peer_id}, Path(args.save) / f"peer{args.index}-round{round_no}.pt")
            print(json.dumps({"index": args.index, "round": round_no, "attempt": attempt,
                              "seconds": done - started, "allreduce_seconds": done - matched,
                              "verification_seconds": result.verification_seconds,
                              "cpu_seconds": time.process_time() - cpu,  # (every thread of this worker's process)
                              "bytes_sent": result.bytes_sent, "group": len(group.members),
                              "ring": allreduce.uses_ring(group),
                              "streams": dict(node.direct.opened) if node.direct else {}}), flush=True)
            break
    node.shutdown()
    loop.close()


def _hivemind_worker(args: argparse.Namespace) -> None:
    import hivemind
    import torch
    from hivemind.averaging import DecentralizedAverager

    dht = hivemind.DHT(initial_peers=[args.initial_peers], start=True, host_maddrs=[args.host_maddr],
                       nat_port_map=False, auto_nat=False, use_relay=False, use_auto_relay=False, use_ipfs=False)
    tensor = torch.zeros(args.numel)
    averager = DecentralizedAverager([tensor], dht, prefix="bench", start=True, target_group_size=args.peers,
                                     min_group_size=args.peers, min_matchmaking_time=1.0, request_timeout=30.0,
                                     next_chunk_timeout=30.0, allreduce_timeout=300.0,
                                     bandwidth=args.bandwidth_hint or None)
    vectors = _vectors(args)
    for round_no in range(args.rounds):
        with averager.get_tensors() as tensors:
            tensors[0].copy_(vectors[round_no])
        started = time.monotonic()
        gathered = averager.step(weight=_weight(args.index), timeout=300)
        done = time.monotonic()
        print(json.dumps({"index": args.index, "round": round_no, "seconds": done - started,
                          "group": len(gathered) if gathered else 0,
                          **({} if gathered else {"error": "hivemind step failed"})}), flush=True)
    averager.shutdown()
    dht.shutdown()


def _tcp_worker(args: argparse.Namespace) -> None:
    """The harness's floor, not an all-reduce: every pair of workers exchanges over one plain TCP connection the
    bytes a butterfly all-reduce with these shares moves between them, S * (p_i + p_j) each way, all at once and
    with no dependency between the scatter and the gather. No all-reduce over TCP through these links can be
    faster; the gap between this and the butterfly bound is what the links themselves (frame headers, ACKs on the
    upload, TCP's congestion control under `tbf`) cost.

    As "tcp-ring", the floor of our ring instead: each worker streams 2 (N-1)/N S to its successor only, in the
    ring's chunks, each (after the first step) sent once the predecessor's chunk it depends on has arrived."""
    import socket

    from swarm.averaging.partition import optimal_shares

    addresses = [(host, int(port)) for host, port in (a.rsplit(":", 1) for a in args.tcp_addresses.split(","))]
    n, me = args.peers, args.index
    bandwidths = [float(b) for b in args.tcp_bandwidths.split(",")] if args.tcp_bandwidths else [1.0] * n
    shares = optimal_shares(bandwidths, [True] * n)
    size = args.numel * 4
    listener = socket.create_server(addresses[me], backlog=n)
    connections: dict[int, socket.socket] = {}
    for j in range(me + 1, n):  # the lower index connects, so each pair has exactly one connection
        deadline = time.monotonic() + 60
        while True:
            try:
                connection = socket.create_connection(addresses[j], timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        connection.sendall(me.to_bytes(4, "big"))
        connections[j] = connection
    while len(connections) < n - 1:
        connection, _ = listener.accept()
        connections[int.from_bytes(_read(connection, 4), "big")] = connection
    for connection in connections.values():
        connection.settimeout(None)
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    block = bytes(1 << 20)
    for round_no in range(args.rounds):
        for connection in connections.values():  # start together: everyone is connected and waiting
            connection.sendall(b"R")
        for connection in connections.values():
            _read(connection, 1)
        started, cpu = time.monotonic(), time.process_time()
        if args.engine == "tcp-ring":
            sent_bytes = _tcp_ring(connections, me, n, args.numel)
            seconds = time.monotonic() - started
            print(json.dumps({"index": me, "round": round_no, "attempt": 0, "seconds": seconds,
                              "allreduce_seconds": seconds, "bytes_sent": sent_bytes, "group": n,
                              "cpu_seconds": time.process_time() - cpu}), flush=True)
            continue
        volume = {j: int(size * (shares[me] + shares[j])) for j in connections}

        def send(j: int) -> None:
            left = volume[j]
            while left:
                sent = connections[j].send(memoryview(block)[:min(left, len(block))])
                left -= sent

        threads = [threading.Thread(target=send, args=(j,)) for j in connections]
        threads += [threading.Thread(target=_read, args=(connections[j], volume[j], False)) for j in connections]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        seconds = time.monotonic() - started
        print(json.dumps({"index": me, "round": round_no, "attempt": 0, "seconds": seconds,
                          "allreduce_seconds": seconds, "bytes_sent": sum(volume.values()), "group": n,
                          "cpu_seconds": time.process_time() - cpu}), flush=True)
    for connection in connections.values():
        connection.close()
    listener.close()


def _tcp_ring(connections: dict, me: int, n: int, numel: int) -> int:
    """One ring all-reduce's bytes and dependencies (no arithmetic); returns the bytes sent."""
    from swarm.averaging.common import chunk_bounds
    from swarm.averaging.ring import builds_on, ring_schedule
    from swarm.averaging.partition import partition

    chunking = [chunk_bounds(a, b) for a, b in partition(numel, n)]
    mine, theirs = ring_schedule(me, chunking), ring_schedule((me - 1) % n, chunking)
    arrived = {item: threading.Event() for item in theirs}
    successor, predecessor = connections[(me + 1) % n], connections[(me - 1) % n]

    def receive() -> None:
        for kind, part, k in theirs:
            a, b = chunking[part][k]
            _read(predecessor, 4 * (b - a), False)
            arrived[(kind, part, k)].set()

    def send() -> None:
        for item in mine:
            a, b = chunking[item[1]][item[2]]
            needed = builds_on(me, n, item)
            if needed is not None:
                arrived[needed].wait()
            successor.sendall(bytes(4 * (b - a)))

    threads = [threading.Thread(target=send), threading.Thread(target=receive)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(4 * (chunking[part][k][1] - chunking[part][k][0]) for _, part, k in mine)


def _read(connection, count: int, keep: bool = True) -> bytes:
    chunks, left = [], count
    while left:
        data = connection.recv(min(left, 1 << 20))
        if not data:
            raise ConnectionError("peer closed the connection")
        left -= len(data)
        if keep:
            chunks.append(data)
    return b"".join(chunks)


# ---------------------------------------------------------------- network namespaces -------------------------
class Namespaces:
    """A hub namespace with a bridge and one namespace per peer, joined by veth pairs; `tc tbf` limits each
    peer's upload (on its side of the veth) and download (on the hub side). Addresses are inside these
    namespaces only (10.231.0.0/24), made and removed by this object. Needs root and `ip netns`.

    `congestion_control` (e.g. "reno") is the TCP congestion control of every socket in the namespaces, whatever
    process owns it (None: the host's default, which new namespaces inherit)."""

    SUBNET = "10.231.0"

    def __init__(self, count: int, mbits: list[float], congestion_control: str | None = None):
        self.tag = f"{os.getpid() % 100000}"
        self.hub = f"swh{self.tag}"
        self.names = [f"swp{self.tag}-{i}" for i in range(count)]
        self.mbits = mbits
        self.congestion_control = congestion_control
        self.created: list[str] = []

    def _ip(self, *argv: str) -> None:
        subprocess.run(["ip", *argv], check=True, capture_output=True, text=True)

    def address(self, index: int) -> str:
        return f"{self.SUBNET}.{index + 10}"

    def __enter__(self) -> "Namespaces":
        try:
            self._ip("netns", "add", self.hub)
            self.created.append(self.hub)
            self._ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            self._ip("-n", self.hub, "link", "set", "br0", "up")
            self._ip("-n", self.hub, "link", "set", "lo", "up")
            for index, name in enumerate(self.names):
                self._ip("netns", "add", name)
                self.created.append(name)
                outer, inner = f"h{index}", f"p{index}"
                self._ip("-n", self.hub, "link", "add", outer, "type", "veth", "peer", "name", inner, "netns", name)
                self._ip("-n", self.hub, "link", "set", outer, "master", "br0")
                self._ip("-n", self.hub, "link", "set", outer, "up")
                self._ip("-n", name, "addr", "add", f"{self.address(index)}/24", "dev", inner)
                self._ip("-n", name, "link", "set", inner, "up")
                self._ip("-n", name, "link", "set", "lo", "up")
                if self.congestion_control:
                    subprocess.run(["ip", "netns", "exec", name, "sysctl", "-w",
                                    f"net.ipv4.tcp_congestion_control={self.congestion_control}"],
                                   check=True, capture_output=True, text=True)
                mbit = self.mbits[index] if index < len(self.mbits) else 0
                if mbit > 0:
                    burst = max(int(mbit * 1e6 / 8 / 100), 16 * 1024)  # ~10 ms of traffic
                    for namespace, device in ((name, inner), (self.hub, outer)):
                        subprocess.run(["ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", device, "root",
                                        "tbf", "rate", f"{mbit}mbit", "burst", str(burst), "latency", "200ms"],
                                       check=True, capture_output=True, text=True)
        except (subprocess.CalledProcessError, FileNotFoundError) as e:
            self.__exit__(None, None, None)
            detail = e.stderr.strip() if isinstance(e, subprocess.CalledProcessError) else str(e)
            raise RuntimeError(f"cannot build network namespaces: {detail}") from None
        return self

    def __exit__(self, *exc) -> None:
        for name in reversed(self.created):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self.created.clear()

    def prefix(self, index: int) -> list[str]:
        return ["ip", "netns", "exec", self.names[index]]


def kill_sessions(processes: list[subprocess.Popen]) -> None:
    """SIGKILL each process's whole session (`ip netns exec` may fork) and reap it."""
    for process in processes:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()


def netns_available() -> str | None:
    """None if namespaces can be made here, else the reason they cannot."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    try:
        with Namespaces(1, [10]):
            return None
    except RuntimeError as e:
        return str(e)


# ---------------------------------------------------------------- coordinator --------------------------------
def run(args: argparse.Namespace, engine: str) -> dict:
    """Start a bootstrap and `args.peers` workers; return per-round timings."""
    from swarm.dht.node import NetworkOptions, SwarmNode

    mbits = [float(x) for x in args.mbit.split(",")] if args.mbit else []
    if mbits and len(mbits) < args.peers:
        mbits += [mbits[-1]] * (args.peers - len(mbits))
    namespaces = Namespaces(args.peers + 1, mbits + [0.0], args.congestion_control) if args.netns else None
    if namespaces:
        namespaces.__enter__()
    processes = []
    try:
        boot_host = f"/ip4/{namespaces.address(args.peers)}/tcp/0" if namespaces else "/ip4/127.0.0.1/tcp/0"
        if namespaces:  # the bootstrap DHT node lives in its own unshaped namespace
            boot = subprocess.Popen(namespaces.prefix(args.peers) + [sys.executable, __file__, "dht",
                                                                    "--host-maddr", boot_host],
                                    stdout=subprocess.PIPE, text=True, start_new_session=True)
            processes.append(boot)
            maddr = boot.stdout.readline().strip()
            node = None
        else:
            node = SwarmNode([], NetworkOptions())
            maddr = node.visible_maddrs()[0]
        tcp_port = 20000 + os.getpid() % 20000  # the tcp engine's fixed ports (one per worker on loopback)
        tcp_addresses = ",".join(f"{namespaces.address(i)}:{tcp_port}" if namespaces else f"127.0.0.1:{tcp_port + i}"
                                 for i in range(args.peers))
        tcp_bandwidths = ",".join(str(mbits[i]) for i in range(args.peers)) if mbits and args.bandwidth_hints else ""
        for index in range(args.peers):
            host = f"/ip4/{namespaces.address(index)}/tcp/0" if namespaces else "/ip4/127.0.0.1/tcp/0"
            hint = mbits[index] * 1e6 / 8 if mbits and args.bandwidth_hints else 0.0
            argv = [sys.executable, __file__, "worker", "--initial-peers", maddr, "--index", str(index),
                    "--peers", str(args.peers), "--numel", str(args.numel), "--codec", args.codec,
                    "--rounds", str(args.rounds), "--engine", engine, "--host-maddr", host,
                    "--bandwidth-hint", str(hint), "--tcp-addresses", tcp_addresses,
                    "--tcp-bandwidths", tcp_bandwidths] + (["--save", args.save] if args.save else []) \
                + (["--libp2p-only"] if args.libp2p_only else []) + ["--ring", args.ring] \
                + ["--aggregator", args.aggregator] + (["--no-verify"] if args.no_verify else [])
            prefix = namespaces.prefix(index) if namespaces else []
            processes.append(subprocess.Popen(prefix + argv, stdout=subprocess.PIPE, text=True,
                                              env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True))
        rows = []
        for process in processes[-args.peers:]:
            out, _ = process.communicate(timeout=args.timeout)
            rows += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        if node is not None:
            node.shutdown()
        label = engine + ("-p2p" if engine == "swarm" and args.libp2p_only else "") + \
            (f"-ring-{args.ring}" if engine == "swarm" and args.ring != "auto" else "") + \
            (f"-{args.aggregator}" if engine == "swarm" and args.aggregator != "mean" else "") + \
            ("-unverified" if engine == "swarm" and args.aggregator == "centered_clip" and args.no_verify else "")
        return {"engine": label, "rows": rows}
    finally:
        kill_sessions(processes)
        if namespaces:
            namespaces.__exit__(None, None, None)


def summarize(result: dict, args: argparse.Namespace) -> dict:
    rows = [r for r in result["rows"] if "error" not in r]
    errors = [r for r in result["rows"] if "error" in r]
    warm = [r for r in rows if r["round"] > 0] or rows  # round 0 includes connection set-up
    per_round, cpu_per_round = {}, {}
    for row in warm:
        per_round.setdefault(row["round"], []).append(row["seconds"])
        if "cpu_seconds" in row:
            cpu_per_round.setdefault(row["round"], []).append(row["cpu_seconds"])
    round_times = [max(times) for times in per_round.values()]  # a round ends when its slowest member ends
    # The CPU every worker spent on a round (its process's every thread, p2pd's not counted), over what the machine's
    # cores could give in that round: near 1, a run whose workers share one machine is bound by it, not the links.
    cpu = [sum(cpu_per_round[r]) for r in cpu_per_round]
    busy = [sum(cpu_per_round[r]) / (os.cpu_count() * max(per_round[r])) for r in cpu_per_round]
    seconds = statistics.median(round_times) if round_times else float("nan")
    transfer = [r["allreduce_seconds"] for r in warm if "allreduce_seconds" in r]  # after group formation
    checking = [r["verification_seconds"] for r in warm if "verification_seconds" in r]  # of the all-reduce's
    size_bytes = args.numel * 4
    for error in errors[:3]:
        print(f"{result['engine']} peer {error['index']} round {error['round']}: {error['error']}", file=sys.stderr)
    return {"engine": result["engine"], "peers": args.peers, "size_mb": size_bytes / 1e6, "codec": args.codec,
            "netns": bool(args.netns), "mbit": args.mbit or "", "congestion_control": args.congestion_control or "",
            "rounds": len(round_times), "round_seconds": seconds,
            "allreduce_seconds": statistics.median(transfer) if transfer else None,
            "verification_seconds": statistics.median(checking) if checking else None,
            "workers_cpu_seconds": statistics.median(cpu) if cpu else None,
            "machine_busy": statistics.median(busy) if busy else None, "cores": os.cpu_count(),
            "gb_per_s": size_bytes / seconds / 1e9 if round_times else None, "errors": len(errors),
            "ring_rounds": len({r["round"] for r in warm if r.get("ring")})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode")
    w = sub.add_parser("worker")
    w.add_argument("--initial-peers", required=True)
    w.add_argument("--index", type=int, required=True)
    w.add_argument("--peers", type=int, required=True)
    w.add_argument("--numel", type=int, required=True)
    w.add_argument("--codec", default="none")
    w.add_argument("--rounds", type=int, default=1)
    w.add_argument("--engine", default="swarm")
    w.add_argument("--host-maddr", default="/ip4/127.0.0.1/tcp/0")
    w.add_argument("--bandwidth-hint", type=float, default=0.0)
    w.add_argument("--save")
    w.add_argument("--tcp-addresses", default="")
    w.add_argument("--tcp-bandwidths", default="")
    w.add_argument("--libp2p-only", action="store_true")
    w.add_argument("--ring", default="auto")
    w.add_argument("--aggregator", default="mean")
    w.add_argument("--no-verify", action="store_true")
    d = sub.add_parser("dht")
    d.add_argument("--host-maddr", required=True)
    for p in (parser,):
        p.add_argument("--peers", type=int, default=4)
        p.add_argument("--size-mb", type=float, default=100.0, help="vector size in MB of fp32")
        p.add_argument("--numel", type=int, help="vector size in elements (overrides --size-mb)")
        p.add_argument("--codec", default="none")
        p.add_argument("--rounds", type=int, default=3, help="round 0 is a warm-up and not timed")
        p.add_argument("--engine", choices=("swarm", "hivemind", "both", "tcp", "tcp-ring", "all"), default="swarm",
                       help="both: swarm and hivemind; tcp: the bytes a butterfly moves over plain TCP (the "
                            "harness's floor, no all-reduce); tcp-ring: the same for a ring; all: the four")
        p.add_argument("--netns", action="store_true", help="one network namespace per peer (root)")
        p.add_argument("--mbit", help="per-peer link rates in Mbit/s, e.g. 25,50,100,200 (needs --netns)")
        p.add_argument("--congestion-control", metavar="NAME",
                       help="TCP congestion control in every namespace, for every engine alike (e.g. reno; "
                            "default: the host's, see /proc/sys/net/ipv4/tcp_congestion_control)")
        p.add_argument("--bandwidth-hints", action="store_true",
                       help="tell each engine its peer's link rate (our partition and hivemind's `bandwidth`)")
        p.add_argument("--save", help="directory for inputs and results (for tests)")
        p.add_argument("--timeout", type=float, default=600.0)
        p.add_argument("--libp2p-only", action="store_true",
                       help="our engine without direct streams: every byte through the p2pd daemons")
        p.add_argument("--ring", choices=("auto", "always", "never"), default="auto",
                       help="our engine's averaging.ring: auto (a lossless group with even links averages along "
                            "a ring), always, never (always a butterfly)")
        p.add_argument("--aggregator", choices=("mean", "trimmed_mean", "centered_clip"), default="mean",
                       help="our engine's averaging.aggregator (a robust one averages in a butterfly)")
        p.add_argument("--no-verify", action="store_true",
                       help="reducers unchecked (averaging.verify_reducers: false); by default centered_clip's are")
    args = parser.parse_args()
    if args.mode == "worker":
        return worker(args)
    if args.mode == "dht":
        from swarm.dht.node import NetworkOptions, SwarmNode

        node = SwarmNode([], NetworkOptions(host_maddrs=(args.host_maddr,)))
        print(node.visible_maddrs()[0], flush=True)
        threading.Event().wait()  # serve until the coordinator kills us
        return None
    # SIGTERM (e.g. from `timeout`) must unwind through `finally`, so workers and namespaces are removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.numel = args.numel or int(args.size_mb * 1e6 / 4)
    if args.mbit and not args.netns:
        parser.error("--mbit needs --netns")
    if args.congestion_control and not args.netns:
        parser.error("--congestion-control needs --netns (it is set in the namespaces the harness makes)")
    if args.congestion_control:
        # A namespace other than the host's may only choose among these (the kernel's rule).
        allowed = Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control").read_text().split()
        if args.congestion_control not in allowed:
            parser.error(f"--congestion-control {args.congestion_control}: namespaces here may use only "
                         f"{', '.join(allowed)} (net.ipv4.tcp_allowed_congestion_control)")
    engines = {"both": ("swarm", "hivemind"), "all": ("tcp", "tcp-ring", "swarm", "hivemind")}.get(args.engine,
                                                                                          (args.engine,))
    summaries = [summarize(run(args, engine), args) for engine in engines]
    print(f"{'engine':<10}{'peers':>6}{'MB':>8}{'codec':>7}{'links (Mbit/s)':>18}{'round s':>10}"
          f"{'all-reduce s':>14}{'GB/s':>8}{'errors':>8}{'CPU s a round':>15}{'machine busy':>14}")
    for s in summaries:
        gbps = f"{s['gb_per_s']:.3f}" if s["gb_per_s"] else "-"
        transfer = f"{s['allreduce_seconds']:.2f}" if s["allreduce_seconds"] is not None else "-"
        cpu = f"{s['workers_cpu_seconds']:.2f}" if s.get("workers_cpu_seconds") is not None else "-"
        busy = f"{s['machine_busy']:.0%}" if s.get("machine_busy") is not None else "-"
        print(f"{s['engine']:<10}{s['peers']:>6}{s['size_mb']:>8.1f}{s['codec']:>7}{s['mbit'] or 'loopback':>18}"
              f"{s['round_seconds']:>10.2f}{transfer:>14}{gbps:>8}{s['errors']:>8}{cpu:>15}{busy:>14}")
    print(json.dumps(summaries))


if __name__ == "__main__":
    main()
