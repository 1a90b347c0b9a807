#!/usr/bin/env python3
"""Compute utilisation (time in inner steps / wall time) of a real swarm on 127.0.0.1, with and without
`outer.overlap`: a bootstrap and --peers peers started through the `swarm-peer` CLI, each training until the
swarm reaches --rounds outer rounds; every peer reports its own utilisation when it stops. Prints a table, then
one JSON line. Also reports how far the rounds' tokens overshoot the recipe's tokens_per_round (peers see each
other's progress through announcements, so a round ends a little after the swarm reached its target).

    python scripts/bench_utilization.py                    # 4 peers, 0.52M-parameter model, 5 rounds, both modes
    python scripts/bench_utilization.py --peers 2 --rounds 3 --modes overlap
    python scripts/bench_utilization.py --netns --mbit 20 --rounds 6   # each peer in its own network namespace,
                                                                        # up and down links shaped by tc tbf (root)
    python scripts/bench_utilization.py --stages 2 --peers 2 --microbatches 2 --netns --mbit 100
        # a pipeline: peer i hosts stage i mod 2; each reports the share of wall time its stage computed (not
        # waiting for the other stage) and the activation and gradient bytes per token on its hops
        # (--bottleneck 16 --activations int8: narrow boundaries, docs/pipelines.md)

All peers share this machine's cores (4 peers on 2 cores: each inner step takes about twice as long as alone).
Without --netns the links are loopback.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

UTILIZATION = re.compile(r"compute utilisation ([\d.]+)%")
MADDR = re.compile(r"--initial-peers (\S+)")
ROUND_TOKENS = re.compile(r"round \d+: averaged (?:with|alone).* sent, (\d+) tokens\)")
ALLREDUCE_SECONDS = re.compile(r"round \d+: averaged (?:with|alone).* in ([\d.]+) s \(")
MATCHMAKING = re.compile(r"round \d+: averaged (?:with|alone).* matchmaking ([\d.]+) s")
BUSY = re.compile(r"pipeline: stage (\d+) busy ([\d.]+)% of .* s \(.*\), ([\d.]+)% of the .*; (\d+) bytes of "
                  r"activations")


def recipe(args: argparse.Namespace, overlap: bool) -> dict:
    tokens_per_step = args.batch * args.seq_len
    return {
        "run_id": f"util-{'overlap' if overlap else 'plain'}-{os.getpid()}",
        "model": {"hidden_size": args.hidden, "intermediate_size": int(args.hidden * 8 / 3) // 8 * 8,
                  "num_layers": args.layers, "num_heads": 4, "max_seq_len": args.seq_len},
        "data": {"vocab_size": 512, "seq_len": args.seq_len, "batch_size": args.batch},
        "inner": {"lr": 0.003, "warmup_tokens": 4 * tokens_per_step},
        "outer": {"overlap": overlap},
        **({"pipeline": {"stages": args.stages, "bottleneck": args.bottleneck, "activations": args.activations,
                         "keep_every": args.keep_every}}
           if args.stages > 1 else {}),
        "averaging": {"codec": "none", "min_group_size": min(2, args.peers // args.stages),  # (a lone stage peer)
                      "target_group_size": args.peers,
                      "matchmaking_timeout": 10, "allreduce_timeout": 60},
        # (in a pipeline only the first stage's peers read batches)
        "tokens_per_round": -(-args.peers // args.stages) * args.inner_steps * tokens_per_step,
        "total_tokens": 10 * args.rounds * args.peers * args.inner_steps * tokens_per_step,
    }


class Child:
    """A `python -m swarm ...` process in its own session, its output kept line by line."""

    def __init__(self, argv: list[str], prefix: list[str] | None = None):
        self.lines: list[str] = []
        self.process = subprocess.Popen([*(prefix or []), sys.executable, "-m", "swarm", *argv],
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        threading.Thread(target=lambda: self.lines.extend(self.process.stdout), daemon=True).start()

    def find(self, pattern: re.Pattern, timeout: float) -> re.Match | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if match := pattern.search(line):
                    return match
            if self.process.poll() is not None:
                time.sleep(0.5)  # let the reader catch up with the last lines
                return next((m for line in self.lines if (m := pattern.search(line))), None)
            time.sleep(0.1)
        return None

    def kill(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()


def _mean(pattern: re.Pattern, peers: list[Child]) -> float:
    values = [float(m.group(1)) for peer in peers for line in peer.lines if (m := pattern.search(line))]
    return sum(values) / max(len(values), 1)


def run(args: argparse.Namespace, overlap: bool, workdir: Path) -> dict:
    if not args.netns:
        return _run(args, overlap, workdir, None)
    from allreduce_bench import Namespaces

    mbits = [float(x) for x in args.mbit.split(",")] if args.mbit else [0.0]
    mbits += [mbits[-1]] * (args.peers - len(mbits))
    with Namespaces(args.peers + 1, mbits[:args.peers] + [0.0]) as spaces:  # the last one: the bootstrap's
        return _run(args, overlap, workdir, spaces)


def _run(args: argparse.Namespace, overlap: bool, workdir: Path, spaces) -> dict:
    path = workdir / f"recipe-{'overlap' if overlap else 'plain'}.yaml"
    path.write_text(yaml.safe_dump(recipe(args, overlap)))
    children: list[Child] = []

    def where(index: int) -> tuple[list[str], list[str]]:  # (command prefix, listening address options)
        if spaces is None:
            return [], []
        return spaces.prefix(index), ["--host-maddrs", f"/ip4/{spaces.address(index)}/tcp/0"]

    try:
        prefix, listen = where(args.peers)
        boot = Child(["bootstrap", "--recipe", str(path), *listen], prefix)
        children.append(boot)
        found = boot.find(MADDR, 60)
        if found is None:
            raise RuntimeError("the bootstrap printed no address:\n" + "".join(boot.lines[-20:]))
        started = time.monotonic()
        peers = [Child(["join", "--initial-peers", found.group(1), "--device", "cpu", "--num-threads", "1",
                        "--cache-dir", args.cache_dir, "--until-round", str(args.rounds), *where(i)[1],
                        *(["--stage", str(i % args.stages), "--microbatches", str(args.microbatches)]
                          if args.stages > 1 else [])],
                       where(i)[0])
                 for i in range(args.peers)]
        children += peers
        values, wire, spans = [], [], []
        for index, peer in enumerate(peers):
            # (a stage peer's inner steps include waiting for the other stages: it reports its busy share instead,
            # of its whole run and of the span from its first microbatch to its last)
            match = peer.find(BUSY if args.stages > 1 else UTILIZATION, args.timeout - (time.monotonic() - started))
            if match is None:
                raise RuntimeError(f"peer {index} reported no utilisation:\n" + "".join(peer.lines[-30:]))
            values.append(float(match.group(2 if args.stages > 1 else 1)) / 100)
            spans.append(float(match.group(3)) / 100 if args.stages > 1 else None)
            wire.append(int(match.group(4)) if args.stages > 1 else 0)
        # Tokens each round averaged (every member logs the same total), against the recipe's target.
        tokens = [int(m.group(1)) for line in peers[0].lines if (m := ROUND_TOKENS.search(line))]
        target = recipe(args, overlap)["tokens_per_round"]
        return {"overlap": overlap, "peers": args.peers, "rounds": args.rounds, "mbit": args.mbit or "",
                "stages": args.stages, "microbatches": args.microbatches if args.stages > 1 else None,
                "bottleneck": args.bottleneck, "activations": args.activations, "keep_every": args.keep_every,
                "wire_bytes_per_token": wire, "busy_of_span": spans,
                "allreduce_seconds": _mean(ALLREDUCE_SECONDS, peers),
                "matchmaking_seconds": _mean(MATCHMAKING, peers), "utilization": values,
                "mean": sum(values) / len(values), "seconds": time.monotonic() - started,
                "tokens_per_round": tokens, "tokens_over_target": sum(tokens) / len(tokens) / target - 1}
    finally:
        for child in children:
            child.kill()
        if args.log_dir:
            mode = "overlap" if overlap else "plain"
            Path(args.log_dir).mkdir(parents=True, exist_ok=True)
            for index, child in enumerate(children):
                name = "bootstrap" if index == 0 else f"peer{index - 1}"
                (Path(args.log_dir) / f"{mode}-{name}.log").write_text("".join(child.lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5, help="peers stop once the swarm reaches this round")
    parser.add_argument("--inner-steps", type=int, default=50, help="inner steps per peer per round (on average)")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--modes", default="plain,overlap", help="comma-separated: plain, overlap")
    parser.add_argument("--stages", type=int, default=1, help="cut the model into this many pipeline stages")
    parser.add_argument("--microbatches", type=int, default=2, help="with --stages: each batch as K in flight")
    parser.add_argument("--bottleneck", type=int, default=0, help="with --stages: pipeline.bottleneck, values a token")
    parser.add_argument("--activations", default="fp16", help="with --stages: pipeline.activations, fp16 or int8")
    parser.add_argument("--keep-every", type=int, default=5, help="with --stages: pipeline.keep_every, rounds "
                        "between the stage backups the peers of the stage before take (0: none)")
    parser.add_argument("--cache-dir", default=str(Path(tempfile.gettempdir()) / "swarm-bench-cache"))
    parser.add_argument("--timeout", type=float, default=600.0, help="per mode")
    parser.add_argument("--log-dir", help="write every process's output there")
    parser.add_argument("--netns", action="store_true", help="one network namespace per peer (root)")
    parser.add_argument("--mbit", help="per-peer link rates in Mbit/s, e.g. 20 or 10,20,40,80 (needs --netns)")
    args = parser.parse_args()
    if args.mbit and not args.netns:
        parser.error("--mbit needs --netns")
    if args.stages > 1:
        args.modes = "plain"  # (stages do not run with outer.overlap yet)
    if args.netns:
        from allreduce_bench import netns_available

        if (reason := netns_available()) is not None:
            parser.error(f"--netns: {reason}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind through `finally`: kill our children
    results = []
    with tempfile.TemporaryDirectory() as workdir:
        for mode in args.modes.split(","):
            results.append(run(args, mode == "overlap", Path(workdir)))
            row = results[-1]
            print(f"  {mode}: {', '.join(f'{v:.1%}' for v in row['utilization'])} ({row['seconds']:.0f} s)",
                  flush=True)
    print(f"{'mode':<10}{'peers':>6}{'rounds':>7}{'mean':>8}{'min':>8}{'max':>8}{'seconds':>9}"
          f"{'s/round':>9}{'matchmaking s':>15}{'all-reduce s':>14}{'tokens/round vs target':>24}")
    for row in results:
        print(f"{'overlap' if row['overlap'] else 'plain':<10}{row['peers']:>6}{row['rounds']:>7}"
              f"{row['mean']:>8.1%}{min(row['utilization']):>8.1%}{max(row['utilization']):>8.1%}"
              f"{row['seconds']:>9.0f}{row['seconds'] / row['rounds']:>9.1f}{row['matchmaking_seconds']:>15.2f}"
              f"{row['allreduce_seconds']:>14.2f}{row['tokens_over_target']:>+24.1%}")
        if row["stages"] > 1:  # per peer: its stage, the share of wall time it computed, its hops' bytes per token
            for index, (busy, span, wire) in enumerate(zip(row["utilization"], row["busy_of_span"],
                                                           row["wire_bytes_per_token"])):
                print(f"  peer {index} stage {index % row['stages']} ({row['microbatches']} microbatches in flight): "
                      f"busy {busy:.1%} of its run, {span:.1%} from its first microbatch to its last; {wire} "
                      "activation and gradient bytes per token")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
