#!/usr/bin/env python3
"""How fast a late joiner downloads the swarm's state (global params + outer momentum), against its link.

Holders and a joiner each run in their own network namespace with `tc tbf` shaping both directions of their
link (the harness of allreduce_bench.py; root needed). Every holder serves the same seeded state; the joiner
downloads it by range from all of them at once, verifies it and loads it. Prints a table, then one JSON line.

    python scripts/bench_state_sync.py                       # the default cases below
    python scripts/bench_state_sync.py --size-mb 100 --holders 25,25,25 --joiner 100
    python scripts/bench_state_sync.py --behind 2 --codec int8   # a peer 2 rounds behind: it replays them

With --behind K the holders took K more rounds (their averages encoded by --codec, as an all-reduce delivers
them) and the joiner holds the state of K rounds ago: it catches up by replaying the holders' logged outer steps
(state_sync.sync_state) rather than downloading the state. "Link" is the rate the transfer cannot beat:
min(joiner's rate, sum of the holders' rates).
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

RUN = "bench-state"
CASES = [  # (holder Mbit/s list, joiner Mbit/s)
    ([100.0], 100.0),
    ([25.0, 25.0, 25.0], 100.0),
    ([200.0, 200.0], 50.0),
]


def _model(size_mb: float):
    """A bias-free linear layer whose params and momentum (fp32) take about `size_mb` MB."""
    import torch

    width = 1024
    return torch.nn.Linear(width, max(int(size_mb * 1e6 / 8 / width), 1), bias=False)


def _state(size_mb: float, behind: int = 0, codec: str = "int8"):
    """A seeded DiLoCo state of about `size_mb` MB on the wire (params and momentum, fp32), `behind` rounds on
    (their averages as 4 reducers' `codec` chunks)."""
    import torch

    from swarm.compression import decode, get_codec
    from swarm.config import OuterRecipe
    from swarm.peer.diloco import DiLoCo

    torch.manual_seed(0)
    diloco = DiLoCo(_model(size_mb), OuterRecipe())
    diloco.outer_step(torch.randn(diloco.numel, generator=torch.Generator().manual_seed(1)), 1)
    bounds = [diloco.numel * i // 4 for i in range(5)]
    for step in range(behind):
        average = torch.randn(diloco.numel, generator=torch.Generator().manual_seed(2 + step)) * 1e-3
        wire = [(a, b, get_codec(codec).encode(average[a:b])) for a, b in zip(bounds, bounds[1:])]
        diloco.outer_step(torch.cat([decode(payload) for _, _, payload in wire]), 1, wire)
    return diloco


def holder(args: argparse.Namespace) -> None:
    import threading

    from swarm.dht.node import NetworkOptions, SwarmNode
    from swarm.peer.state.serve import serve_state
    from swarm.runtime import LoopThread

    diloco = _state(args.size_mb, args.behind, args.codec)
    loop = LoopThread()
    node = SwarmNode([], NetworkOptions(host_maddrs=(args.host_maddr,)))
    loop.run(serve_state(node, RUN, diloco))
    print(json.dumps({"maddr": node.visible_maddrs()[0], "peer_id": node.peer_id, "digest": diloco.digest()}),
          flush=True)
    threading.Event().wait()  # serve until the coordinator kills us


def joiner(args: argparse.Namespace) -> None:
    from swarm.dht.node import NetworkOptions, SwarmNode
    from swarm.peer.state.sync import sync_state
    from swarm.runtime import LoopThread

    from swarm.config import OuterRecipe
    from swarm.peer.diloco import DiLoCo

    # Behind: the holders' state of `behind` rounds ago. Else a fresh one, of the shapes the download fills in.
    mine = _state(args.size_mb) if args.behind else DiLoCo(_model(args.size_mb), OuterRecipe())
    loop = LoopThread()
    maddrs = args.holders.split(",")
    node = SwarmNode(maddrs, NetworkOptions(host_maddrs=(args.host_maddr,)))
    ids = [maddr.rsplit("/p2p/", 1)[1] for maddr in maddrs]
    done = loop.run(sync_state(node, ids, RUN, mine, args.digest))
    assert mine.digest() == args.digest
    served = (done.downloaded or done.replayed).bytes_by_holder
    how = "download" if done.downloaded is not None else f"replay {done.replayed.steps}"
    print(json.dumps({"seconds": done.seconds, "how": how, "bytes": done.bytes,
                      "holders_used": sum(1 for n in served.values() if n)}), flush=True)
    node.shutdown()
    loop.close()


def run_case(holder_mbits: list[float], joiner_mbit: float, size_mb: float, behind: int = 0,
             codec: str = "int8") -> dict:
    from allreduce_bench import Namespaces, kill_sessions

    count = len(holder_mbits) + 1
    processes = []
    with Namespaces(count, holder_mbits + [joiner_mbit]) as spaces:
        try:
            infos = []
            for index in range(len(holder_mbits)):
                argv = [sys.executable, __file__, "holder", "--size-mb", str(size_mb), "--behind", str(behind),
                        "--codec", codec, "--host-maddr", f"/ip4/{spaces.address(index)}/tcp/0"]
                process = subprocess.Popen(spaces.prefix(index) + argv, stdout=subprocess.PIPE, text=True,
                                           start_new_session=True)
                processes.append(process)
                infos.append(json.loads(process.stdout.readline()))
            joiner_index = len(holder_mbits)
            argv = [sys.executable, __file__, "joiner", "--size-mb", str(size_mb), "--digest", infos[0]["digest"],
                    "--behind", str(behind), "--codec", codec,
                    "--holders", ",".join(i["maddr"] for i in infos),
                    "--host-maddr", f"/ip4/{spaces.address(joiner_index)}/tcp/0"]
            process = subprocess.Popen(spaces.prefix(joiner_index) + argv, stdout=subprocess.PIPE, text=True,
                                       start_new_session=True)
            processes.append(process)
            out, _ = process.communicate(timeout=600)
            rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
            if process.returncode != 0 or not rows:
                raise RuntimeError(f"joiner failed (exit {process.returncode})")
            row = rows[-1]
        finally:
            kill_sessions(processes)
    link = min(joiner_mbit, sum(holder_mbits)) * 1e6 / 8
    achieved = row["bytes"] / row["seconds"]
    return {"holders_mbit": holder_mbits, "joiner_mbit": joiner_mbit, "how": row["how"], "mb": row["bytes"] / 1e6,
            "seconds": row["seconds"], "mb_per_s": achieved / 1e6, "link_mb_per_s": link / 1e6,
            "fraction_of_link": achieved / link, "holders_used": row["holders_used"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", nargs="?", choices=("holder", "joiner"), help=argparse.SUPPRESS)
    parser.add_argument("--size-mb", type=float, default=50.0, help="state size in MB (params + momentum)")
    parser.add_argument("--holders", help="holders' link rates in Mbit/s, e.g. 25,25,25 (default: built-in cases)")
    parser.add_argument("--joiner", type=float, default=100.0, help="joiner's link rate in Mbit/s")
    parser.add_argument("--behind", type=int, default=0,
                        help="rounds the joiner's own state is behind the holders' (0: it downloads the state)")
    parser.add_argument("--codec", default="int8", help="codec of the averages of those rounds")
    parser.add_argument("--host-maddr", help=argparse.SUPPRESS)
    parser.add_argument("--digest", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode == "holder":
        return holder(args)
    if args.mode == "joiner":
        return joiner(args)
    from allreduce_bench import netns_available

    reason = netns_available()
    if reason:
        sys.exit(f"bench_state_sync: {reason}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind through `finally`: namespaces are removed
    cases = [([float(x) for x in args.holders.split(",")], args.joiner)] if args.holders else CASES
    results = []
    for holder_mbits, joiner_mbit in cases:
        started = time.monotonic()
        results.append(run_case(holder_mbits, joiner_mbit, args.size_mb, args.behind, args.codec))
        print(f"case {holder_mbits} -> {joiner_mbit} done in {time.monotonic() - started:.0f} s", file=sys.stderr)
    print(f"{'holders (Mbit/s)':<20}{'joiner':>8}{'how':>10}{'MB':>8}{'seconds':>9}{'MB/s':>8}{'link MB/s':>11}"
          f"{'of link':>9}{'used':>6}")
    for r in results:
        print(f"{','.join(f'{m:g}' for m in r['holders_mbit']):<20}{r['joiner_mbit']:>8g}{r['how']:>10}{r['mb']:>8.1f}"
              f"{r['seconds']:>9.2f}{r['mb_per_s']:>8.2f}{r['link_mb_per_s']:>11.2f}{r['fraction_of_link']:>9.0%}"
              f"{r['holders_used']:>6}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
