#!/usr/bin/env python3
"""Memory footprint of a local swarm: starts `swarm-peer demo`-like processes (a bootstrap and N peers on
127.0.0.1), waits until every peer has averaged a round (model loaded, all-reduce buffers in use), then reports RSS
and PSS of each peer's whole process tree (main process, hivemind DHT process, p2pd). Prints a table, then a JSON
line.

    python scripts/footprint.py --peers 2              # the demo run: 5.3M-parameter Llama
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
import time
from pathlib import Path


def tree(pid: int) -> list[int]:
    """`pid` and all its descendants, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, stack = [], [pid]
    while stack:
        current = stack.pop()
        out.append(current)
        stack += children.get(current, [])
    return out


def memory_kb(pid: int) -> tuple[int, int]:
    """(RSS, PSS) in kB from /proc/PID/smaps_rollup."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return 0, 0
    rss = int(re.search(r"^Rss:\s+(\d+)", text, re.M).group(1))
    pss = int(re.search(r"^Pss:\s+(\d+)", text, re.M).group(1))
    return rss, pss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=2)
    parser.add_argument("--recipe", help="recipe file (default: the embedded demo run)")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="swarm-footprint-"))
    command = [sys.executable, "-m", "swarm"]
    recipe = ["--recipe", args.recipe] if args.recipe else []
    boot = subprocess.Popen(command + ["bootstrap"] + recipe, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    processes = [boot]
    try:
        maddr = None
        for line in boot.stdout:
            match = re.search(r"--initial-peers (\S+)", line)
            if match:
                maddr = match.group(1)
                break
        logs = [open(workdir / f"peer{i}.log", "w+") for i in range(args.peers)]
        peers = [subprocess.Popen(command + ["join", "--initial-peers", maddr, "--device", "cpu", "--num-threads",
                                             str(max(1, (os.cpu_count() or 1) // args.peers))] + recipe,
                                  stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True)
                 for log in logs]
        processes += peers
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if all("round 0: averaged" in Path(log.name).read_text() for log in logs):
                break
            time.sleep(1)
        else:
            raise SystemExit("peers did not average a round within 10 minutes; see " + str(workdir))
        rows = []
        for index, peer in enumerate(peers):
            pids = tree(peer.pid)
            totals = [memory_kb(pid) for pid in pids]
            rows.append({"peer": index, "processes": len(pids), "rss_mb": sum(r for r, _ in totals) / 1024,
                         "pss_mb": sum(p for _, p in totals) / 1024})
        boot_pids = tree(boot.pid)
        boot_totals = [memory_kb(pid) for pid in boot_pids]
        rows.append({"peer": "bootstrap", "processes": len(boot_pids),
                     "rss_mb": sum(r for r, _ in boot_totals) / 1024, "pss_mb": sum(p for _, p in boot_totals) / 1024})
    finally:
        for process in processes:
            try:
                os.killpg(process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for process in processes:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
    print(f"{'process tree':<14}{'processes':>10}{'RSS MB':>10}{'PSS MB':>10}")
    for row in rows:
        print(f"{str(row['peer']):<14}{row['processes']:>10}{row['rss_mb']:>10.0f}{row['pss_mb']:>10.0f}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
